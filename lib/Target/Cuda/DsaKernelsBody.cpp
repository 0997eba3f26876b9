//===- DsaKernelsBody.cpp - CUDA C++ of the 3D-DSA kernels ----------------===//
//
// The kernels emitted by DsaKernels.cpp for every configuration, written
// against the constants the emitter puts in front of them (T, Y, X, KT, KY,
// KX, TT, TY, TX, H, D, R and the FWD_/BWD_/OFF_ kernel shapes) and the
// DSA_*_NAME macros. Header-free CUDA C++ (NVRTC needs no include path):
// 16-bit elements are raw bits, conversions and tensor-core mma are inline
// PTX (mma.sync m16n8k16, ldmatrix, cp.async: sm_80 and newer).
//
//===----------------------------------------------------------------------===//

namespace megaslide::cuda::detail {

extern const char *const kDsaKernelBody;
const char *const kDsaKernelBody = R"cuda(
//===----------------------------------------------------------------------===//
// Derived constants
//===----------------------------------------------------------------------===//

namespace dsa {

constexpr int N = T * Y * X;                  // tokens per sample
constexpr int NTT = (T + TT - 1) / TT;        // tiles along t, y, x
constexpr int NTY = (Y + TY - 1) / TY;
constexpr int NTX = (X + TX - 1) / TX;
constexpr int NTILES = NTT * NTY * NTX;
constexpr int WINDOW = KT * KY * KX;          // keys per query tile
constexpr int FRAME_KEYS = KY * KX;           // keys per key frame
constexpr int DP = D + 8;                     // padded smem row: no bank conflicts
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
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
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
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                   smemAddr(dst)),
               "l"(src), "r"(bytes));
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
  const int *off = offsets + ((static_cast<long long>(b) * H + h) * NTILES +
                              tile) * KT * 2 + j * 2;
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

/// Stages rows [chunk*KC, chunk*KC + KC) of the window of k and v into
/// shared memory ([KC][DP] each); rows past the window are zero-filled so
/// that masked probabilities never meet garbage.
template <int KC, int THREADS>
__device__ __forceinline__ void loadKeyChunk(elem_t *ks, elem_t *vs,
                                             const elem_t *k, const elem_t *v,
                                             const int *frameBase, int chunk,
                                             int b, int h) {
  constexpr int VPR = D / 8; // 16-byte vectors per row
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

/// Stages `rows` query-side rows of `src` (tokens in rowToken, -1 = padding
/// row, zero-filled) into shared memory [rows][DP].
template <int THREADS>
__device__ __forceinline__ void loadRows(elem_t *dst, const elem_t *src,
                                         const int *rowToken, int rows, int b,
                                         int h) {
  constexpr int VPR = D / 8;
  for (int i = threadIdx.x; i < rows * VPR; i += THREADS) {
    int r = i / VPR, c = (i % VPR) * 8;
    int n = rowToken[r];
    cpAsync16(dst + r * DP + c, src + (n >= 0 ? rowOffset(b, n, h) + c : 0),
              n >= 0 ? 16 : 0);
  }
}

// Fragment addressing (m16n8k16, see the PTX ISA "Matrix fragments for
// mma.m16n8k16"): lane = 4 * g + c. A frags hold (row g|g+8, col 2c|2c+8),
// B frags (k 2c|2c+8, col g), C frags (row g|g+8, col 2c, 2c+1).

/// A fragment (16 rows x 16 cols) of a row-major smem matrix.
__device__ __forceinline__ void loadA(unsigned a[4], const elem_t *m, int ld,
                                      int row0, int col0) {
  int l = threadIdx.x % 32, i = l / 8;
  ldsm4(a, smemAddr(m + (row0 + l % 8 + (i & 1) * 8) * ld + col0 +
                    (i >> 1) * 8));
}

/// A fragment of the transpose of a row-major smem matrix: A = M^T with
/// A rows = M cols [row0, row0 + 16), A cols = M rows [col0, col0 + 16).
__device__ __forceinline__ void loadAT(unsigned a[4], const elem_t *m, int ld,
                                       int row0, int col0) {
  int l = threadIdx.x % 32, i = l / 8;
  ldsm4T(a, smemAddr(m + (col0 + l % 8 + (i >> 1) * 8) * ld + row0 +
                     (i & 1) * 8));
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

} // namespace dsa

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
  elem_t *qs = reinterpret_cast<elem_t *>(smem);      // [FWD_ROWS][DP]
  elem_t *ks = qs + FWD_ROWS * DP;                    // [STAGES][KC][DP]
  elem_t *vs = ks + FWD_STAGES * FWD_KC * DP;         // [STAGES][KC][DP]
  int *rowToken = reinterpret_cast<int *>(vs + FWD_STAGES * FWD_KC * DP);
  int *frameBase = rowToken + FWD_ROWS;               // [KT]

  const int tile = blockIdx.x / FWD_QBLOCKS, qblock = blockIdx.x % FWD_QBLOCKS;
  const int h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const Tile geo = tileGeometry(tile);

  const int rows = setupRows<FWD_ROWS, FWD_THREADS>(rowToken, geo, qblock);
  if (rows <= 0)
    return; // a query block past the end of a partial border tile
  for (int j = threadIdx.x; j < KT; j += FWD_THREADS)
    frameBase[j] = keyFrameBase(geo, offsets, b, h, tile, j);
  __syncthreads();

  loadRows<FWD_THREADS>(qs, q, rowToken, FWD_ROWS, b, h);
  loadKeyChunk<FWD_KC, FWD_THREADS>(ks, vs, k, v, frameBase, 0, b, h);
  cpAsyncCommit();

  const bool active = warp * 16 < rows; // warps of padding rows only copy
  const int row0 = warp * 16;
  const float scaleLog2 = scale * LOG2E;
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
    o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {-infinity(), -infinity()}; // running max (log2 units), rows g, g+8
  float l[2] = {0.f, 0.f};             // running sum (this lane's columns)

  for (int chunk = 0; chunk < FWD_CHUNKS; ++chunk) {
    const int stage = chunk % FWD_STAGES;
    if (FWD_STAGES > 1 && chunk + 1 < FWD_CHUNKS) {
      const int next = (chunk + 1) % FWD_STAGES;
      loadKeyChunk<FWD_KC, FWD_THREADS>(ks + next * FWD_KC * DP,
                                        vs + next * FWD_KC * DP, k, v,
                                        frameBase, chunk + 1, b, h);
      cpAsyncCommit();
      cpAsyncWait<1>();
    } else {
      cpAsyncWait<0>();
    }
    __syncthreads();
    const elem_t *kc = ks + stage * FWD_KC * DP;
    const elem_t *vc = vs + stage * FWD_KC * DP;

    if (active) {
      // S = q k^T for this warp's 16 queries and the chunk's keys.
      float s[FWD_KC / 8][4];
#pragma unroll
      for (int i = 0; i < FWD_KC / 8; ++i)
        s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        unsigned a[4];
        loadA(a, qs, DP, row0, kk * 16);
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
    __syncthreads(); // the next prefetch overwrites this stage
    if (FWD_STAGES == 1 && chunk + 1 < FWD_CHUNKS) {
      loadKeyChunk<FWD_KC, FWD_THREADS>(ks, vs, k, v, frameBase, chunk + 1,
                                        b, h);
      cpAsyncCommit();
    }
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
// Backward: dQ, dK, dV
//===----------------------------------------------------------------------===//
//
// Same CTA decomposition as the forward. Per key chunk, each warp
// recomputes S = q k^T and dP = dO v^T for its 16 queries, P = exp(scale S -
// lse), dS = P * (dP - Delta) with Delta = rowsum(dO * O), and accumulates
// dQ += dS k in registers (a query belongs to exactly one tile, so dQ is
// written once, without atomics). P and dS go to shared memory as 16-bit
// values; then all warps together form the chunk's dV = P^T dO and dK =
// scale dS^T q over the CTA's queries and add them with float2 atomics into
// fp32 scratch [B, N, H, D]: windows of different tiles overlap and their
// displacements are data-dependent, so no CTA owns a key. The scratch must
// be zeroed before the launch; DSA_BWD_FINALIZE_NAME converts it to the
// element type afterwards.

namespace dsa {
constexpr int BWD_THREADS = 32 * BWD_WARPS;
constexpr int BWD_ROWS = 16 * BWD_WARPS;
constexpr int BWD_CHUNKS = (WINDOW + BWD_KC - 1) / BWD_KC;
constexpr int BWD_KCP = BWD_KC + 8;            // padded P / dS smem row
constexpr int BWD_NGROUPS = (D / 8) / BWD_NGW; // n-tile groups per 16 keys
constexpr int BWD_ITEMS = (BWD_KC / 16) * BWD_NGROUPS;
static_assert(BWD_KC % 16 == 0, "key chunk must be a multiple of 16");
static_assert((D / 8) % BWD_NGW == 0 && BWD_NGW % 2 == 0,
              "dK/dV n-tile group must divide D / 8 and be even");
} // namespace dsa

/// Adds a warp's 16-key x (8 * BWD_NGW) block of dK or dV into fp32 scratch.
__device__ __forceinline__ void flushKeyGrad(float *dst, const float acc[][4],
                                             const int *frameBase, int chunk,
                                             int key0, int col0, int b, int h,
                                             float mul) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int w = chunk * BWD_KC + key0 + g + 8 * r;
    if (w >= WINDOW)
      continue;
    float *row = dst + rowOffset(b, keyToken(frameBase, w), h) + col0 + 2 * c;
#pragma unroll
    for (int i = 0; i < BWD_NGW; ++i)
      atomicAdd(reinterpret_cast<float2 *>(row + i * 8),
                make_float2(acc[i][2 * r] * mul, acc[i][2 * r + 1] * mul));
  }
}

/// acc = M1^T M2 block for keys [key0, +16) and columns [col0, +8 BWD_NGW):
/// M1 [rows][BWD_KCP] (P or dS), M2 [rows][DP] (dO or q), k = query rows.
__device__ __forceinline__ void keyGradBlock(float acc[][4], const elem_t *m1,
                                             const elem_t *m2, int qsteps,
                                             int key0, int col0) {
#pragma unroll
  for (int i = 0; i < BWD_NGW; ++i)
    acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  for (int kq = 0; kq < qsteps; ++kq) {
    unsigned a[4];
    loadAT(a, m1, BWD_KCP, key0, kq * 16);
#pragma unroll
    for (int i = 0; i < BWD_NGW / 2; ++i) {
      unsigned bf[4];
      loadBKN(bf, m2, DP, kq * 16, col0 + i * 16);
      mma16816(acc[2 * i], a, bf[0], bf[1]);
      mma16816(acc[2 * i + 1], a, bf[2], bf[3]);
    }
  }
}

extern "C" __global__ void __launch_bounds__(BWD_THREADS, BWD_MIN_BLOCKS)
    DSA_BWD_NAME(const elem_t *__restrict__ q, const elem_t *__restrict__ k,
                 const elem_t *__restrict__ v, const int *__restrict__ offsets,
                 const elem_t *__restrict__ o, const elem_t *__restrict__ dout,
                 const float *__restrict__ lse, elem_t *__restrict__ dq,
                 float *__restrict__ dk32, float *__restrict__ dv32,
                 float scale) {
  extern __shared__ __align__(16) unsigned char smem[];
  elem_t *qs = reinterpret_cast<elem_t *>(smem);   // [BWD_ROWS][DP]
  elem_t *dos = qs + BWD_ROWS * DP;                // [BWD_ROWS][DP]
  elem_t *ks = dos + BWD_ROWS * DP;                // [STAGES][KC][DP]
  elem_t *vs = ks + BWD_STAGES * BWD_KC * DP;      // [STAGES][KC][DP]
  elem_t *ps = vs + BWD_STAGES * BWD_KC * DP;      // [BWD_ROWS][BWD_KCP]
  elem_t *dss = ps + BWD_ROWS * BWD_KCP;           // [BWD_ROWS][BWD_KCP]
  float *rowLse = reinterpret_cast<float *>(dss + BWD_ROWS * BWD_KCP);
  float *rowDelta = rowLse + BWD_ROWS;
  int *rowToken = reinterpret_cast<int *>(rowDelta + BWD_ROWS);
  int *frameBase = rowToken + BWD_ROWS;            // [KT]

  const int tile = blockIdx.x / BWD_QBLOCKS, qblock = blockIdx.x % BWD_QBLOCKS;
  const int h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const Tile geo = tileGeometry(tile);

  const int rows = setupRows<BWD_ROWS, BWD_THREADS>(rowToken, geo, qblock);
  if (rows <= 0)
    return; // a query block past the end of a partial border tile
  for (int j = threadIdx.x; j < KT; j += BWD_THREADS)
    frameBase[j] = keyFrameBase(geo, offsets, b, h, tile, j);
  __syncthreads();

  loadRows<BWD_THREADS>(qs, q, rowToken, BWD_ROWS, b, h);
  loadRows<BWD_THREADS>(dos, dout, rowToken, BWD_ROWS, b, h);
  loadKeyChunk<BWD_KC, BWD_THREADS>(ks, vs, k, v, frameBase, 0, b, h);
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
      rowLse[r] = n >= 0 ? lse[(static_cast<long long>(b) * H + h) * N + n] *
                               LOG2E
                         : infinity();
    }
  }

  const bool active = warp * 16 < rows;
  const int row0 = warp * 16;
  const int qsteps = (rows + 15) / 16; // 16-query k-steps holding real rows
  const float scaleLog2 = scale * LOG2E;
  float dqAcc[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
    dqAcc[i][0] = dqAcc[i][1] = dqAcc[i][2] = dqAcc[i][3] = 0.f;

  for (int chunk = 0; chunk < BWD_CHUNKS; ++chunk) {
    const int stage = chunk % BWD_STAGES;
    if (BWD_STAGES > 1 && chunk + 1 < BWD_CHUNKS) {
      const int next = (chunk + 1) % BWD_STAGES;
      loadKeyChunk<BWD_KC, BWD_THREADS>(ks + next * BWD_KC * DP,
                                        vs + next * BWD_KC * DP, k, v,
                                        frameBase, chunk + 1, b, h);
      cpAsyncCommit();
      cpAsyncWait<1>();
    } else {
      cpAsyncWait<0>();
    }
    __syncthreads();
    const elem_t *kc = ks + stage * BWD_KC * DP;
    const elem_t *vc = vs + stage * BWD_KC * DP;

    // Phase 1 (per warp, its 16 queries): P, dS, dQ.
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
      const float delta[2] = {rowDelta[row0 + g], rowDelta[row0 + g + 8]};
#pragma unroll
      for (int i = 0; i < BWD_KC / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float p = fastExp2(s[i][e] * scaleLog2 - lse2[e / 2]);
          if (WINDOW % BWD_KC != 0 &&
              chunk * BWD_KC + i * 8 + 2 * c + (e & 1) >= WINDOW)
            p = 0.f;
          s[i][e] = p;                           // P
          dp[i][e] = p * (dp[i][e] - delta[e / 2]); // dS (unscaled)
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int off = (row0 + g + 8 * r) * BWD_KCP + i * 8 + 2 * c;
          *reinterpret_cast<unsigned *>(ps + off) =
              pack2(s[i][2 * r], s[i][2 * r + 1]);
          *reinterpret_cast<unsigned *>(dss + off) =
              pack2(dp[i][2 * r], dp[i][2 * r + 1]);
        }
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
    __syncthreads(); // P and dS of all warps are in shared memory

    // Phase 2 (all warps, the CTA's queries): dV = P^T dO, dK = scale dS^T q.
    for (int item = warp; item < BWD_ITEMS; item += BWD_WARPS) {
      const int key0 = (item / BWD_NGROUPS) * 16;
      const int col0 = (item % BWD_NGROUPS) * BWD_NGW * 8;
      float acc[BWD_NGW][4];
      keyGradBlock(acc, ps, dos, qsteps, key0, col0);
      flushKeyGrad(dv32, acc, frameBase, chunk, key0, col0, b, h, 1.f);
      keyGradBlock(acc, dss, qs, qsteps, key0, col0);
      flushKeyGrad(dk32, acc, frameBase, chunk, key0, col0, b, h, scale);
    }
    __syncthreads(); // the next chunk overwrites K, V, P and dS
    if (BWD_STAGES == 1 && chunk + 1 < BWD_CHUNKS) {
      loadKeyChunk<BWD_KC, BWD_THREADS>(ks, vs, k, v, frameBase, chunk + 1,
                                        b, h);
      cpAsyncCommit();
    }
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

/// dK and dV from the fp32 scratch of DSA_BWD_NAME to the element type;
/// `count` = B * N * H * D (even).
extern "C" __global__ void __launch_bounds__(256)
    DSA_BWD_FINALIZE_NAME(const float *__restrict__ dk32,
                          const float *__restrict__ dv32,
                          elem_t *__restrict__ dk, elem_t *__restrict__ dv,
                          long long count) {
  const long long stride = 2ll * gridDim.x * blockDim.x;
  for (long long i = 2ll * (blockIdx.x * blockDim.x + threadIdx.x); i < count;
       i += stride) {
    float2 a = *reinterpret_cast<const float2 *>(dk32 + i);
    float2 bv = *reinterpret_cast<const float2 *>(dv32 + i);
    *reinterpret_cast<unsigned *>(dk + i) = pack2(a.x, a.y);
    *reinterpret_cast<unsigned *>(dv + i) = pack2(bv.x, bv.y);
  }
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
    DSA_OFFSETS_NAME(const elem_t *__restrict__ q,
                     const elem_t *__restrict__ k, int *__restrict__ offsets) {
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
      const Candidate cand = {score, ((abs(dy) + abs(dx)) * OFF_SIDE +
                                      dy + R) * OFF_SIDE + dx + R};
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
      int *dst = offsets + ((static_cast<long long>(b) * H + h) * NTILES +
                            tile) * KT * 2 + j * 2;
      dst[0] = r / OFF_SIDE - R;
      dst[1] = r % OFF_SIDE - R;
    }
  }
}
)cuda";

} // namespace megaslide::cuda::detail
