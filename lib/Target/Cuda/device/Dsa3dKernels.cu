//===- Dsa3dKernels.cu - The 3D-DSA kernels --------------------*- CUDA -*-===//
//
// The forward, the backward's dQ and dK/dV kernels and offset estimation,
// which DsaKernels.cpp emits for every configuration after its constants
// and Dsa3dDevice.cuh, under the names of the DSA_*_NAME macros
// (docs/Dsa3dKernels.md).
//
//===----------------------------------------------------------------------===//

#include "Dsa3dDevice.cuh"

using namespace dsa;

//===----------------------------------------------------------------------===//
// Forward: out = softmax(scale q k^T) v over each tile's window, lse saved
//===----------------------------------------------------------------------===//
//
// One CTA per (query block of a tile, head, sample); one warp per 16
// queries. Keys and values of the window stream through shared memory in
// chunks of FWD_KC rows (cp.async, FWD_STAGES buffers); S = q k^T and
// O += P v run on tensor cores with fp32 accumulation and an online
// softmax (running max m and sum l per row, base-2 exponentials).

namespace dsa {
constexpr int FWD_THREADS = 32 * FWD_WARPS;
constexpr int FWD_ROWS = 16 * FWD_WARPS;
constexpr int FWD_CHUNKS = (WINDOW + FWD_KC - 1) / FWD_KC;
static_assert(FWD_KC % 16 == 0, "key chunk must be a multiple of 16");
} // namespace dsa

extern "C" __global__ void __launch_bounds__(FWD_THREADS, FWD_MIN_BLOCKS)
    DSA_FWD_NAME(const elem_t *__restrict__ q, const elem_t *__restrict__ k,
                 const elem_t *__restrict__ v, const int *__restrict__ offsets,
                 elem_t *__restrict__ out, float *__restrict__ lse,
                 float scale) {
  extern __shared__ __align__(16) unsigned char smem[];
  elem_t *qs = reinterpret_cast<elem_t *>(smem); // [FWD_ROWS][DP]
  elem_t *ks = qs + FWD_ROWS * DP;               // [STAGES][KC][DP]
  elem_t *vs = ks + FWD_STAGES * FWD_KC * DP;    // [STAGES][KC][DP]
  int *rowToken = reinterpret_cast<int *>(vs + FWD_STAGES * FWD_KC * DP);
  int *frameBase = rowToken + FWD_ROWS; // [KT]

  const int tile = blockIdx.x / FWD_QBLOCKS, qblock = blockIdx.x % FWD_QBLOCKS;
  const int h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const Tile geo = tileGeometry(tile);

  const int rows = setupQueryBlock<FWD_ROWS, FWD_THREADS>(
      rowToken, frameBase, geo, offsets, b, h, tile, qblock);
  if (rows <= 0)
    return; // a query block past the end of a partial border tile

  auto stageChunk = [&](int chunk, int buf) {
    loadKeyChunk<FWD_KC, FWD_THREADS>(ks + buf * FWD_KC * DP,
                                      vs + buf * FWD_KC * DP, k, v, frameBase,
                                      chunk, b, h);
  };
  loadRows<FWD_ROWS, FWD_THREADS>(qs, q, rowToken, b, h);
  stageChunk(0, 0);
  cpAsyncCommit();

  const bool active = warp * 16 < rows; // warps of padding rows only copy
  const int row0 = warp * 16;
  const float scaleLog2 = scale * LOG2E;
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
    o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  // Running max (log2 units) of rows g and g + 8, and running sum (this
  // lane's columns).
  float m[2] = {-infinity(), -infinity()};
  float l[2] = {0.f, 0.f};
  // FWD_QREG: the warp's 16 queries as A fragments, loaded from shared
  // memory once (after the first chunk's wait) and kept in registers for
  // every chunk; otherwise reloaded per chunk (when D / 4 more registers
  // would spill, e.g. D = 128 at two CTAs per SM: docs/Dsa3dKernels.md).
  unsigned qf[D / 16][4];

  for (int chunk = 0; chunk < FWD_CHUNKS; ++chunk) {
    const int buf = chunk % FWD_STAGES;
    pipelineAcquire<FWD_STAGES>(chunk, FWD_CHUNKS, stageChunk);
    const elem_t *kc = ks + buf * FWD_KC * DP;
    const elem_t *vc = vs + buf * FWD_KC * DP;

    if (active) {
      if (FWD_QREG && chunk == 0) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
          loadA(qf[kk], qs, DP, row0, kk * 16);
      }
      // S = q k^T for this warp's 16 queries and the chunk's keys.
      float s[FWD_KC / 8][4];
#pragma unroll
      for (int i = 0; i < FWD_KC / 8; ++i)
        s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        unsigned a[4];
        if (FWD_QREG) {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            a[e] = qf[kk][e];
        } else {
          loadA(a, qs, DP, row0, kk * 16);
        }
#pragma unroll
        for (int np = 0; np < FWD_KC / 16; ++np) {
          unsigned bf[4];
          loadBNK(bf, kc, DP, np * 16, kk * 16);
          mma16816(s[2 * np], a, bf[0], bf[1]);
          mma16816(s[2 * np + 1], a, bf[2], bf[3]);
        }
      }

      // Online softmax: scale to log2 units, mask keys past the window.
      float mx[2] = {-infinity(), -infinity()};
#pragma unroll
      for (int i = 0; i < FWD_KC / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[i][e] * scaleLog2;
          if (WINDOW % FWD_KC != 0 &&
              chunk * FWD_KC + i * 8 + 2 * c + (e & 1) >= WINDOW)
            x = -infinity();
          s[i][e] = x;
          mx[e / 2] = fmaxf(mx[e / 2], x);
        }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        float mNew = fmaxf(m[r], mx[r]);
        float alpha = fastExp2(m[r] - mNew); // 0 on the first chunk
        m[r] = mNew;
        l[r] *= alpha;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          o[i][2 * r] *= alpha;
          o[i][2 * r + 1] *= alpha;
        }
      }
#pragma unroll
      for (int i = 0; i < FWD_KC / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float p = fastExp2(s[i][e] - m[e / 2]);
          s[i][e] = p;
          l[e / 2] += p;
        }

        // O += P v: the C fragments of two adjacent key n-tiles are the A
        // fragment of one 16-key k-step.
#pragma unroll
      for (int kk = 0; kk < FWD_KC / 16; ++kk) {
        unsigned a[4] = {pack2(s[2 * kk][0], s[2 * kk][1]),
                         pack2(s[2 * kk][2], s[2 * kk][3]),
                         pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                         pack2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          unsigned bf[4];
          loadBKN(bf, vc, DP, kk * 16, dp * 16);
          mma16816(o[2 * dp], a, bf[0], bf[1]);
          mma16816(o[2 * dp + 1], a, bf[2], bf[3]);
        }
      }
    }
    pipelineRelease<FWD_STAGES>(chunk, FWD_CHUNKS, stageChunk);
  }

  if (!active)
    return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int row = row0 + g + 8 * r;
    const int n = row < rows ? rowToken[row] : -1;
    if (n < 0)
      continue;
    const float inv = 1.f / l[r];
    elem_t *dst = out + rowOffset(b, n, h);
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<unsigned *>(dst + i * 8 + 2 * c) =
          pack2(o[i][2 * r] * inv, o[i][2 * r + 1] * inv);
    if (c == 0) // natural-log log-sum-exp of scale * q k^T
      lse[(static_cast<long long>(b) * H + h) * N + n] =
          (m[r] + __log2f(l[r])) * LN2;
  }
}

//===----------------------------------------------------------------------===//
// Backward, queries: dQ and Delta
//===----------------------------------------------------------------------===//
//
// Same CTA decomposition as the forward. Per key chunk, each warp
// recomputes S = q k^T and dP = dO v^T for its 16 queries, P = exp(scale S -
// lse), dS = P * (dP - Delta) with Delta = rowsum(dO * O), and accumulates
// dQ += dS k in registers: a query belongs to exactly one tile, so dQ is
// written once, without atomics. Delta goes to `delta` (fp32 [B, H, N]) for
// DSA_BWD_KEYS_NAME, launched after this kernel.

namespace dsa {
constexpr int BWD_THREADS = 32 * BWD_WARPS;
constexpr int BWD_ROWS = 16 * BWD_WARPS;
constexpr int BWD_CHUNKS = (WINDOW + BWD_KC - 1) / BWD_KC;
static_assert(BWD_KC % 16 == 0, "key chunk must be a multiple of 16");
} // namespace dsa

extern "C" __global__ void __launch_bounds__(BWD_THREADS, BWD_MIN_BLOCKS)
    DSA_BWD_NAME(const elem_t *__restrict__ q, const elem_t *__restrict__ k,
                 const elem_t *__restrict__ v, const int *__restrict__ offsets,
                 const elem_t *__restrict__ o, const elem_t *__restrict__ dout,
                 const float *__restrict__ lse, elem_t *__restrict__ dq,
                 float *__restrict__ delta, float scale) {
  extern __shared__ __align__(16) unsigned char smem[];
  elem_t *qs = reinterpret_cast<elem_t *>(smem); // [BWD_ROWS][DP]
  elem_t *dos = qs + BWD_ROWS * DP;              // [BWD_ROWS][DP]
  elem_t *ks = dos + BWD_ROWS * DP;              // [STAGES][KC][DP]
  elem_t *vs = ks + BWD_STAGES * BWD_KC * DP;    // [STAGES][KC][DP]
  float *rowLse = reinterpret_cast<float *>(vs + BWD_STAGES * BWD_KC * DP);
  float *rowDelta = rowLse + BWD_ROWS;
  int *rowToken = reinterpret_cast<int *>(rowDelta + BWD_ROWS);
  int *frameBase = rowToken + BWD_ROWS; // [KT]

  const int tile = blockIdx.x / BWD_QBLOCKS, qblock = blockIdx.x % BWD_QBLOCKS;
  const int h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const Tile geo = tileGeometry(tile);

  const int rows = setupQueryBlock<BWD_ROWS, BWD_THREADS>(
      rowToken, frameBase, geo, offsets, b, h, tile, qblock);
  if (rows <= 0)
    return; // a query block past the end of a partial border tile

  auto stageChunk = [&](int chunk, int buf) {
    loadKeyChunk<BWD_KC, BWD_THREADS>(ks + buf * BWD_KC * DP,
                                      vs + buf * BWD_KC * DP, k, v, frameBase,
                                      chunk, b, h);
  };
  loadRows<BWD_ROWS, BWD_THREADS>(qs, q, rowToken, b, h);
  loadRows<BWD_ROWS, BWD_THREADS>(dos, dout, rowToken, b, h);
  stageChunk(0, 0);
  cpAsyncCommit();

  // Per-row log-sum-exp (log2 units) and Delta = rowsum(dO * O) in fp32;
  // padding rows get lse = +inf, hence P = dS = 0.
  for (int r = warp; r < BWD_ROWS; r += BWD_WARPS) {
    const int n = rowToken[r];
    float acc = 0.f;
    if (n >= 0) {
      const long long base = rowOffset(b, n, h);
      for (int d = lane; d < D; d += 32)
        acc += toFloat(dout[base + d]) * toFloat(o[base + d]);
    }
#pragma unroll
    for (int sh = 16; sh > 0; sh /= 2)
      acc += __shfl_xor_sync(0xffffffffu, acc, sh);
    if (lane == 0) {
      rowDelta[r] = acc;
      rowLse[r] = n >= 0
                      ? lse[(static_cast<long long>(b) * H + h) * N + n] * LOG2E
                      : infinity();
      if (n >= 0)
        delta[(static_cast<long long>(b) * H + h) * N + n] = acc;
    }
  }

  const bool active = warp * 16 < rows;
  const int row0 = warp * 16;
  const float scaleLog2 = scale * LOG2E;
  float dqAcc[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
    dqAcc[i][0] = dqAcc[i][1] = dqAcc[i][2] = dqAcc[i][3] = 0.f;

  for (int chunk = 0; chunk < BWD_CHUNKS; ++chunk) {
    const int buf = chunk % BWD_STAGES;
    pipelineAcquire<BWD_STAGES>(chunk, BWD_CHUNKS, stageChunk);
    const elem_t *kc = ks + buf * BWD_KC * DP;
    const elem_t *vc = vs + buf * BWD_KC * DP;

    if (active) {
      float s[BWD_KC / 8][4], dp[BWD_KC / 8][4];
#pragma unroll
      for (int i = 0; i < BWD_KC / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[i][e] = dp[i][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        unsigned aq[4], ado[4];
        loadA(aq, qs, DP, row0, kk * 16);
        loadA(ado, dos, DP, row0, kk * 16);
#pragma unroll
        for (int np = 0; np < BWD_KC / 16; ++np) {
          unsigned bk[4], bv[4];
          loadBNK(bk, kc, DP, np * 16, kk * 16);
          mma16816(s[2 * np], aq, bk[0], bk[1]);
          mma16816(s[2 * np + 1], aq, bk[2], bk[3]);
          loadBNK(bv, vc, DP, np * 16, kk * 16);
          mma16816(dp[2 * np], ado, bv[0], bv[1]);
          mma16816(dp[2 * np + 1], ado, bv[2], bv[3]);
        }
      }
      const float lse2[2] = {rowLse[row0 + g], rowLse[row0 + g + 8]};
      const float dlt[2] = {rowDelta[row0 + g], rowDelta[row0 + g + 8]};
#pragma unroll
      for (int i = 0; i < BWD_KC / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float p = fastExp2(s[i][e] * scaleLog2 - lse2[e / 2]);
          if (WINDOW % BWD_KC != 0 &&
              chunk * BWD_KC + i * 8 + 2 * c + (e & 1) >= WINDOW)
            p = 0.f;
          dp[i][e] = p * (dp[i][e] - dlt[e / 2]); // dS (unscaled)
        }
        // dQ += dS k (scale applied at the end).
#pragma unroll
      for (int kk = 0; kk < BWD_KC / 16; ++kk) {
        unsigned a[4] = {pack2(dp[2 * kk][0], dp[2 * kk][1]),
                         pack2(dp[2 * kk][2], dp[2 * kk][3]),
                         pack2(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                         pack2(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
        for (int dd = 0; dd < D / 16; ++dd) {
          unsigned bf[4];
          loadBKN(bf, kc, DP, kk * 16, dd * 16);
          mma16816(dqAcc[2 * dd], a, bf[0], bf[1]);
          mma16816(dqAcc[2 * dd + 1], a, bf[2], bf[3]);
        }
      }
    }
    pipelineRelease<BWD_STAGES>(chunk, BWD_CHUNKS, stageChunk);
  }

  if (!active)
    return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    const int n = row < rows ? rowToken[row] : -1;
    if (n < 0)
      continue;
    elem_t *dst = dq + rowOffset(b, n, h);
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<unsigned *>(dst + i * 8 + 2 * c) =
          pack2(dqAcc[i][2 * r] * scale, dqAcc[i][2 * r + 1] * scale);
  }
}

//===----------------------------------------------------------------------===//
// Backward, keys: dK and dV by key ownership
//===----------------------------------------------------------------------===//
//
// One CTA per (key block of a key tile, head, sample); key tiles are the
// query tiles' grid tiling applied to keys, and one warp owns 16 keys, so
// every key's dK and dV rows belong to exactly one warp and are written
// once, in the element type, without atomics or scratch.
//
// Inverse tile neighbourhood: query tile i (along one axis) has the window
// start s(i, d) = clamp(c_i + d - k / 2, 0, G - k) for a displacement d in
// [-R, R] (R = 0 along t), nondecreasing in i and d, so the query tiles
// whose window can hold a key of key tile m form the contiguous range
// INV_*[m] = {i : s(i, -R) <= last_m and s(i, R) + k - 1 >= first_m},
// computed once per configuration on the host (DsaKernels.cpp). A key
// tile's candidates are the product of its three ranges; per candidate the
// CTA reads the tile's actual window (the offsets of this run) and keeps
// the candidates whose window meets the key tile's box, in candidate order.
// Each kept query tile's queries stream through shared memory in chunks of
// BKV_QC rows; per 16 queries a warp recomputes S^T = k q^T and
// dP^T = v dO^T for its keys, P^T = exp(scale S^T - lse) only for keys in
// that tile's window (a key is in a window at most once: its frame fixes
// the key frame j), dS^T = P^T * (dP^T - Delta) with the Delta the query
// kernel stored, and accumulates dV += P^T dO, dK += dS^T q in registers.
// Summation order is fixed (candidate order, then query order): dK and dV
// are deterministic.

namespace dsa {
constexpr int BKV_THREADS = 32 * BKV_WARPS;
constexpr int BKV_ROWS = 16 * BKV_WARPS;    // keys per CTA
constexpr int BKV_TILE_ROWS = TT * TY * TX; // queries of a full tile
constexpr int BKV_QCHUNKS = (BKV_TILE_ROWS + BKV_QC - 1) / BKV_QC;
constexpr int BKV_NCAND = BKV_CAND_T * BKV_CAND_Y * BKV_CAND_X; // upper bound
// dK/dV columns per pass over the candidates (whole 16-column steps; the
// last pass may be partial) and the passes.
constexpr int BKV_DCOLS = D <= 176 ? D : 16 * ((D / 16 + 1) / 2);
constexpr int BKV_PASSES = (D + BKV_DCOLS - 1) / BKV_DCOLS;
// Queries per inner step: 32 (k and v fragments reused twice, 80 instead
// of 96 ldmatrix per 128 mma) when the chunk allows and the registers do
// (one pass of at most 160 columns; NVRTC 13.0: D = 176 spilled 72 bytes,
// D = 256 in two passes 24), else 16.
constexpr int BKV_QSTEP =
    BKV_QC % 32 == 0 && BKV_PASSES == 1 && BKV_DCOLS <= 160 ? 32 : 16;
constexpr int BKV_QG = BKV_QSTEP / 16;
static_assert(BKV_QC % 16 == 0, "query chunk must be a multiple of 16");
} // namespace dsa

extern "C" __global__ void __launch_bounds__(BKV_THREADS, 1) DSA_BWD_KEYS_NAME(
    const elem_t *__restrict__ q, const elem_t *__restrict__ k,
    const elem_t *__restrict__ v, const int *__restrict__ offsets,
    const elem_t *__restrict__ dout, const float *__restrict__ lse,
    const float *__restrict__ delta, elem_t *__restrict__ dk,
    elem_t *__restrict__ dv, float scale) {
  extern __shared__ __align__(16) unsigned char smem[];
  elem_t *ks = reinterpret_cast<elem_t *>(smem); // [BKV_ROWS][DP]
  elem_t *vs = ks + BKV_ROWS * DP;               // [BKV_ROWS][DP]
  elem_t *qs = vs + BKV_ROWS * DP;               // [STAGES][QC][DP]
  elem_t *dos = qs + BKV_STAGES * BKV_QC * DP;   // [STAGES][QC][DP]
  float *rowLse = reinterpret_cast<float *>(dos + BKV_STAGES * BKV_QC * DP);
  float *rowDelta = rowLse + BKV_STAGES * BKV_QC; // [STAGES][QC]
  int *winY = reinterpret_cast<int *>(rowDelta + BKV_STAGES * BKV_QC);
  int *winX = winY + BKV_STAGES * KT;               // [STAGES][KT]
  int *winT = winX + BKV_STAGES * KT;               // [STAGES]
  int *keyToken = winT + BKV_STAGES;                // [BKV_ROWS]
  int *steps = keyToken + BKV_ROWS;                 // [NCAND * QCHUNKS]
  int *meetsFlag = steps + BKV_NCAND * BKV_QCHUNKS; // [NCAND]
  int *nsteps = meetsFlag + BKV_NCAND;              // [1]

  const int ktile = blockIdx.x / BKV_KBLOCKS, kblock = blockIdx.x % BKV_KBLOCKS;
  const int h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const Tile kgeo = tileGeometry(ktile);

  const int keys = setupRows<BKV_ROWS, BKV_THREADS>(keyToken, kgeo, kblock);
  if (keys <= 0)
    return; // a key block past the end of a partial border tile
  __syncthreads();
  loadRows<BKV_ROWS, BKV_THREADS>(ks, k, keyToken, b, h);
  loadRows<BKV_ROWS, BKV_THREADS>(vs, v, keyToken, b, h);
  cpAsyncCommit();

  // Offsets beyond [-R, R] (not from this configuration's estimator) void
  // the static bound: then every query tile is a candidate (correct for any
  // offsets, slower). One pass over the (sample, head)'s offsets, OR-ed
  // over the CTA by the barrier itself (no shared flag).
  int beyond = 0;
  {
    const int *off =
        offsets + (static_cast<long long>(b) * H + h) * NTILES * KT * 2;
    for (int i = threadIdx.x; i < NTILES * KT * 2; i += BKV_THREADS)
      beyond |= abs(off[i]) > R;
  }
  const bool wide = __syncthreads_or(beyond) != 0;

  // The key tile's candidate query tiles: the product of its inverse
  // ranges (all tiles when `wide`), BKV_NCAND at a time. Each thread tests
  // some against their actual windows, then thread 0 keeps those whose
  // window meets the key tile, in candidate order, as steps
  // (tile * BKV_QCHUNKS + query chunk).
  const int kti = kgeo.t0 / TT, kyi = kgeo.y0 / TY, kxi = kgeo.x0 / TX;
  const int t0 = wide ? 0 : INV_T[kti][0], y0 = wide ? 0 : INV_Y[kyi][0],
            x0 = wide ? 0 : INV_X[kxi][0];
  const int nct = wide ? NTT : INV_T[kti][1] - t0 + 1,
            ncy = wide ? NTY : INV_Y[kyi][1] - y0 + 1,
            ncx = wide ? NTX : INV_X[kxi][1] - x0 + 1;
  const int ncand = nct * ncy * ncx;
  auto candidateTile = [&](int i) {
    return ((t0 + i / (ncy * ncx)) * NTY + y0 + (i / ncx) % ncy) * NTX + x0 +
           i % ncx;
  };
  // Stages step s's query rows, lse, Delta and window into buffer `buf`.
  auto stage = [&](int s, int buf) {
    const int qt = steps[s] / BKV_QCHUNKS, ch = steps[s] % BKV_QCHUNKS;
    const Tile qg = tileGeometry(qt);
    loadTileRows<BKV_QC, BKV_THREADS>(qs, q, dos, dout, buf, qg, ch * BKV_QC, b,
                                      h);
    // lse (natural log; scaled to log2 units at use) and Delta of the
    // rows, one 4-byte cp.async a thread in the rows' commit group, not
    // loads the CTA would wait for; rows past the tile get +inf (P = 0)
    // and 0, seen after the same wait and barrier.
    for (int i = threadIdx.x; i < 2 * BKV_QC; i += BKV_THREADS) {
      const bool isLse = i < BKV_QC;
      const int r = i % BKV_QC, qi = ch * BKV_QC + r;
      float *dst = (isLse ? rowLse : rowDelta) + buf * BKV_QC + r;
      if (qi < qg.count)
        cpAsync4(dst, (isLse ? lse : delta) +
                          (static_cast<long long>(b) * H + h) * N +
                          queryToken(qg, qi));
      else
        *dst = isLse ? infinity() : 0.f;
    }
    for (int j = threadIdx.x; j < KT; j += BKV_THREADS) {
      const int base = keyFrameBase(qg, offsets, b, h, qt, j);
      winY[buf * KT + j] = (base / X) % Y;
      winX[buf * KT + j] = base % X;
      if (j == 0)
        winT[buf] = base / (Y * X);
    }
  };

  // This lane's two keys (rows g, g + 8 of the warp): grid coordinates.
  const int row0 = warp * 16;
  const bool active = row0 < keys;
  int kt[2], ky[2], kx[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int n = row0 + g + 8 * r < keys ? keyToken[row0 + g + 8 * r] : -1;
    kt[r] = n >= 0 ? n / (Y * X) : -1; // -1: no key, never in a window
    ky[r] = n >= 0 ? (n / X) % Y : 0;
    kx[r] = n >= 0 ? n % X : 0;
  }
  const float scaleLog2 = scale * LOG2E;
  // dK and dV columns [part * BKV_DCOLS, +BKV_DCOLS) per pass over the
  // candidates: one pass up to D = 176, two above (S^T and dP^T are
  // recomputed, but 2 * D accumulators would spill). Unrolled, so that
  // the column guards of a partial last pass are constants.
#pragma unroll
  for (int part = 0; part < BKV_PASSES; ++part) {
    const int col0 = part * BKV_DCOLS;
    float dkAcc[BKV_DCOLS / 8][4], dvAcc[BKV_DCOLS / 8][4];
#pragma unroll
    for (int i = 0; i < BKV_DCOLS / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dkAcc[i][e] = dvAcc[i][e] = 0.f;

    for (int first = 0; first < ncand; first += BKV_NCAND) {
      const int batch = min(BKV_NCAND, ncand - first);
      for (int i = threadIdx.x; i < batch; i += BKV_THREADS) {
        const int qt = candidateTile(first + i);
        const Tile qg = tileGeometry(qt);
        const int st = clampi(qg.ct - KT / 2, 0, T - KT);
        int meets = 0;
        for (int j = 0; j < KT; ++j) {
          const int f = st + j;
          if (f < kgeo.t0 || f >= kgeo.t0 + kgeo.nt)
            continue;
          const int base = keyFrameBase(qg, offsets, b, h, qt, j);
          const int sy = (base / X) % Y, sx = base % X;
          meets |= sy < kgeo.y0 + kgeo.ny && sy + KY > kgeo.y0 &&
                   sx < kgeo.x0 + kgeo.nx && sx + KX > kgeo.x0;
        }
        meetsFlag[i] = meets;
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        int n = 0;
        for (int i = 0; i < batch; ++i) {
          if (!meetsFlag[i])
            continue;
          const int qt = candidateTile(first + i),
                    count = tileGeometry(qt).count;
          for (int ch = 0; ch * BKV_QC < count; ++ch)
            steps[n++] = qt * BKV_QCHUNKS + ch;
        }
        *nsteps = n;
      }
      __syncthreads();
      const int nstep = *nsteps;
      if (nstep > 0)
        stage(0, 0);
      cpAsyncCommit();
      for (int s = 0; s < nstep; ++s) {
        const int buf = s % BKV_STAGES;
        pipelineAcquire<BKV_STAGES>(s, nstep, stage);
        const int qrows =
            min(BKV_QC, tileGeometry(steps[s] / BKV_QCHUNKS).count -
                            (steps[s] % BKV_QCHUNKS) * BKV_QC);
        // Which of this lane's keys lie in the step's query tile's window.
        bool in[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int j = kt[r] - winT[buf];
          const bool frame = kt[r] >= 0 && j >= 0 && j < KT;
          const int dy = ky[r] - winY[buf * KT + (frame ? j : 0)];
          const int dx = kx[r] - winX[buf * KT + (frame ? j : 0)];
          in[r] = frame && dy >= 0 && dy < KY && dx >= 0 && dx < KX;
        }
        int any = in[0] || in[1];
#pragma unroll
        for (int sh = 16; sh > 0; sh /= 2)
          any |= __shfl_xor_sync(0xffffffffu, any, sh);
        const elem_t *qc = qs + buf * BKV_QC * DP;
        const elem_t *doc = dos + buf * BKV_QC * DP;
        const float *lc = rowLse + buf * BKV_QC;
        const float *dc = rowDelta + buf * BKV_QC;

        if (active && any) {
          for (int qq = 0; qq * BKV_QSTEP < qrows; ++qq) {
            // S^T and dP^T for the warp's 16 keys and BKV_QSTEP queries (the
            // k and v fragments serve BKV_QG groups of 16 queries).
            float st[2 * BKV_QG][4], dpt[2 * BKV_QG][4];
#pragma unroll
            for (int i = 0; i < 2 * BKV_QG; ++i)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                st[i][e] = dpt[i][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
              unsigned ak[4], av[4];
              loadA(ak, ks, DP, row0, kk * 16);
              loadA(av, vs, DP, row0, kk * 16);
#pragma unroll
              for (int qg = 0; qg < BKV_QG; ++qg) {
                unsigned bq[4], bd[4];
                const int q0 = qq * BKV_QSTEP + qg * 16;
                loadBNK(bq, qc, DP, q0, kk * 16);
                mma16816(st[2 * qg], ak, bq[0], bq[1]);
                mma16816(st[2 * qg + 1], ak, bq[2], bq[3]);
                loadBNK(bd, doc, DP, q0, kk * 16);
                mma16816(dpt[2 * qg], av, bd[0], bd[1]);
                mma16816(dpt[2 * qg + 1], av, bd[2], bd[3]);
              }
            }
#pragma unroll
            for (int i = 0; i < 2 * BKV_QG; ++i)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int col = qq * BKV_QSTEP + i * 8 + 2 * c + (e & 1);
                float p = fastExp2(st[i][e] * scaleLog2 - lc[col] * LOG2E);
                if (!in[e / 2])
                  p = 0.f;
                st[i][e] = p;                          // P^T
                dpt[i][e] = p * (dpt[i][e] - dc[col]); // dS^T (unscaled)
              }
#pragma unroll
            for (int qg = 0; qg < BKV_QG; ++qg) {
              // The C fragments of two query n-tiles are the A fragment of
              // one 16-query k-step.
              const unsigned ap[4] = {
                  pack2(st[2 * qg][0], st[2 * qg][1]),
                  pack2(st[2 * qg][2], st[2 * qg][3]),
                  pack2(st[2 * qg + 1][0], st[2 * qg + 1][1]),
                  pack2(st[2 * qg + 1][2], st[2 * qg + 1][3])};
              const unsigned as[4] = {
                  pack2(dpt[2 * qg][0], dpt[2 * qg][1]),
                  pack2(dpt[2 * qg][2], dpt[2 * qg][3]),
                  pack2(dpt[2 * qg + 1][0], dpt[2 * qg + 1][1]),
                  pack2(dpt[2 * qg + 1][2], dpt[2 * qg + 1][3])};
              const int q0 = qq * BKV_QSTEP + qg * 16;
#pragma unroll
              for (int dd = 0; dd < BKV_DCOLS / 16; ++dd) {
                if (col0 + dd * 16 >= D)
                  break;
                unsigned bf[4];
                loadBKN(bf, doc, DP, q0, col0 + dd * 16);
                mma16816(dvAcc[2 * dd], ap, bf[0], bf[1]);
                mma16816(dvAcc[2 * dd + 1], ap, bf[2], bf[3]);
                loadBKN(bf, qc, DP, q0, col0 + dd * 16);
                mma16816(dkAcc[2 * dd], as, bf[0], bf[1]);
                mma16816(dkAcc[2 * dd + 1], as, bf[2], bf[3]);
              }
            }
          }
        }
        pipelineRelease<BKV_STAGES>(s, nstep, stage);
      }
    }
    cpAsyncWait<0>(); // K and V when no query tile reaches these keys

#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + g + 8 * r;
      if (!active || row >= keys)
        continue;
      const long long base = rowOffset(b, keyToken[row], h) + col0;
#pragma unroll
      for (int i = 0; i < BKV_DCOLS / 8; ++i) {
        if (col0 + i * 8 >= D)
          break;
        *reinterpret_cast<unsigned *>(dk + base + i * 8 + 2 * c) =
            pack2(dkAcc[i][2 * r] * scale, dkAcc[i][2 * r + 1] * scale);
        *reinterpret_cast<unsigned *>(dv + base + i * 8 + 2 * c) =
            pack2(dvAcc[i][2 * r], dvAcc[i][2 * r + 1]);
      }
    }
  } // part
}

//===----------------------------------------------------------------------===//
// Offset estimation: block matching on tile-pooled features
//===----------------------------------------------------------------------===//
//
// One CTA per (tile, head, sample). qbar = mean of the tile's queries; for
// key frame j every displacement (dy, dx) in [-R, R]^2 scores
// sum over the displaced (clamped) window of qbar . k -- the dot product
// with the window's mean key times the constant KY*KX, so the argmax is the
// same. The per-key dots of the union of all candidate windows are computed
// once into shared memory; window sums run in a fixed order, so windows
// made identical by clamping score bit-identically and the tie rule
// decides: highest score, then smallest |dy| + |dx|, then dy, then dx.

namespace dsa {
constexpr int OFF_WARPS = OFF_THREADS / 32;
constexpr int OFF_SIDE = 2 * R + 1;
constexpr int OFF_RY = KY + 2 * R < Y ? KY + 2 * R : Y; // union of windows
constexpr int OFF_RX = KX + 2 * R < X ? KX + 2 * R : X;
} // namespace dsa

/// Candidate displacement: score and tie rank (smaller rank wins a tie).
struct Candidate {
  float score;
  int rank;
};

__device__ __forceinline__ bool better(const Candidate &a, const Candidate &b) {
  return a.score > b.score || (a.score == b.score && a.rank < b.rank);
}

extern "C" __global__ void __launch_bounds__(OFF_THREADS)
    DSA_OFFSETS_NAME(const elem_t *__restrict__ q, const elem_t *__restrict__ k,
                     int *__restrict__ offsets) {
  __shared__ float qbar[D];
  __shared__ float dots[OFF_RY * OFF_RX];
  __shared__ Candidate best[OFF_WARPS];

  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Tile geo = tileGeometry(tile);

  for (int d = threadIdx.x; d < D; d += OFF_THREADS) {
    float acc = 0.f;
    for (int i = 0; i < geo.count; ++i)
      acc += toFloat(q[rowOffset(b, queryToken(geo, i), h) + d]);
    qbar[d] = acc / geo.count;
  }

  const int st = clampi(geo.ct - KT / 2, 0, T - KT);
  // Union of the candidate windows along y and x (clamped like them).
  const int ylo = clampi(geo.cy - R - KY / 2, 0, Y - KY);
  const int yhi = clampi(geo.cy + R - KY / 2, 0, Y - KY) + KY;
  const int xlo = clampi(geo.cx - R - KX / 2, 0, X - KX);
  const int xhi = clampi(geo.cx + R - KX / 2, 0, X - KX) + KX;
  const int ry = yhi - ylo, rx = xhi - xlo;

  for (int j = 0; j < KT; ++j) {
    __syncthreads(); // qbar ready; previous frame's dots and best consumed
    const int frame = st + j;
    for (int i = warp; i < ry * rx; i += OFF_WARPS) {
      const int n = (frame * Y + ylo + i / rx) * X + xlo + i % rx;
      const elem_t *kr = k + rowOffset(b, n, h);
      float acc = 0.f;
      for (int d = lane; d < D; d += 32)
        acc += qbar[d] * toFloat(kr[d]);
#pragma unroll
      for (int sh = 16; sh > 0; sh /= 2)
        acc += __shfl_xor_sync(0xffffffffu, acc, sh);
      if (lane == 0)
        dots[i] = acc;
    }
    __syncthreads();

    Candidate mine = {-infinity(), 0x7fffffff};
    for (int i = threadIdx.x; i < OFF_SIDE * OFF_SIDE; i += OFF_THREADS) {
      const int dy = i / OFF_SIDE - R, dx = i % OFF_SIDE - R;
      const int sy = clampi(geo.cy + dy - KY / 2, 0, Y - KY) - ylo;
      const int sx = clampi(geo.cx + dx - KX / 2, 0, X - KX) - xlo;
      float score = 0.f;
      for (int yy = 0; yy < KY; ++yy) {
        float rowSum = 0.f;
        for (int xx = 0; xx < KX; ++xx)
          rowSum += dots[(sy + yy) * rx + sx + xx];
        score += rowSum;
      }
      const Candidate cand = {
          score, ((abs(dy) + abs(dx)) * OFF_SIDE + dy + R) * OFF_SIDE + dx + R};
      if (better(cand, mine))
        mine = cand;
    }
#pragma unroll
    for (int sh = 16; sh > 0; sh /= 2) {
      Candidate other = {__shfl_xor_sync(0xffffffffu, mine.score, sh),
                         __shfl_xor_sync(0xffffffffu, mine.rank, sh)};
      if (better(other, mine))
        mine = other;
    }
    if (lane == 0)
      best[warp] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
      Candidate win = best[0];
      for (int w = 1; w < OFF_WARPS; ++w)
        if (better(best[w], win))
          win = best[w];
      // No finite score (inf/nan features): keep the window undisplaced.
      const int r = win.rank == 0x7fffffff ? R * OFF_SIDE + R
                                           : win.rank % (OFF_SIDE * OFF_SIDE);
      int *dst =
          offsets +
          ((static_cast<long long>(b) * H + h) * NTILES + tile) * KT * 2 +
          j * 2;
      dst[0] = r / OFF_SIDE - R;
      dst[1] = r % OFF_SIDE - R;
    }
  }
}
