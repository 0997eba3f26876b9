//===- ShapeTest.cpp - Shapes in messages ---------------------------------===//
//
// support/Shape.h: the one spelling of a shape in the messages of the graph
// verifiers, the cpu kernels' checks and the host's file readers.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/support/Shape.h"

#include "gtest/gtest.h"

using megaslide::shapeString;

namespace {

TEST(ShapeTest, PrintsDimensionsInBracketsSeparatedByCommas) {
  EXPECT_EQ(shapeString({}), "[]");
  EXPECT_EQ(shapeString({5}), "[5]");
  EXPECT_EQ(shapeString({2, 3, 4}), "[2, 3, 4]");
  EXPECT_EQ(shapeString({-1, 0, 9223372036854775807}),
            "[-1, 0, 9223372036854775807]");
}

} // namespace
