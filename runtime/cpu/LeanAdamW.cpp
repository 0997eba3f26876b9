//===- LeanAdamW.cpp - AdamW with 8-bit or factored moments ---------------===//
//
// Compiled with -ffp-contract=off as AdamW.cpp (runtime/CMakeLists.txt): the
// AdamW arithmetic is cpu::adamwStep's, operation for operation, so an
// update differs from the fp32 one only by what its moments store.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cpu/LeanAdamW.h"
#include "megaslide/runtime/cpu/AdamWMath.h"
#include "megaslide/runtime/cpu/ParallelFor.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <vector>

using namespace megaslide::cpu;

namespace {

/// Below this many elements per thread a pool hand-off costs more than it
/// saves (as AdamW.cpp's).
constexpr int64_t kMinChunk = 1 << 15;

/// torch.linspace(start, end, steps) in float32, element i, as ATen's CPU
/// kernel computes it (a vectorised fused multiply-add): the step in float,
/// the first half start + step i and the second end - step (steps - 1 - i),
/// each rounded once.
float linspaceAt(float start, float end, int64_t steps, int64_t i) {
  float step = (end - start) / static_cast<float>(steps - 1);
  if (i < steps / 2)
    return std::fma(step, static_cast<float>(i), start);
  return std::fma(-step, static_cast<float>(steps - i - 1), end);
}

std::array<float, 256> makeDynamicMap(bool isSigned) {
  constexpr int maxExponentBits = 7, totalBits = 8;
  constexpr int nonSignBits = totalBits - 1;
  std::vector<float> data;
  for (int i = 0; i < maxExponentBits; ++i) {
    int64_t items =
        isSigned ? (int64_t(1) << (i + nonSignBits - maxExponentBits)) + 1
                 : (int64_t(1) << (i + nonSignBits - maxExponentBits + 1)) + 1;
    // 10 ** (i - 6) is a Python number; torch multiplies the float32
    // means by it rounded to float32.
    float scale = static_cast<float>(std::pow(10.0, i - (maxExponentBits - 1)));
    for (int64_t k = 0; k + 1 < items; ++k) {
      float mean = (linspaceAt(0.1f, 1.0f, items, k) +
                    linspaceAt(0.1f, 1.0f, items, k + 1)) /
                   2.0f;
      data.push_back(scale * mean);
      if (isSigned)
        data.push_back(-scale * mean);
    }
  }
  // additional_items = 2^(nonSignBits - maxExponentBits) - 1 = 0.
  data.push_back(0.0f);
  data.push_back(1.0f);
  assert(data.size() == 256 && "the dynamic map has 2^8 values");
  std::sort(data.begin(), data.end());
  std::array<float, 256> map;
  std::copy(data.begin(), data.end(), map.begin());
  return map;
}

using detail::Coefficients;
using detail::loadGrad;
using detail::makeCoefficients;

/// One block: dequantize, AdamW in fp32, requantize.
template <typename Grad>
void updateBlock(const Coefficients &c, int64_t n, float *master,
                 uint8_t *mCodes, float *mAbsmax, uint8_t *vCodes,
                 float *vAbsmax, const Grad *grad) {
  const std::array<float, 256> &sm = dynamicMap(true), &um = dynamicMap(false);
  float m[kQuantBlock], v[kQuantBlock];
  for (int64_t i = 0; i < n; ++i) {
    m[i] = sm[mCodes[i]] * *mAbsmax;
    v[i] = um[vCodes[i]] * *vAbsmax;
  }
  for (int64_t i = 0; i < n; ++i) {
    float g = loadGrad(grad, i) * c.gradScale;
    float mi = detail::firstMoment(c, m[i], g);
    float vi = detail::secondMoment(c, v[i], g);
    master[i] = detail::updatedMaster(c, master[i], mi, vi);
    m[i] = mi;
    v[i] = vi;
  }
  quantizeBlockwise(m, n, /*isSigned=*/true, mCodes, mAbsmax);
  quantizeBlockwise(v, n, /*isSigned=*/false, vCodes, vAbsmax);
}

template <typename Grad>
void adamw8bitImpl(const AdamWHyper &hyper, int64_t n, float *master,
                   uint8_t *mCodes, float *mAbsmax, uint8_t *vCodes,
                   float *vAbsmax, const Grad *grad) {
  if (n <= 0)
    return;
  Coefficients c = makeCoefficients(hyper);
  int64_t threads = std::clamp<int64_t>(n / kMinChunk, 1, cpuThreads());
  parallelChunks(n, threads, kQuantBlock, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += kQuantBlock) {
      int64_t k = b / kQuantBlock;
      updateBlock(c, std::min(kQuantBlock, end - b), master + b, mCodes + b,
                  mAbsmax + k, vCodes + b, vAbsmax + k, grad + b);
    }
  });
}

template <typename Grad>
void statsImpl(const AdamWHyper &hyper, FactoredShape s, const Grad *grad,
               float *rowStat, float *colStat) {
  double beta2 = hyper.beta2, oneMinus = 1.0 - hyper.beta2;
  auto square = [&](int64_t i) {
    double g = static_cast<double>(loadGrad(grad, i) * hyper.gradScale);
    return g * g + kFactoredEps1;
  };
  int64_t threads =
      std::clamp<int64_t>(s.rows * s.cols / kMinChunk, 1, cpuThreads());
  // Rows split over threads, each row summed in order.
  parallelChunks(s.rows, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      double sum = 0;
      for (int64_t j = 0; j < s.cols; ++j)
        sum += square(r * s.cols + j);
      rowStat[r] = static_cast<float>(beta2 * rowStat[r] + oneMinus * sum);
    }
  });
  // Columns split over threads, each column summed over rows in order.
  parallelChunks(s.cols, threads, 16, [&](int64_t begin, int64_t end) {
    std::vector<double> sums(end - begin, 0.0);
    for (int64_t r = 0; r < s.rows; ++r)
      for (int64_t j = begin; j < end; ++j)
        sums[j - begin] += square(r * s.cols + j);
    for (int64_t j = begin; j < end; ++j)
      colStat[j] =
          static_cast<float>(beta2 * colStat[j] + oneMinus * sums[j - begin]);
  });
}

template <typename Grad>
void factoredImpl(const AdamWHyper &hyper, FactoredShape s, int64_t begin,
                  int64_t end, float *master, uint16_t *m, const float *rowStat,
                  const float *colStat, float rowTotal, const Grad *grad) {
  if (end <= begin)
    return;
  Coefficients c = makeCoefficients(hyper);
  int64_t threads =
      std::clamp<int64_t>((end - begin) / kMinChunk, 1, cpuThreads());
  parallelChunks(
      end - begin, threads, kAdamWChunkAlign, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          int64_t e = begin + i;
          float g = loadGrad(grad, i) * c.gradScale;
          float mi = detail::firstMoment(c, bf16ToFloat(m[i]), g);
          // In double: R_i C_j may exceed fp32's range.
          float vi = static_cast<float>(double(rowStat[e / s.cols]) *
                                        double(colStat[e % s.cols]) /
                                        double(rowTotal));
          master[i] = detail::updatedMaster(c, master[i], mi, vi);
          m[i] = floatToBf16(mi);
        }
      });
}

} // namespace

const std::array<float, 256> &megaslide::cpu::dynamicMap(bool isSigned) {
  static const std::array<float, 256> signedMap = makeDynamicMap(true);
  static const std::array<float, 256> unsignedMap = makeDynamicMap(false);
  return isSigned ? signedMap : unsignedMap;
}

uint8_t megaslide::cpu::quantizeCode(const std::array<float, 256> &map,
                                     float x) {
  // The first value above x; its predecessor is the last at or below.
  const float *hi = std::upper_bound(map.begin(), map.end(), x);
  if (hi == map.begin())
    return 0;
  if (hi == map.end())
    return 255;
  const float *lo = hi - 1;
  return static_cast<uint8_t>((x - *lo <= *hi - x ? lo : hi) - map.begin());
}

void megaslide::cpu::quantizeBlockwise(const float *x, int64_t n, bool isSigned,
                                       uint8_t *codes, float *absmax) {
  const std::array<float, 256> &map = dynamicMap(isSigned);
  uint8_t zero = quantizeCode(map, 0.0f);
  for (int64_t b = 0; b < n; b += kQuantBlock) {
    int64_t e = std::min(n, b + kQuantBlock);
    float amax = 0;
    for (int64_t i = b; i < e; ++i)
      amax = std::max(amax, std::fabs(x[i]));
    absmax[b / kQuantBlock] = amax;
    for (int64_t i = b; i < e; ++i)
      codes[i] = amax > 0 ? quantizeCode(map, x[i] / amax) : zero;
  }
}

void megaslide::cpu::dequantizeBlockwise(const uint8_t *codes,
                                         const float *absmax, int64_t n,
                                         bool isSigned, float *x) {
  const std::array<float, 256> &map = dynamicMap(isSigned);
  for (int64_t i = 0; i < n; ++i)
    x[i] = map[codes[i]] * absmax[i / kQuantBlock];
}

void megaslide::cpu::adamw8bitStep(const AdamWHyper &hyper, int64_t n,
                                   float *master, uint8_t *mCodes,
                                   float *mAbsmax, uint8_t *vCodes,
                                   float *vAbsmax, const float *grad) {
  adamw8bitImpl(hyper, n, master, mCodes, mAbsmax, vCodes, vAbsmax, grad);
}

void megaslide::cpu::adamw8bitStep(const AdamWHyper &hyper, int64_t n,
                                   float *master, uint8_t *mCodes,
                                   float *mAbsmax, uint8_t *vCodes,
                                   float *vAbsmax, const uint16_t *gradBf16) {
  adamw8bitImpl(hyper, n, master, mCodes, mAbsmax, vCodes, vAbsmax, gradBf16);
}

void megaslide::cpu::factoredStatsStep(const AdamWHyper &hyper,
                                       FactoredShape shape, const float *grad,
                                       float *rowStat, float *colStat) {
  statsImpl(hyper, shape, grad, rowStat, colStat);
}

void megaslide::cpu::factoredStatsStep(const AdamWHyper &hyper,
                                       FactoredShape shape,
                                       const uint16_t *gradBf16, float *rowStat,
                                       float *colStat) {
  statsImpl(hyper, shape, gradBf16, rowStat, colStat);
}

float megaslide::cpu::factoredRowTotal(FactoredShape shape,
                                       const float *rowStat) {
  double total = 0;
  for (int64_t r = 0; r < shape.rows; ++r)
    total += rowStat[r];
  return static_cast<float>(total);
}

void megaslide::cpu::adamwFactoredStep(const AdamWHyper &hyper,
                                       FactoredShape shape, int64_t begin,
                                       int64_t end, float *master, uint16_t *m,
                                       const float *rowStat,
                                       const float *colStat, float rowTotal,
                                       const float *grad) {
  factoredImpl(hyper, shape, begin, end, master, m, rowStat, colStat, rowTotal,
               grad);
}

void megaslide::cpu::adamwFactoredStep(const AdamWHyper &hyper,
                                       FactoredShape shape, int64_t begin,
                                       int64_t end, float *master, uint16_t *m,
                                       const float *rowStat,
                                       const float *colStat, float rowTotal,
                                       const uint16_t *gradBf16) {
  factoredImpl(hyper, shape, begin, end, master, m, rowStat, colStat, rowTotal,
               gradBf16);
}
