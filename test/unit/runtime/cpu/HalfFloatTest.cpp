//===- HalfFloatTest.cpp - 16-bit float conversions -----------------------===//
//
// cpu/HalfFloat (runtime): IEEE fp16 to fp32, as the safetensors reader
// uses it: normals, subnormals, signed zero, infinities and NaN.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cpu/HalfFloat.h"

#include "gtest/gtest.h"

#include <cmath>
#include <limits>

using namespace megaslide::cpu;

namespace {

TEST(HalfFloat, HalfToFloat) {
  EXPECT_EQ(halfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(halfToFloat(0xC000), -2.0f);
  EXPECT_EQ(halfToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(halfToFloat(0x0001), std::ldexp(1.0f, -24)); // smallest subnormal
  EXPECT_EQ(halfToFloat(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_EQ(halfToFloat(0x0400), std::ldexp(1.0f, -14));
  EXPECT_EQ(halfToFloat(0x3555), 0.333251953125f);
  EXPECT_TRUE(std::signbit(halfToFloat(0x8000)) && halfToFloat(0x8000) == 0);
  EXPECT_EQ(halfToFloat(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(halfToFloat(0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(halfToFloat(0x7E00)));
}

} // namespace
