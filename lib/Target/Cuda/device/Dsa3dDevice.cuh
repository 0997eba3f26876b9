//===- Dsa3dDevice.cuh - Device code of the 3D-DSA kernels -----*- CUDA -*-===//
//
// The constants, inline-PTX primitives, tile and window geometry, shared-
// memory staging and mma fragment loads that the kernels of
// Dsa3dKernels.cu share. Header-free CUDA C++ (NVRTC needs no include
// path): 16-bit elements are raw bits, conversions and tensor-core mma are
// inline PTX (mma.sync m16n8k16, ldmatrix, cp.async: sm_80 and newer).
// Written against the constants that DsaKernels.cpp puts in front of it
// (T, Y, X, KT, KY, KX, TT, TY, TX, H, D, R and the FWD_/BWD_/BKV_/OFF_
// kernel shapes; Dsa3dExampleConfig.cuh outside the generated source).
//
//===----------------------------------------------------------------------===//

#include "Dsa3dExampleConfig.cuh"

//===----------------------------------------------------------------------===//
// Derived constants
//===----------------------------------------------------------------------===//

namespace dsa {

constexpr int N = T * Y * X;           // tokens per sample
constexpr int NTT = (T + TT - 1) / TT; // tiles along t, y, x
constexpr int NTY = (Y + TY - 1) / TY;
constexpr int NTX = (X + TX - 1) / TX;
constexpr int NTILES = NTT * NTY * NTX;
constexpr int WINDOW = KT * KY * KX; // keys per query tile
constexpr int FRAME_KEYS = KY * KX;  // keys per key frame
constexpr int DP = D + 8;            // padded smem row: no bank conflicts
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

static_assert(D % 16 == 0, "head dim must be a multiple of 16");
static_assert(KT <= T && KY <= Y && KX <= X, "window exceeds the grid");

//===----------------------------------------------------------------------===//
// Element type, conversions, tensor-core and async-copy primitives
//===----------------------------------------------------------------------===//

/// Raw 16-bit storage of the element type; no CUDA headers needed.
typedef unsigned short elem_t;

// The device primitives below are inline PTX; the host emulation of the
// unit tests (test/unit/lib/Target/Cuda/DsaKernelsTest.cpp) defines
// DSA_HOST_EMULATION and supplies its own.
#ifndef DSA_HOST_EMULATION

__device__ __forceinline__ float toFloat(elem_t v) {
#if DSA_BF16
  return __uint_as_float(static_cast<unsigned>(v) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
  return f;
#endif
}

/// Packs (lo, hi) into one register, lo in the low half (lower address).
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  unsigned r;
#if DSA_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

/// c += a * b on tensor cores: a is 16x16 (row), b 16x8 (col), c 16x8 fp32.
__device__ __forceinline__ void mma16816(float c[4], const unsigned a[4],
                                         unsigned b0, unsigned b1) {
#if DSA_BF16
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#endif
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned smemAddr(const void *p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

/// Four 8x8 b16 matrices from shared memory; lane l gives the address of
/// row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldsm4(unsigned r[4], unsigned addr) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(addr));
}

/// Like ldsm4, each matrix transposed.
__device__ __forceinline__ void ldsm4T(unsigned r[4], unsigned addr) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(addr));
}

/// 16-byte global -> shared copy; bytes = 0 zero-fills the destination.
__device__ __forceinline__ void cpAsync16(void *dst, const void *src,
                                          int bytes) {
  asm volatile(
      "cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smemAddr(dst)),
      "l"(src), "r"(bytes));
}
/// 4-byte global -> shared copy (.ca: .cg takes 16 bytes only).
__device__ __forceinline__ void cpAsync4(void *dst, const void *src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smemAddr(dst)),
               "l"(src));
}
__device__ __forceinline__ void cpAsyncCommit() {
  asm volatile("cp.async.commit_group;");
}
template <int Pending> __device__ __forceinline__ void cpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending));
}

/// +infinity without <math.h> (NVRTC compiles header-free).
__device__ __forceinline__ float infinity() {
  return __int_as_float(0x7f800000);
}

__device__ __forceinline__ float fastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif // DSA_HOST_EMULATION

__device__ __forceinline__ int clampi(int v, int lo, int hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

/// Element offset of token `n`, head `h` of sample `b` in a [B, N, H, D]
/// tensor (64-bit: B*N*H*D exceeds 2^31 at video sizes).
__device__ __forceinline__ long long rowOffset(int b, int n, int h) {
  return ((static_cast<long long>(b) * N + n) * H + h) * D;
}

//===----------------------------------------------------------------------===//
// Tile and window geometry (docs/Dsa3d.md, "Definition")
//===----------------------------------------------------------------------===//

/// A query tile: its first token and extent along t, y, x (border tiles
/// are partial) and its centre.
struct Tile {
  int t0, y0, x0;
  int nt, ny, nx;
  int ct, cy, cx;
  int count;
};

__device__ __forceinline__ Tile tileGeometry(int tile) {
  Tile g;
  int it = tile / (NTY * NTX), iy = (tile / NTX) % NTY, ix = tile % NTX;
  g.t0 = it * TT;
  g.y0 = iy * TY;
  g.x0 = ix * TX;
  g.nt = min(TT, T - g.t0);
  g.ny = min(TY, Y - g.y0);
  g.nx = min(TX, X - g.x0);
  g.ct = (2 * g.t0 + g.nt - 1) / 2; // floor((first + last) / 2)
  g.cy = (2 * g.y0 + g.ny - 1) / 2;
  g.cx = (2 * g.x0 + g.nx - 1) / 2;
  g.count = g.nt * g.ny * g.nx;
  return g;
}

/// Token of the tile's `i`-th query (row-major inside the tile).
__device__ __forceinline__ int queryToken(const Tile &g, int i) {
  int qt = i / (g.ny * g.nx), qy = (i / g.nx) % g.ny, qx = i % g.nx;
  return ((g.t0 + qt) * Y + g.y0 + qy) * X + g.x0 + qx;
}

/// First token of key frame j's spatial window: clamped temporal start,
/// spatial window displaced by offsets[b, h, tile, j] and clamped.
__device__ __forceinline__ int keyFrameBase(const Tile &g, const int *offsets,
                                            int b, int h, int tile, int j) {
  const int *off =
      offsets + ((static_cast<long long>(b) * H + h) * NTILES + tile) * KT * 2 +
      j * 2;
  int st = clampi(g.ct - KT / 2, 0, T - KT);
  int sy = clampi(g.cy + off[0] - KY / 2, 0, Y - KY);
  int sx = clampi(g.cx + off[1] - KX / 2, 0, X - KX);
  return ((st + j) * Y + sy) * X + sx;
}

/// Token of the window's w-th key, w in [0, WINDOW): key frame, row, column.
__device__ __forceinline__ int keyToken(const int *frameBase, int w) {
  int j = w / FRAME_KEYS, r = w % FRAME_KEYS;
  return frameBase[j] + (r / KX) * X + r % KX;
}

//===----------------------------------------------------------------------===//
// Staging through shared memory (cp.async)
//===----------------------------------------------------------------------===//

/// The query rows of a CTA: tile-local queries [qblock * ROWS, +ROWS).
template <int ROWS, int THREADS>
__device__ __forceinline__ int setupRows(int *rowToken, const Tile &g,
                                         int qblock) {
  for (int r = threadIdx.x; r < ROWS; r += THREADS) {
    int i = qblock * ROWS + r;
    rowToken[r] = i < g.count ? queryToken(g, i) : -1;
  }
  return min(ROWS, g.count - qblock * ROWS);
}

/// A query block's rows (setupRows) and the first tokens of its tile's key
/// frames (frameBase[KT]), then a barrier. Returns the block's number of
/// rows; none (a query block past the end of a partial border tile) returns
/// before the barrier, in every thread alike.
template <int ROWS, int THREADS>
__device__ __forceinline__ int
setupQueryBlock(int *rowToken, int *frameBase, const Tile &g,
                const int *offsets, int b, int h, int tile, int qblock) {
  const int rows = setupRows<ROWS, THREADS>(rowToken, g, qblock);
  if (rows <= 0)
    return rows;
  for (int j = threadIdx.x; j < KT; j += THREADS)
    frameBase[j] = keyFrameBase(g, offsets, b, h, tile, j);
  __syncthreads();
  return rows;
}

/// Stages the ROWS rows of `src` whose tokens rowToken holds (-1: a padding
/// row, zero-filled) into shared memory [ROWS][DP].
template <int ROWS, int THREADS>
__device__ __forceinline__ void loadRows(elem_t *dst, const elem_t *src,
                                         const int *rowToken, int b, int h) {
  constexpr int VPR = D / 8; // 16-byte vectors per row
  for (int i = threadIdx.x; i < ROWS * VPR; i += THREADS) {
    int r = i / VPR, c = (i % VPR) * 8;
    int n = rowToken[r];
    cpAsync16(dst + r * DP + c, src + (n >= 0 ? rowOffset(b, n, h) + c : 0),
              n >= 0 ? 16 : 0);
  }
}

/// Stages the ROWS queries [first, first + ROWS) of tile g, rows of both
/// `src0` and `src1`, into buffer `buf` of dst0 and dst1 ([buffers][ROWS][DP]
/// each); rows past the tile are zero-filled.
template <int ROWS, int THREADS>
__device__ __forceinline__ void
loadTileRows(elem_t *dst0, const elem_t *src0, elem_t *dst1, const elem_t *src1,
             int buf, const Tile &g, int first, int b, int h) {
  constexpr int VPR = D / 8;
  for (int i = threadIdx.x; i < ROWS * VPR; i += THREADS) {
    const int r = i / VPR, c = (i % VPR) * 8, qi = first + r;
    const long long src =
        qi < g.count ? rowOffset(b, queryToken(g, qi), h) + c : -1;
    cpAsync16(dst0 + (buf * ROWS + r) * DP + c, src0 + (src >= 0 ? src : 0),
              src >= 0 ? 16 : 0);
    cpAsync16(dst1 + (buf * ROWS + r) * DP + c, src1 + (src >= 0 ? src : 0),
              src >= 0 ? 16 : 0);
  }
}

/// Stages rows [chunk * KC, +KC) of the window of k and v into shared memory
/// ([KC][DP] each); rows past the window are zero-filled so that masked
/// probabilities never meet garbage.
template <int KC, int THREADS>
__device__ __forceinline__ void
loadKeyChunk(elem_t *ks, elem_t *vs, const elem_t *k, const elem_t *v,
             const int *frameBase, int chunk, int b, int h) {
  constexpr int VPR = D / 8;
  for (int i = threadIdx.x; i < KC * VPR; i += THREADS) {
    int r = i / VPR, c = (i % VPR) * 8;
    int w = chunk * KC + r;
    long long src = 0;
    int bytes = 0;
    if (w < WINDOW) {
      src = rowOffset(b, keyToken(frameBase, w), h) + c;
      bytes = 16;
    }
    cpAsync16(ks + r * DP + c, k + src, bytes);
    cpAsync16(vs + r * DP + c, v + src, bytes);
  }
}

// The kernels stream key chunks (forward, backward) and query steps (dK/dV)
// through STAGES shared-memory buffers, item i in buffer i % STAGES:
// `stage(i, buf)` issues item i's copies into buffer buf, and item 0 is
// staged and committed before the loop over the items.

/// Before item i of `count` is read: with two or more buffers, item i + 1
/// is staged into its buffer; then the wait for item i, and a barrier.
template <int STAGES, typename Stage>
__device__ __forceinline__ void pipelineAcquire(int i, int count, Stage stage) {
  if (STAGES > 1 && i + 1 < count) {
    stage(i + 1, (i + 1) % STAGES);
    cpAsyncCommit();
    cpAsyncWait<1>();
  } else {
    cpAsyncWait<0>();
  }
  __syncthreads();
}

/// After item i of `count` is read: a barrier (the next copies overwrite
/// its buffer); then, with one buffer, item i + 1 is staged into it.
template <int STAGES, typename Stage>
__device__ __forceinline__ void pipelineRelease(int i, int count, Stage stage) {
  __syncthreads();
  if (STAGES == 1 && i + 1 < count) {
    stage(i + 1, 0);
    cpAsyncCommit();
  }
}

//===----------------------------------------------------------------------===//
// Tensor-core fragments
//===----------------------------------------------------------------------===//

// Fragment addressing (m16n8k16, see the PTX ISA "Matrix fragments for
// mma.m16n8k16"): lane = 4 * g + c. A frags hold (row g|g+8, col 2c|2c+8),
// B frags (k 2c|2c+8, col g), C frags (row g|g+8, col 2c, 2c+1).

/// A fragment (16 rows x 16 cols) of a row-major smem matrix.
__device__ __forceinline__ void loadA(unsigned a[4], const elem_t *m, int ld,
                                      int row0, int col0) {
  int l = threadIdx.x % 32, i = l / 8;
  ldsm4(a,
        smemAddr(m + (row0 + l % 8 + (i & 1) * 8) * ld + col0 + (i >> 1) * 8));
}

/// A fragment of the transpose of a row-major smem matrix: A = M^T with
/// A rows = M cols [row0, row0 + 16), A cols = M rows [col0, col0 + 16).
__device__ __forceinline__ void loadAT(unsigned a[4], const elem_t *m, int ld,
                                       int row0, int col0) {
  int l = threadIdx.x % 32, i = l / 8;
  ldsm4T(a,
         smemAddr(m + (col0 + l % 8 + (i >> 1) * 8) * ld + row0 + (i & 1) * 8));
}

/// B fragments of two adjacent n-tiles, B[k][n] = M[n][k] (M row-major,
/// rows = n): b[0..1] for n-tile n0, b[2..3] for n0 + 8.
__device__ __forceinline__ void loadBNK(unsigned b[4], const elem_t *m, int ld,
                                        int n0, int k0) {
  int l = threadIdx.x % 32, i = l / 8;
  ldsm4(b, smemAddr(m + (n0 + l % 8 + (i >> 1) * 8) * ld + k0 + (i & 1) * 8));
}

/// B fragments of two adjacent n-tiles, B[k][n] = M[k][n] (M row-major,
/// rows = k): b[0..1] for n-tile n0, b[2..3] for n0 + 8.
__device__ __forceinline__ void loadBKN(unsigned b[4], const elem_t *m, int ld,
                                        int k0, int n0) {
  int l = threadIdx.x % 32, i = l / 8;
  ldsm4T(b, smemAddr(m + (k0 + l % 8 + (i & 1) * 8) * ld + n0 + (i >> 1) * 8));
}

} // namespace dsa
