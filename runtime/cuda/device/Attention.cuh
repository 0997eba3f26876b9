//===- Attention.cuh - Attention on tensor cores ---------------*- CUDA -*-===//
//
// The CUDA C++ of global attention on tensor cores (docs/Runtime.md,
// "Attention on tensor cores"), which ElementwiseKernels.cpp emits after
// Elementwise.cuh. Templates over the 16-bit input type T (ms_bf16 or
// ms_f16), the output types and the head dim DH (a multiple of 8 up to
// 128, padded to a multiple of 16 in shared memory and registers); the
// kernel table of ElementwiseKernelsSource.inc instantiates one kind per
// head dim (attention_fwd_tc<DH>, ...).
//
// The inline-PTX primitives (mma.sync m16n8k16, ldmatrix, cp.async, packs)
// are a second copy of lib/Target/Cuda/device/Dsa3dDevice.cuh's, in the
// same style: the 3D-DSA ones are fixed to one element type by a macro and
// take shared-memory addresses, these are per type and take pointers (so a
// host emulation reads the pointer).
//
//===----------------------------------------------------------------------===//

#include "Elementwise.cuh"

//===----------------------------------------------------------------------===//
// Tensor-core primitives (sm_80 and newer PTX)
//===----------------------------------------------------------------------===//

// With MS_HOST_EMULATION the emulator supplies these (the dense kernels'
// host tests, test/unit/runtime/cuda/CudaBackendTest.cpp).
#ifndef MS_HOST_EMULATION
/// Packs (lo, hi) into one register, lo in the low half (lower address).
__device__ __forceinline__ unsigned msPackBf16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ unsigned msPackF16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

/// c += a * b on tensor cores: a 16x16 (row), b 16x8 (col), c 16x8 fp32.
__device__ __forceinline__ void msMmaBf16(float c[4], const unsigned a[4],
                                          unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void msMmaF16(float c[4], const unsigned a[4],
                                         unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned msSmemAddr(const void *p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

/// Four 8x8 b16 matrices from shared memory; lane l gives the address of
/// row l % 8 of matrix l / 8.
__device__ __forceinline__ void msLdsm4(unsigned r[4], const void *p) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(msSmemAddr(p)));
}
/// Like msLdsm4, each matrix transposed.
__device__ __forceinline__ void msLdsm4T(unsigned r[4], const void *p) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(msSmemAddr(p)));
}

/// 16-byte global -> shared copy; bytes = 0 zero-fills the destination.
__device__ __forceinline__ void msCpAsync16(void *dst, const void *src,
                                            int bytes) {
  asm volatile(
      "cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(msSmemAddr(dst)),
      "l"(src), "r"(bytes));
}
/// 4-byte global -> shared copy (.ca: .cg takes 16 bytes only).
__device__ __forceinline__ void msCpAsync4(void *dst, const void *src) {
  asm volatile(
      "cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(msSmemAddr(dst)),
      "l"(src));
}
__device__ __forceinline__ void msCpAsyncCommit() {
  asm volatile("cp.async.commit_group;");
}
template <int Pending> __device__ __forceinline__ void msCpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending));
}

__device__ __forceinline__ float msExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif // MS_HOST_EMULATION

/// The tensor-core operations of a 16-bit element type.
template <typename T> struct MsTc;
template <> struct MsTc<ms_bf16> {
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return msPackBf16x2(lo, hi);
  }
  static __device__ __forceinline__ void mma(float c[4], const unsigned a[4],
                                             unsigned b0, unsigned b1) {
    msMmaBf16(c, a, b0, b1);
  }
};
template <> struct MsTc<ms_f16> {
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return msPackF16x2(lo, hi);
  }
  static __device__ __forceinline__ void mma(float c[4], const unsigned a[4],
                                             unsigned b0, unsigned b1) {
    msMmaF16(c, a, b0, b1);
  }
};

//===----------------------------------------------------------------------===//
// Tiles in shared memory and their fragments
//===----------------------------------------------------------------------===//

#define MS_ATT_TC_THREADS 128
#define MS_ATT_LOG2E 1.4426950408889634f
#define MS_ATT_LN2 0.6931471805599453f

/// Head dim DH (a multiple of 8) rounded up to the mma's k of 16: the
/// columns the fragments span; the padding columns are zero in shared
/// memory, so they add nothing to Q K^T and are never stored.
template <int DH> struct MsAttRow {
  static constexpr int kCols = (DH + 15) / 16 * 16;
  /// Shared-memory row: kCols + 8 elements, so that the 8 row addresses of
  /// an ldmatrix fall in distinct 16-byte bank groups.
  static constexpr int kPitch = kCols + 8;
};

/// Stages rows [n0, n0 + ROWS) of head h of sample b of a [B, N, H, DH]
/// tensor into `dst` [ROWS][kPitch] with cp.async; rows past N and the
/// padding columns are zero-filled (zero keys, values and queries never
/// produce a NaN).
template <int ROWS, int DH, typename T>
__device__ __forceinline__ void
msAttLoadRows(unsigned short *dst, const T *src, long long b, long long n0,
              long long N, long long H, long long h) {
  constexpr int VPR = MsAttRow<DH>::kCols / 8, P = MsAttRow<DH>::kPitch;
  for (int i = threadIdx.x; i < ROWS * VPR; i += MS_ATT_TC_THREADS) {
    int r = i / VPR, c = (i % VPR) * 8;
    long long n = n0 + r;
    bool in = n < N && c < DH;
    const T *p = src + (in ? ((b * N + n) * H + h) * DH + c : 0);
    msCpAsync16(dst + r * P + c, p, in ? 16 : 0);
  }
}

// Fragment addressing (m16n8k16, the PTX ISA's "Matrix fragments for
// mma.m16n8k16"): lane = 4 g + c. A fragments hold (row g|g+8, cols 2c,
// 2c+1 | 2c+8, 2c+9), B fragments (k 2c, 2c+1 | 2c+8, 2c+9; col g), C
// fragments (row g|g+8; cols 2c, 2c+1).

/// A fragment (16 x 16) of a row-major smem matrix at (row0, col0).
__device__ __forceinline__ void
msAttLoadA(unsigned a[4], const unsigned short *m, int ld, int row0, int col0) {
  int l = threadIdx.x % 32, i = l / 8;
  msLdsm4(a, m + (row0 + l % 8 + (i & 1) * 8) * ld + col0 + (i >> 1) * 8);
}

/// B fragments of two adjacent n-tiles, B[k][n] = M[n][k] (M row-major,
/// rows = n): b[0..1] for n-tile n0, b[2..3] for n0 + 8.
__device__ __forceinline__ void
msAttLoadBNK(unsigned b[4], const unsigned short *m, int ld, int n0, int k0) {
  int l = threadIdx.x % 32, i = l / 8;
  msLdsm4(b, m + (n0 + l % 8 + (i >> 1) * 8) * ld + k0 + (i & 1) * 8);
}

/// B fragments of two adjacent n-tiles, B[k][n] = M[k][n] (M row-major,
/// rows = k): b[0..1] for n-tile n0, b[2..3] for n0 + 8.
__device__ __forceinline__ void
msAttLoadBKN(unsigned b[4], const unsigned short *m, int ld, int k0, int n0) {
  int l = threadIdx.x % 32, i = l / 8;
  msLdsm4T(b, m + (k0 + l % 8 + (i & 1) * 8) * ld + n0 + (i >> 1) * 8);
}

/// The A fragment of one 16-wide k-step made of the C fragments of two
/// adjacent n-tiles (P or dS feeding the next product).
template <typename T>
__device__ __forceinline__ void msAttCtoA(unsigned a[4], const float c0[4],
                                          const float c1[4]) {
  a[0] = MsTc<T>::pack2(c0[0], c0[1]);
  a[1] = MsTc<T>::pack2(c0[2], c0[3]);
  a[2] = MsTc<T>::pack2(c1[0], c1[1]);
  a[3] = MsTc<T>::pack2(c1[2], c1[3]);
}

/// acc[NT][4] += A (16 x DH, fragments a[DH / 16]) times the B^T of the
/// NT * 8 rows of smem matrix m from row n0 (S = Q K^T, dP = dO V^T).
template <typename T, int DH, int NT>
__device__ __forceinline__ void
msAttRowsTimesT(float acc[][4], const unsigned a[][4], const unsigned short *m,
                int n0) {
  constexpr int P = MsAttRow<DH>::kPitch;
#pragma unroll
  for (int kk = 0; kk < DH / 16; ++kk)
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      unsigned bf[4];
      msAttLoadBNK(bf, m, P, n0 + np * 16, kk * 16);
      MsTc<T>::mma(acc[2 * np], a[kk], bf[0], bf[1]);
      MsTc<T>::mma(acc[2 * np + 1], a[kk], bf[2], bf[3]);
    }
}

/// acc[DH / 8][4] += A (16 x 16 KS, C fragments c[2 KS][4]) times rows
/// [k0, k0 + 16 KS) of smem matrix m [.][DH] (O += P V, dQ += dS K, ...).
template <typename T, int DH, int KS>
__device__ __forceinline__ void
msAttTimesRows(float acc[][4], const float c[][4], const unsigned short *m,
               int k0) {
  constexpr int P = MsAttRow<DH>::kPitch;
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    unsigned a[4];
    msAttCtoA<T>(a, c[2 * kk], c[2 * kk + 1]);
#pragma unroll
    for (int dp = 0; dp < DH / 16; ++dp) {
      unsigned bf[4];
      msAttLoadBKN(bf, m, P, k0 + kk * 16, dp * 16);
      MsTc<T>::mma(acc[2 * dp], a, bf[0], bf[1]);
      MsTc<T>::mma(acc[2 * dp + 1], a, bf[2], bf[3]);
    }
  }
}

template <int N> __device__ __forceinline__ void msAttZero(float acc[][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
}

/// The max (or sum) over the 4 lanes of a quad: one row of C fragments.
__device__ __forceinline__ float msQuadMax(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float msQuadSum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

/// Rows g, g + 8 of a warp's 16 C-fragment rows: stores acc * mul into
/// rows [row0, +16) of head h of a [B, N, H, DH] tensor; rows past N and
/// padding columns are not stored.
template <int DH, typename TO>
__device__ __forceinline__ void
msAttStoreRows(TO *dst, const float acc[][4], const float mul[2], long long b,
               long long row0, long long N, long long H, long long h) {
  int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    long long n = row0 + g + 8 * r;
    if (n >= N)
      continue;
    long long base = ((b * N + n) * H + h) * DH + 2 * c;
#pragma unroll
    for (int i = 0; i < MsAttRow<DH>::kCols / 8; ++i) {
      if (i * 8 >= DH)
        break;
      msStore(dst, base + i * 8, acc[i][2 * r] * mul[r]);
      msStore(dst, base + i * 8 + 1, acc[i][2 * r + 1] * mul[r]);
    }
  }
}

//===----------------------------------------------------------------------===//
// Forward: O = softmax(scale Q K^T) V, lse = log-sum-exp (flash-attention 2)
//===----------------------------------------------------------------------===//
//
// CTA (4 warps) = 64 queries of one (head, sample); warp = 16 queries,
// whose Q fragments stay in registers (ldmatrix once). Keys and values
// stream in chunks of 64 through one K and one V buffer, each refilled by
// cp.async while the other is read: V_j lands during S_j = Q K_j^T and
// the softmax, K_{j+1} during O += P_j V_j. Online softmax in fp32, base 2.
// grid (ceil(Nq / 64), H, B).

template <typename T, typename TO, int DH>
__device__ __forceinline__ void
msAttnFwdTc(const T *q, const T *k, const T *v, TO *o, float *lse, long long B,
            long long Nq, long long Nk, long long H, float scale) {
  constexpr int KC = 64, P = MsAttRow<DH>::kPitch, DC = MsAttRow<DH>::kCols;
  __align__(16) __shared__ unsigned short ks[KC * P];
  __align__(16) __shared__ unsigned short vs[KC * P];
  const long long q0 = (long long)blockIdx.x * 64, h = blockIdx.y,
                  b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, c = lane % 4;
  const int row0 = warp * 16;

  // Q goes through the V buffer once, K_0 into the K buffer.
  msAttLoadRows<64, DH>(vs, q, b, q0, Nq, H, h);
  msAttLoadRows<KC, DH>(ks, k, b, 0, Nk, H, h);
  msCpAsyncCommit();
  msCpAsyncWait<0>();
  __syncthreads();
  unsigned qf[DC / 16][4];
#pragma unroll
  for (int kk = 0; kk < DC / 16; ++kk)
    msAttLoadA(qf[kk], vs, P, row0, kk * 16);
  __syncthreads();
  msAttLoadRows<KC, DH>(vs, v, b, 0, Nk, H, h);
  msCpAsyncCommit();

  const float scaleLog2 = scale * MS_ATT_LOG2E;
  float acc[DC / 8][4];
  msAttZero<DC / 8>(acc);
  float m[2] = {msNegInf(), msNegInf()}; // running max (log2 units)
  float l[2] = {0.0f, 0.0f};             // running sum, this lane's columns
  const long long chunks = (Nk + KC - 1) / KC;
  for (long long j = 0; j < chunks; ++j) {
    // K_j is resident, V_j in flight.
    float s[KC / 8][4];
    msAttZero<KC / 8>(s);
    msAttRowsTimesT<T, DC, KC / 8>(s, qf, ks, 0);
    float mx[2] = {msNegInf(), msNegInf()};
#pragma unroll
    for (int i = 0; i < KC / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[i][e] * scaleLog2;
        if (j * KC + i * 8 + 2 * c + (e & 1) >= Nk)
          x = msNegInf(); // a key past the end
        s[i][e] = x;
        mx[e / 2] = fmaxf(mx[e / 2], x);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mNew = fmaxf(m[r], msQuadMax(mx[r]));
      float alpha = msExp2(m[r] - mNew); // 0 on the first chunk
      m[r] = mNew;
      l[r] *= alpha;
#pragma unroll
      for (int i = 0; i < DC / 8; ++i) {
        acc[i][2 * r] *= alpha;
        acc[i][2 * r + 1] *= alpha;
      }
    }
#pragma unroll
    for (int i = 0; i < KC / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = msExp2(s[i][e] - m[e / 2]);
        s[i][e] = p;
        l[e / 2] += p;
      }
    __syncthreads(); // every warp is done with K_j
    if (j + 1 < chunks) {
      msAttLoadRows<KC, DH>(ks, k, b, (j + 1) * KC, Nk, H, h);
      msCpAsyncCommit();
      msCpAsyncWait<1>(); // V_j
    } else {
      msCpAsyncWait<0>();
    }
    __syncthreads();
    msAttTimesRows<T, DC, KC / 16>(acc, s, vs, 0);
    __syncthreads(); // every warp is done with V_j
    if (j + 1 < chunks) {
      msAttLoadRows<KC, DH>(vs, v, b, (j + 1) * KC, Nk, H, h);
      msCpAsyncCommit();
      msCpAsyncWait<1>(); // K_{j+1}
      __syncthreads();
    }
  }

  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = msQuadSum(l[r]);
    inv[r] = 1.0f / l[r];
  }
  msAttStoreRows<DH>(o, acc, inv, b, q0 + row0, Nq, H, h);
  if (lse && c == 0) {
    int g = lane / 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      long long n = q0 + row0 + g + 8 * r;
      if (n < Nq) // natural-log log-sum-exp of scale q k^T
        lse[(b * H + h) * Nq + n] = (m[r] + __log2f(l[r])) * MS_ATT_LN2;
    }
  }
}

//===----------------------------------------------------------------------===//
// Backward, query side: dQ, lse and delta = rowsum(dO * O)
//===----------------------------------------------------------------------===//
//
// CTA = 64 queries as in the forward; Q and dO fragments in registers.
// attention_grad has no lse operand, so a first pass over the keys
// recomputes it (S = Q K^T, online max and sum); the second forms, per
// chunk of 32 keys, P = exp(S - lse), dP = dO V^T, dS = P (dP - delta) and
// dQ += dS K. K and V chunks are double-buffered (cp.async). dQ is written
// once; lse and delta go to [B, H, Nq] for the key-side kernel.

template <typename T, typename TOI, typename TQ, int DH>
__device__ __forceinline__ void
msAttnBwdDqTc(const T *q, const T *k, const T *v, const TOI *o, const T *dout,
              TQ *dq, float *lse, float *delta, long long B, long long Nq,
              long long Nk, long long H, float scale) {
  constexpr int KC = 32, P = MsAttRow<DH>::kPitch, DC = MsAttRow<DH>::kCols;
  __align__(16) __shared__ unsigned short ks[2 * KC * P];
  __align__(16) __shared__ unsigned short vs[2 * KC * P];
  const long long q0 = (long long)blockIdx.x * 64, h = blockIdx.y,
                  b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4,
            c = lane % 4;
  const int row0 = warp * 16;

  // Q through the K buffers, dO through the V buffers (64 rows each).
  msAttLoadRows<64, DH>(ks, q, b, q0, Nq, H, h);
  msAttLoadRows<64, DH>(vs, dout, b, q0, Nq, H, h);
  msCpAsyncCommit();

  // delta = rowsum(dO * O) over this warp's 16 rows, in fp32 from global.
  float dl[2] = {0.0f, 0.0f};
  for (int r = 0; r < 16; ++r) {
    long long n = q0 + row0 + r;
    float sum = 0.0f;
    if (n < Nq) {
      long long base = ((b * Nq + n) * H + h) * DH;
      for (int d = lane; d < DH; d += 32)
        sum += msLoad(dout, base + d) * msLoad(o, base + d);
    }
    sum = msWarpSum(sum);
    if (r == g)
      dl[0] = sum;
    if (r == g + 8)
      dl[1] = sum;
  }

  msCpAsyncWait<0>();
  __syncthreads();
  unsigned qf[DC / 16][4], df[DC / 16][4];
#pragma unroll
  for (int kk = 0; kk < DC / 16; ++kk) {
    msAttLoadA(qf[kk], ks, P, row0, kk * 16);
    msAttLoadA(df[kk], vs, P, row0, kk * 16);
  }
  __syncthreads();

  const float scaleLog2 = scale * MS_ATT_LOG2E;
  const long long chunks = (Nk + KC - 1) / KC;

  // Pass 1: lse (log2 units) from the online max and sum.
  float m[2] = {msNegInf(), msNegInf()}, l[2] = {0.0f, 0.0f};
  msAttLoadRows<KC, DH>(ks, k, b, 0, Nk, H, h);
  msCpAsyncCommit();
  for (long long j = 0; j < chunks; ++j) {
    const unsigned short *kc = ks + (j % 2) * KC * P;
    if (j + 1 < chunks) {
      msAttLoadRows<KC, DH>(ks + ((j + 1) % 2) * KC * P, k, b, (j + 1) * KC, Nk,
                            H, h);
      msCpAsyncCommit();
      msCpAsyncWait<1>();
    } else {
      msCpAsyncWait<0>();
    }
    __syncthreads();
    float s[KC / 8][4];
    msAttZero<KC / 8>(s);
    msAttRowsTimesT<T, DC, KC / 8>(s, qf, kc, 0);
    float mx[2] = {msNegInf(), msNegInf()};
#pragma unroll
    for (int i = 0; i < KC / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[i][e] * scaleLog2;
        if (j * KC + i * 8 + 2 * c + (e & 1) >= Nk)
          x = msNegInf();
        s[i][e] = x;
        mx[e / 2] = fmaxf(mx[e / 2], x);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mNew = fmaxf(m[r], msQuadMax(mx[r]));
      l[r] *= msExp2(m[r] - mNew);
      m[r] = mNew;
    }
#pragma unroll
    for (int i = 0; i < KC / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        l[e / 2] += msExp2(s[i][e] - m[e / 2]);
    __syncthreads(); // the buffer is refilled two chunks later
  }
  float L[2];
#pragma unroll
  for (int r = 0; r < 2; ++r)
    L[r] = m[r] + __log2f(msQuadSum(l[r]));
  if (c == 0)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      long long n = q0 + row0 + g + 8 * r;
      if (n < Nq) {
        lse[(b * H + h) * Nq + n] = L[r] * MS_ATT_LN2;
        delta[(b * H + h) * Nq + n] = dl[r];
      }
    }

  // Pass 2: dQ.
  float acc[DC / 8][4];
  msAttZero<DC / 8>(acc);
  msAttLoadRows<KC, DH>(ks, k, b, 0, Nk, H, h);
  msAttLoadRows<KC, DH>(vs, v, b, 0, Nk, H, h);
  msCpAsyncCommit();
  for (long long j = 0; j < chunks; ++j) {
    const unsigned short *kc = ks + (j % 2) * KC * P;
    const unsigned short *vc = vs + (j % 2) * KC * P;
    if (j + 1 < chunks) {
      int next = (j + 1) % 2;
      msAttLoadRows<KC, DH>(ks + next * KC * P, k, b, (j + 1) * KC, Nk, H, h);
      msAttLoadRows<KC, DH>(vs + next * KC * P, v, b, (j + 1) * KC, Nk, H, h);
      msCpAsyncCommit();
      msCpAsyncWait<1>();
    } else {
      msCpAsyncWait<0>();
    }
    __syncthreads();
    float s[KC / 8][4], dp[KC / 8][4];
    msAttZero<KC / 8>(s);
    msAttZero<KC / 8>(dp);
    msAttRowsTimesT<T, DC, KC / 8>(s, qf, kc, 0);
    msAttRowsTimesT<T, DC, KC / 8>(dp, df, vc, 0);
#pragma unroll
    for (int i = 0; i < KC / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[i][e] * scaleLog2;
        // (Keys past Nk are zero rows of K and V, so their dS meets zero
        // K rows anyway; masking keeps P itself exact.)
        if (j * KC + i * 8 + 2 * c + (e & 1) >= Nk)
          x = msNegInf();
        float p = msExp2(x - L[e / 2]);
        s[i][e] = p * (dp[i][e] - dl[e / 2]); // dS
      }
    msAttTimesRows<T, DC, KC / 16>(acc, s, kc, 0);
    __syncthreads(); // the buffer is refilled two chunks later
  }
  float mul[2] = {scale, scale};
  msAttStoreRows<DH>(dq, acc, mul, b, q0 + row0, Nq, H, h);
}

//===----------------------------------------------------------------------===//
// Backward, key side: dK, dV
//===----------------------------------------------------------------------===//
//
// CTA = 64 keys of one (head, sample); warp = 16 keys, whose K and V
// fragments stay in registers. Queries, dO, lse and delta stream in chunks
// of 32 (cp.async, double-buffered); per chunk each warp forms S^T = K Q^T,
// dP^T = V dO^T, P^T = exp(S^T - lse), dS^T = P^T (dP^T - delta) and
// accumulates dV += P^T dO, dK += dS^T Q in registers. Each key belongs to
// one CTA: dK and dV are written once, no atomics. grid (ceil(Nk / 64), H,
// B).

template <typename T, typename TK, typename TV, int DH>
__device__ __forceinline__ void
msAttnBwdDkvTc(const T *q, const T *k, const T *v, const T *dout, TK *dk,
               TV *dv, const float *lse, const float *delta, long long B,
               long long Nq, long long Nk, long long H, float scale) {
  constexpr int QC = 32, P = MsAttRow<DH>::kPitch, DC = MsAttRow<DH>::kCols;
  __align__(16) __shared__ unsigned short qs[2 * QC * P];
  __align__(16) __shared__ unsigned short ds[2 * QC * P];
  __shared__ float ls[2 * QC], dls[2 * QC];
  const long long k0 = (long long)blockIdx.x * 64, h = blockIdx.y,
                  b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, c = lane % 4;
  const int row0 = warp * 16;

  // K through the Q buffers, V through the dO buffers (64 rows each).
  msAttLoadRows<64, DH>(qs, k, b, k0, Nk, H, h);
  msAttLoadRows<64, DH>(ds, v, b, k0, Nk, H, h);
  msCpAsyncCommit();
  msCpAsyncWait<0>();
  __syncthreads();
  unsigned kf[DC / 16][4], vf[DC / 16][4];
#pragma unroll
  for (int kk = 0; kk < DC / 16; ++kk) {
    msAttLoadA(kf[kk], qs, P, row0, kk * 16);
    msAttLoadA(vf[kk], ds, P, row0, kk * 16);
  }
  __syncthreads();

  // A chunk: queries, dO, and lse (+inf past Nq: P = 0) and delta of its
  // 32 rows, lse and delta by 4-byte cp.async in the rows' commit group,
  // not loads the CTA would wait for; the tail's +inf and 0 are seen after
  // the same barrier. Thread r < QC copies row r's lse.
  auto stage = [&](long long j, int buf) {
    msAttLoadRows<QC, DH>(qs + buf * QC * P, q, b, j * QC, Nq, H, h);
    msAttLoadRows<QC, DH>(ds + buf * QC * P, dout, b, j * QC, Nq, H, h);
    static_assert(2 * QC <= MS_ATT_TC_THREADS, "one row a thread");
    if (threadIdx.x < 2 * QC) {
      const bool isLse = threadIdx.x < QC;
      const int r = threadIdx.x % QC;
      const long long n = j * QC + r;
      float *dst = (isLse ? ls : dls) + buf * QC + r;
      if (n < Nq)
        msCpAsync4(dst, (isLse ? lse : delta) + (b * H + h) * Nq + n);
      else
        *dst = isLse ? -msNegInf() : 0.0f;
    }
  };

  const float scaleLog2 = scale * MS_ATT_LOG2E;
  float dka[DC / 8][4], dva[DC / 8][4];
  msAttZero<DC / 8>(dka);
  msAttZero<DC / 8>(dva);
  const long long chunks = (Nq + QC - 1) / QC;
  stage(0, 0);
  msCpAsyncCommit();
  for (long long j = 0; j < chunks; ++j) {
    const int buf = j % 2;
    if (j + 1 < chunks) {
      stage(j + 1, (j + 1) % 2);
      msCpAsyncCommit();
      msCpAsyncWait<1>();
    } else {
      msCpAsyncWait<0>();
    }
    // The thread that copied a row's lse sees it now: to log2 units
    // before the barrier shows it to the others.
    if (threadIdx.x < QC)
      ls[buf * QC + threadIdx.x] *= MS_ATT_LOG2E;
    __syncthreads();
    const unsigned short *qc = qs + buf * QC * P, *dc = ds + buf * QC * P;
    const float *lc = ls + buf * QC, *dlc = dls + buf * QC;
    // 16 queries at a time: S^T and dP^T are 16 keys x 16 queries.
#pragma unroll
    for (int half = 0; half < QC / 16; ++half) {
      float s[2][4], dp[2][4];
      msAttZero<2>(s);
      msAttZero<2>(dp);
      msAttRowsTimesT<T, DC, 2>(s, kf, qc, half * 16);
      msAttRowsTimesT<T, DC, 2>(dp, vf, dc, half * 16);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          int col = half * 16 + i * 8 + 2 * c + (e & 1);
          float p = msExp2(s[i][e] * scaleLog2 - lc[col]);
          s[i][e] = p;
          dp[i][e] = p * (dp[i][e] - dlc[col]); // dS^T
        }
      msAttTimesRows<T, DC, 1>(dva, s, dc, half * 16);
      msAttTimesRows<T, DC, 1>(dka, dp, qc, half * 16);
    }
    __syncthreads(); // the buffer is refilled two chunks later
  }
  float mulK[2] = {scale, scale}, mulV[2] = {1.0f, 1.0f};
  msAttStoreRows<DH>(dk, dka, mulK, b, k0 + row0, Nk, H, h);
  msAttStoreRows<DH>(dv, dva, mulV, b, k0 + row0, Nk, H, h);
}
