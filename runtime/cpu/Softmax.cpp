//===- Softmax.cpp - The exp of the CPU attention kernels -----------------===//
//
// Eight partial maxima and sums, combined in a fixed order: the loops
// vectorise without -ffast-math and no result depends on how rows are
// split between threads. std::exp for now (scalar).
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cpu/Softmax.h"

#include <cmath>
#include <limits>

using namespace megaslide::cpu;

namespace {

constexpr int kLanes = 8;

float combineSums(const float *lanes) {
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
         ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

} // namespace

float megaslide::cpu::maxOf(const float *x, int64_t n) {
  float lanes[kLanes];
  for (float &l : lanes)
    l = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l)
      lanes[l] = lanes[l] > x[j + l] ? lanes[l] : x[j + l];
  for (; j < n; ++j)
    lanes[0] = lanes[0] > x[j] ? lanes[0] : x[j];
  float m = lanes[0];
  for (int l = 1; l < kLanes; ++l)
    m = m > lanes[l] ? m : lanes[l];
  return m;
}

float megaslide::cpu::expSubAndSum(float *x, int64_t n, float shift) {
  float lanes[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      x[j + l] = std::exp(x[j + l] - shift);
      lanes[l] += x[j + l];
    }
  float tail = 0;
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] - shift);
    tail += x[j];
  }
  return combineSums(lanes) + tail;
}
