//===- LeanAdamW.h - AdamW with 8-bit or factored moments -------*- C++ -*-===//
//
// The host-state policies int8-moments and factored-moments
// (docs/Training.md, "Leaner optimizer states"): AdamW updates whose moments
// take fewer bytes than fp32's 8 per parameter.
//
// int8-moments: both moments block-wise quantized to 8 bits as bitsandbytes'
// 8-bit optimizers (Dettmers et al. 2022): blocks of kQuantBlock elements,
// one fp32 absmax per block and moment, m coded with the signed and v with
// the unsigned dynamic (tree) map. Each update dequantizes a block, runs
// AdamW in fp32 (cpu::adamwStep's formula) and requantizes it.
//
// factored-moments: the second moment of a matrix factored as Adafactor
// (Shazeer & Stern 2018): fp32 row and column sums of the EMA of g^2 + eps1,
// v = R C^T / sum(R); m in bf16.
//
// Every function works on element ranges whose ends are block multiples, so
// a caller may stream the state through memory in chunks. Results depend on
// neither the thread count nor the chunking.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_LEANADAMW_H
#define MEGASLIDE_RUNTIME_CPU_LEANADAMW_H

#include "megaslide/runtime/cpu/AdamW.h"

#include <array>
#include <cstdint>

namespace megaslide::cpu {

/// Elements per quantization block (bitsandbytes' blocksize for optimizer
/// states).
inline constexpr int64_t kQuantBlock = 256;

/// int8-moments quantizes the moments of parameters of at least this many
/// elements; smaller ones (biases, norms) keep fp32 moments, as
/// bitsandbytes' min_8bit_size.
inline constexpr int64_t kQuantMinSize = 4096;

/// Blocks of a tensor of `n` elements (the last may be partial).
inline int64_t quantBlocks(int64_t n) {
  return (n + kQuantBlock - 1) / kQuantBlock;
}

/// bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7,
/// total_bits=8), sorted ascending: for each decade i = 0..6 the midpoints
/// of linspace(0.1, 1, k + 1) (float32, as torch's CPU kernel rounds it:
/// one fused multiply-add per value) times 10^(i-6), k
/// = 2^i signed (with their negatives) or 2^(i+1) unsigned, plus 0 and 1.
const std::array<float, 256> &dynamicMap(bool isSigned);

/// The code of `x` (already divided by its block's absmax): the index of the
/// nearest map value; of two equally near, the lower index.
uint8_t quantizeCode(const std::array<float, 256> &map, float x);

/// Quantizes `n` values to `codes` with one absmax per block in `absmax`
/// (x / absmax coded; a block of zeros has absmax 0 and the code of 0).
void quantizeBlockwise(const float *x, int64_t n, bool isSigned, uint8_t *codes,
                       float *absmax);
/// map[code] * absmax of its block.
void dequantizeBlockwise(const uint8_t *codes, const float *absmax, int64_t n,
                         bool isSigned, float *x);

/// One AdamW update of elements [0, n) of a range that starts at a block
/// boundary: codes and absmax of m (signed map) and v (unsigned map), the
/// blocks of the range in order. Per block: m, v dequantized; then
/// cpu::adamwStep's formula in fp32; the new m, v requantized with their
/// new block absmax.
void adamw8bitStep(const AdamWHyper &hyper, int64_t n, float *master,
                   uint8_t *mCodes, float *mAbsmax, uint8_t *vCodes,
                   float *vAbsmax, const float *grad);
void adamw8bitStep(const AdamWHyper &hyper, int64_t n, float *master,
                   uint8_t *mCodes, float *mAbsmax, uint8_t *vCodes,
                   float *vAbsmax, const uint16_t *gradBf16);

/// Adafactor's eps1, added to every g^2 before it is summed.
inline constexpr double kFactoredEps1 = 1e-30;

/// A parameter's shape as the factored second moment sees it: rows = first
/// dimension, cols = the product of the rest. Factored when rank >= 2.
struct FactoredShape {
  int64_t rows = 0, cols = 0;
};

/// The factored statistics' update from the whole (scaled) gradient of a
/// [rows, cols] matrix: R = b2 R + (1 - b2) sum_j (g^2 + eps1), C likewise
/// over i (sums in double, in index order, rounded to fp32 once).
void factoredStatsStep(const AdamWHyper &hyper, FactoredShape shape,
                       const float *grad, float *rowStat, float *colStat);
void factoredStatsStep(const AdamWHyper &hyper, FactoredShape shape,
                       const uint16_t *gradBf16, float *rowStat,
                       float *colStat);

/// sum(R) in double over rows in order, as fp32: v's denominator.
float factoredRowTotal(FactoredShape shape, const float *rowStat);

/// The AdamW update of elements [begin, end) of the matrix (after
/// factoredStatsStep): m (bf16) as AdamW's, v_ij = R_i C_j / rowTotal, bias
/// corrected as AdamW's. `master`, `m` and `grad` point at element begin.
void adamwFactoredStep(const AdamWHyper &hyper, FactoredShape shape,
                       int64_t begin, int64_t end, float *master, uint16_t *m,
                       const float *rowStat, const float *colStat,
                       float rowTotal, const float *grad);
void adamwFactoredStep(const AdamWHyper &hyper, FactoredShape shape,
                       int64_t begin, int64_t end, float *master, uint16_t *m,
                       const float *rowStat, const float *colStat,
                       float rowTotal, const uint16_t *gradBf16);

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_LEANADAMW_H
