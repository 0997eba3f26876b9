//===- Convert.cpp - A plan's element types to and from fp32 --------------===//

#include "megaslide/runtime/cpu/Convert.h"

#include "megaslide/runtime/cpu/HalfFloat.h"
#include "megaslide/runtime/cpu/WorkerPool.h"

#include <algorithm>
#include <cstring>
#include <thread>

using namespace megaslide::cpu;
using megaslide::exec::DType;

void megaslide::cpu::widen(const void *src, DType dtype, int64_t n,
                           float *dst) {
  switch (dtype) {
  case DType::BF16: {
    const uint16_t *bits = static_cast<const uint16_t *>(src);
    for (int64_t i = 0; i < n; ++i)
      dst[i] = bf16ToFloat(bits[i]);
    return;
  }
  case DType::F16: {
    const uint16_t *bits = static_cast<const uint16_t *>(src);
    for (int64_t i = 0; i < n; ++i)
      dst[i] = halfToFloat(bits[i]);
    return;
  }
  case DType::F32:
    std::memcpy(dst, src, n * sizeof(float));
    return;
  case DType::I32: {
    const int32_t *v = static_cast<const int32_t *>(src);
    for (int64_t i = 0; i < n; ++i)
      dst[i] = static_cast<float>(v[i]);
    return;
  }
  case DType::I64: {
    const int64_t *v = static_cast<const int64_t *>(src);
    for (int64_t i = 0; i < n; ++i)
      dst[i] = static_cast<float>(v[i]);
    return;
  }
  }
}

void megaslide::cpu::narrow(const float *src, DType dtype, int64_t n,
                            void *dst) {
  switch (dtype) {
  case DType::BF16: {
    uint16_t *bits = static_cast<uint16_t *>(dst);
    for (int64_t i = 0; i < n; ++i)
      bits[i] = floatToBf16(src[i]);
    return;
  }
  case DType::F16: {
    uint16_t *bits = static_cast<uint16_t *>(dst);
    for (int64_t i = 0; i < n; ++i)
      bits[i] = floatToHalf(src[i]);
    return;
  }
  case DType::F32:
    std::memcpy(dst, src, n * sizeof(float));
    return;
  case DType::I32: {
    int32_t *v = static_cast<int32_t *>(dst);
    for (int64_t i = 0; i < n; ++i)
      v[i] = static_cast<int32_t>(src[i]);
    return;
  }
  case DType::I64: {
    int64_t *v = static_cast<int64_t *>(dst);
    for (int64_t i = 0; i < n; ++i)
      v[i] = static_cast<int64_t>(src[i]);
    return;
  }
  }
}

void megaslide::cpu::narrowOnWorkers(WorkerPool &pool, const float *src,
                                     DType dtype, int64_t n, void *dst) {
  int64_t parts = std::min<int64_t>(
      {8, std::max<unsigned>(1, std::thread::hardware_concurrency()),
       std::max<int64_t>(1, n >> 20)});
  int64_t chunk = (n + parts - 1) / parts,
          bytes = megaslide::exec::dtypeBytes(dtype);
  pool.run((n + chunk - 1) / chunk, [&](int64_t w) {
    int64_t begin = w * chunk, end = std::min(n, begin + chunk);
    narrow(src + begin, dtype, end - begin,
           static_cast<uint8_t *>(dst) + begin * bytes);
  });
}

/// Calls fn(offset, values, count) over `src` widened to fp32 in blocks on
/// the stack: what widening the whole tensor gives, without its copy.
template <typename Fn>
static void forEachWidenedBlock(const void *src, DType dtype, int64_t n,
                                Fn fn) {
  constexpr int64_t kBlock = 1024;
  float block[kBlock];
  size_t bytes = megaslide::exec::dtypeBytes(dtype);
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    int64_t count = std::min(kBlock, n - begin);
    widen(static_cast<const uint8_t *>(src) + begin * bytes, dtype, count,
          block);
    fn(begin, block, count);
  }
}

void megaslide::cpu::accumulate(const void *src, DType dtype, int64_t n,
                                float *acc) {
  forEachWidenedBlock(src, dtype, n,
                      [&](int64_t begin, const float *block, int64_t count) {
                        for (int64_t i = 0; i < count; ++i)
                          acc[begin + i] += block[i];
                      });
}

double megaslide::cpu::squaredNorm(const void *src, DType dtype, int64_t n) {
  double sum = 0;
  forEachWidenedBlock(src, dtype, n,
                      [&](int64_t, const float *block, int64_t count) {
                        for (int64_t i = 0; i < count; ++i)
                          sum += double(block[i]) * double(block[i]);
                      });
  return sum;
}
