//===- UnitsTest.cpp - Byte quantities and durations as text --------------===//
//
// support/Units (megaslide/Support/Units.h): durations as the reports print
// them.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Support/Units.h"

#include "gtest/gtest.h"

using megaslide::formatSeconds;

namespace {

TEST(UnitsTest, FormatSecondsGivesThreeDecimals) {
  EXPECT_EQ(formatSeconds(0), "0.000 s");
  EXPECT_EQ(formatSeconds(1.2345678), "1.235 s");
  EXPECT_EQ(formatSeconds(0.0004), "0.000 s");
  EXPECT_EQ(formatSeconds(3600.5), "3600.500 s");
}

} // namespace
