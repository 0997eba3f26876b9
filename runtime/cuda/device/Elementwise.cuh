//===- Elementwise.cuh - Device code of the dense kernels ------*- CUDA -*-===//
//
// The prelude of the dense graph-op kernels that ElementwiseKernels.cpp
// emits: element types, 16-bit conversions (round to nearest even,
// bit-identical to include/megaslide/runtime/cpu/AdamW.h's floatToBf16),
// loads and stores widening to fp32, deterministic warp and block sums, and
// the pieces forward and backward kernels share (norm statistics, GELU,
// attention scores). The kernels' bodies, one per kind, are the table of
// ElementwiseKernelsSource.inc. Header-free CUDA C++ for NVRTC; the host
// emulation of the tests defines MS_HOST_EMULATION and supplies the
// inline-PTX conversions.
//
//===----------------------------------------------------------------------===//

struct ms_bf16 {
  unsigned short bits;
};
struct ms_f16 {
  unsigned short bits;
};

#ifdef MS_HOST_EMULATION
inline unsigned __umulhi(unsigned a, unsigned b) {
  return (unsigned)(((unsigned long long)a * b) >> 32);
}
inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
inline void sincospif(float x, float *s, float *c) {
  *s = (float)std::sin(3.141592653589793 * x);
  *c = (float)std::cos(3.141592653589793 * x);
}
#else
__device__ __forceinline__ float msHalfToFloat(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short msFloatToHalf(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
#endif

__device__ __forceinline__ unsigned short msFloatToBf16(float f) {
  unsigned u = __float_as_uint(f);
  unsigned rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (unsigned short)(f != f ? ((u >> 16) | 0x40u) : rounded);
}

__device__ __forceinline__ float msLoad(const float *p, long long i) {
  return p[i];
}
__device__ __forceinline__ float msLoad(const ms_bf16 *p, long long i) {
  return __uint_as_float(((unsigned)p[i].bits) << 16);
}
__device__ __forceinline__ float msLoad(const ms_f16 *p, long long i) {
  return msHalfToFloat(p[i].bits);
}
__device__ __forceinline__ void msStore(float *p, long long i, float v) {
  p[i] = v;
}
__device__ __forceinline__ void msStore(ms_bf16 *p, long long i, float v) {
  p[i].bits = msFloatToBf16(v);
}
__device__ __forceinline__ void msStore(ms_f16 *p, long long i, float v) {
  p[i].bits = msFloatToHalf(v);
}
__device__ __forceinline__ long long msLoadIndex(const int *p, long long i) {
  return p[i];
}
__device__ __forceinline__ long long msLoadIndex(const long long *p,
                                                 long long i) {
  return p[i];
}

__device__ __forceinline__ float msNegInf() {
  return __uint_as_float(0xff800000u);
}

// Grid-stride indices are 32-bit: the lowering refuses launches over
// 2^31 - 1 elements, so i + msThreads() cannot wrap, and 64-bit division
// (a ~70-instruction subroutine in PTX) stays out of the per-element path.
__device__ __forceinline__ unsigned msThread() {
  return blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ unsigned msThreads() {
  return gridDim.x * blockDim.x;
}

/// A divisor d in [1, 2^31) with its Granlund-Montgomery multiplier,
/// computed on the host (GraphOpLowering.cpp's fastDivisor): n / d is then
/// (umulhi(n, magic) + n) >> ceil(log2 d) for n < 2^31.
struct msDivisor {
  unsigned magic, d;
};
__device__ __forceinline__ unsigned msDiv(unsigned n, msDivisor v) {
  unsigned shift = 32 - __clz(v.d - 1);
  return (__umulhi(n, v.magic) + n) >> shift;
}
__device__ __forceinline__ unsigned msMod(unsigned n, msDivisor v) {
  return n - msDiv(n, v) * v.d;
}

/// 16 bytes, for vector loads and stores.
struct __align__(16) msU4 {
  unsigned x, y, z, w;
};
/// True when every pointer is 16-byte aligned (null counts as aligned):
/// arena and scratch offsets are 256-byte aligned, so this fails only for
/// element offsets the shapes already rule out.
template <typename... P>
__device__ __forceinline__ bool msAligned(const P *...p) {
  unsigned long long bits = (0ull | ... | (unsigned long long)p);
  return (bits & 15) == 0;
}

/// V = 1 or 8 consecutive elements from index i (a multiple of 8 for V =
/// 8) widened to fp32; for V = 8 as 16-byte loads.
template <int V>
__device__ __forceinline__ void msLoadN(const float *p, unsigned i, float *v) {
  if constexpr (V == 1) {
    v[0] = p[i];
  } else {
#pragma unroll
    for (int k = 0; k < V; k += 4) {
      msU4 u = *reinterpret_cast<const msU4 *>(p + i + k);
      v[k] = __uint_as_float(u.x);
      v[k + 1] = __uint_as_float(u.y);
      v[k + 2] = __uint_as_float(u.z);
      v[k + 3] = __uint_as_float(u.w);
    }
  }
}
__device__ __forceinline__ void msUnpack16(unsigned w, const ms_bf16 *,
                                           float *v) {
  v[0] = __uint_as_float(w << 16);
  v[1] = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void msUnpack16(unsigned w, const ms_f16 *,
                                           float *v) {
  v[0] = msHalfToFloat((unsigned short)(w & 0xffffu));
  v[1] = msHalfToFloat((unsigned short)(w >> 16));
}
template <int V, typename T>
__device__ __forceinline__ void msLoadN(const T *p, unsigned i, float *v) {
  if constexpr (V == 1) {
    v[0] = msLoad(p, i);
  } else {
#pragma unroll
    for (int k = 0; k < V; k += 8) {
      msU4 u = *reinterpret_cast<const msU4 *>(p + i + k);
      msUnpack16(u.x, p, v + k);
      msUnpack16(u.y, p, v + k + 2);
      msUnpack16(u.z, p, v + k + 4);
      msUnpack16(u.w, p, v + k + 6);
    }
  }
}
template <int V>
__device__ __forceinline__ void msStoreN(float *p, unsigned i, const float *v) {
  if constexpr (V == 1) {
    p[i] = v[0];
  } else {
#pragma unroll
    for (int k = 0; k < V; k += 4)
      *reinterpret_cast<msU4 *>(p + i + k) =
          msU4{__float_as_uint(v[k]), __float_as_uint(v[k + 1]),
               __float_as_uint(v[k + 2]), __float_as_uint(v[k + 3])};
  }
}
__device__ __forceinline__ unsigned msPack16(const ms_bf16 *, float a,
                                             float b) {
  return msFloatToBf16(a) | ((unsigned)msFloatToBf16(b) << 16);
}
__device__ __forceinline__ unsigned msPack16(const ms_f16 *, float a, float b) {
  return msFloatToHalf(a) | ((unsigned)msFloatToHalf(b) << 16);
}
template <int V, typename T>
__device__ __forceinline__ void msStoreN(T *p, unsigned i, const float *v) {
  if constexpr (V == 1) {
    msStore(p, i, v[0]);
  } else {
#pragma unroll
    for (int k = 0; k < V; k += 8)
      *reinterpret_cast<msU4 *>(p + i + k) = msU4{
          msPack16(p, v[k], v[k + 1]), msPack16(p, v[k + 2], v[k + 3]),
          msPack16(p, v[k + 4], v[k + 5]), msPack16(p, v[k + 6], v[k + 7])};
  }
}

/// msLoadN or msStoreN for V = 8 or 1 given at run time: msEach's bodies
/// are inlined at both widths, so V is a constant wherever they run.
/// (NVRTC compiles no generic lambdas in device code without
/// --extended-lambda, so the width cannot be a template argument.)
template <typename T>
__device__ __forceinline__ void msLoadV(const T *p, unsigned i, float *v,
                                        int V) {
  if (V == 8)
    msLoadN<8>(p, i, v);
  else
    msLoadN<1>(p, i, v);
}
template <typename T>
__device__ __forceinline__ void msStoreV(T *p, unsigned i, const float *v,
                                         int V) {
  if (V == 8)
    msStoreN<8>(p, i, v);
  else
    msStoreN<1>(p, i, v);
}

/// Grid-stride over n elements: body(i, 8) on 8 elements at a time
/// (16-byte loads and stores) when `vec`, then body(i, 1) on what is
/// left. The body is written once for both widths.
template <typename Body>
__device__ __forceinline__ void msEach(unsigned n, bool vec, Body body) {
  unsigned done = 0;
  if (vec) {
    unsigned n8 = n >> 3;
    for (unsigned v = msThread(); v < n8; v += msThreads())
      body(v << 3, 8);
    done = n8 << 3;
  }
  for (unsigned i = done + msThread(); i < n; i += msThreads())
    body(i, 1);
}

/// Sum over the 32 lanes of a warp, the same value in every lane.
__device__ __forceinline__ float msWarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/// Sum over the block, the same value in every thread. Every thread must
/// call it; the leading barrier lets consecutive calls share `red`.
__device__ float msBlockSum(float v) {
  __shared__ float red[32];
  v = msWarpSum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0)
    red[threadIdx.x >> 5] = v;
  __syncthreads();
  float t =
      (threadIdx.x & 31) < (blockDim.x >> 5) ? red[threadIdx.x & 31] : 0.0f;
  return msWarpSum(t);
}

/// Mean and 1/sqrt(var + eps) of the D elements of x from `base`, two
/// passes in fp32 over the block; every thread gets both. The norms and
/// their gradients share it, so both see the same statistics.
template <typename T>
__device__ __forceinline__ void msRowMeanRstd(const T *x, long long base,
                                              long long D, float eps,
                                              float &mean, float &rstd) {
  float s = 0.0f;
  for (long long c = threadIdx.x; c < D; c += blockDim.x)
    s += msLoad(x, base + c);
  mean = msBlockSum(s) / (float)D;
  float q = 0.0f;
  for (long long c = threadIdx.x; c < D; c += blockDim.x) {
    float d = msLoad(x, base + c) - mean;
    q += d * d;
  }
  rstd = 1.0f / sqrtf(msBlockSum(q) / (float)D + eps);
}

/// 1/sqrt(mean(x^2) + eps) of the D elements of x from `base`, over the
/// block; every thread gets it.
template <typename T>
__device__ __forceinline__ float msRowRmsRstd(const T *x, long long base,
                                              long long D, float eps) {
  float q = 0.0f;
  for (long long c = threadIdx.x; c < D; c += blockDim.x) {
    float v = msLoad(x, base + c);
    q += v * v;
  }
  return 1.0f / sqrtf(msBlockSum(q) / (float)D + eps);
}

/// fp32 pieces of the tanh-approximated GELU (PyTorch approximate="tanh").
__device__ __forceinline__ float msGelu(float x) {
  const float k = 0.7978845608028654f, a = 0.044715f;
  return 0.5f * x * (1.0f + tanhf(k * (x + a * x * x * x)));
}
__device__ __forceinline__ float msGeluGrad(float x) {
  const float k = 0.7978845608028654f, a = 0.044715f;
  float t = tanhf(k * (x + a * x * x * x));
  return 0.5f * (1.0f + t) +
         0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * a * x * x);
}
/// The exact GELU (PyTorch's default) and its derivative Phi + x phi.
__device__ __forceinline__ float msGeluExact(float x) {
  return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
}
__device__ __forceinline__ float msGeluExactGrad(float x) {
  return 0.5f * (1.0f + erff(x * 0.70710678118654752f)) +
         x * 0.39894228040143268f * expf(-0.5f * x * x);
}
__device__ __forceinline__ float msSigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

#define MS_ATT_REGS 8

/// The warp's sum of r[j] * p[base + d] over the channels d = lane + 32 j
/// < Dh each lane holds: q.k of an attention score, the query in the
/// lanes' registers r. (Loops that need two such sums share one pass.)
template <typename T>
__device__ __forceinline__ float
msWarpDot(const float *r, const T *p, long long base, long long Dh, int lane) {
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < MS_ATT_REGS; ++j) {
    long long d = lane + 32 * j;
    if (d < Dh)
      s += r[j] * msLoad(p, base + d);
  }
  return msWarpSum(s);
}
