//===- membw.cpp - STREAM-style host memory bandwidth ---------------------===//
//
// The memory-bandwidth bound of the host optimizer: STREAM's copy and triad
// plus the access pattern of an AdamW step (three fp32 arrays read and
// written in place, one more read), run with the thread count and the
// chunking and the worker threads of runtime/cpu/AdamW.cpp (each worker
// owns one contiguous chunk, first touched by that worker). Bytes are counted
// as the program reads and writes them (STREAM's convention: no write-allocate
// traffic), so a kernel's "bytes per element / bandwidth" is directly its time
// bound. The arrays ask for transparent huge pages (madvise), as numpy does for
// large arrays: with 4 KiB pages the probe would pay TLB misses the benchmarked
// kernels, running on numpy arrays, do not.
//
// Usage: megaslide-membw [--threads N] [--mib M] [--repeat R] [--json]
//   --threads  default MEGASLIDE_NUM_THREADS, else all cores
//   --mib      size of each array in MiB (default 256; keep it far above
//              the last-level cache)
//   --repeat   timed repetitions per kernel after one warm-up (default 10)
// Prints, per kernel, the best and the median bandwidth in GB/s (1e9 B/s).
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cpu/AdamW.h"
#include "megaslide/runtime/cpu/ParallelFor.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

using megaslide::cpu::kAdamWChunkAlign;
using megaslide::cpu::parallelChunks;

namespace {

struct FreeDeleter {
  void operator()(float *p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float[], FreeDeleter>;

Buffer allocate(int64_t n) {
  constexpr size_t kHugePage = size_t(2) << 20;
  size_t bytes = (static_cast<size_t>(n) * sizeof(float) + kHugePage - 1) /
                 kHugePage * kHugePage;
  void *p = std::aligned_alloc(kHugePage, bytes);
  if (!p) {
    std::fprintf(stderr, "megaslide-membw: out of memory\n");
    std::exit(1);
  }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(p, bytes, MADV_HUGEPAGE); // a hint: fine if THP is off
#endif
  return Buffer(static_cast<float *>(p));
}

struct Kernel {
  const char *name;
  const char *what;
  double bytesPerElement;
  std::function<void(int64_t, int64_t)> body;
};

double seconds(const std::function<void()> &f) {
  auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

} // namespace

int main(int argc, char **argv) {
  int threads = megaslide::cpu::cpuThreads();
  int64_t mib = 256;
  int repeat = 10;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> long {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "megaslide-membw: %s needs a value\n",
                     arg.c_str());
        std::exit(2);
      }
      char *end = nullptr;
      long v = std::strtol(argv[++i], &end, 10);
      if (*end != '\0' || v <= 0) {
        std::fprintf(stderr,
                     "megaslide-membw: %s wants a positive integer, "
                     "got '%s'\n",
                     arg.c_str(), argv[i]);
        std::exit(2);
      }
      return v;
    };
    if (arg == "--threads")
      threads = static_cast<int>(value());
    else if (arg == "--mib")
      mib = value();
    else if (arg == "--repeat")
      repeat = static_cast<int>(value());
    else if (arg == "--json")
      json = true;
    else {
      std::fprintf(stderr, "usage: megaslide-membw [--threads N] [--mib M] "
                           "[--repeat R] [--json]\n");
      return arg == "--help" || arg == "-h" ? 0 : 2;
    }
  }

  const int64_t n = mib * (1 << 20) / static_cast<int64_t>(sizeof(float));
  Buffer a = allocate(n), b = allocate(n), c = allocate(n), d = allocate(n);
  float *pa = a.get(), *pb = b.get(), *pc = c.get(), *pd = d.get();
  // First touch by the thread that later streams the chunk.
  parallelChunks(n, threads, kAdamWChunkAlign, [=](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      pa[i] = 1.0f;
      pb[i] = 2.0f;
      pc[i] = 0.5f;
      pd[i] = 1e-3f;
    }
  });

  const float s = 0.999f;
  std::vector<Kernel> kernels = {
      {"copy", "a = b (1 read, 1 write)", 8,
       [=](int64_t begin, int64_t end) {
         std::memcpy(pa + begin, pb + begin,
                     static_cast<size_t>(end - begin) * sizeof(float));
       }},
      {"triad", "a = b + s c (2 reads, 1 write)", 12,
       [=](int64_t begin, int64_t end) {
         for (int64_t i = begin; i < end; ++i)
           pa[i] = pb[i] + s * pc[i];
       }},
      // The AdamW step's traffic with fp32 gradients: master, m and v read
      // and written in place, the gradient read.
      {"update3+1", "a, b, c updated in place from d (4 reads, 3 writes)", 28,
       [=](int64_t begin, int64_t end) {
         for (int64_t i = begin; i < end; ++i) {
           float g = pd[i];
           pa[i] = s * pa[i] + g;
           pb[i] = s * pb[i] - g;
           pc[i] = pc[i] - s * g;
         }
       }},
  };

  if (!json)
    std::printf("threads %d, %lld MiB per array, best and median of %d\n",
                threads, static_cast<long long>(mib), repeat);
  else
    std::printf("{\"threads\": %d, \"mib\": %lld, \"repeat\": %d, "
                "\"kernels\": [",
                threads, static_cast<long long>(mib), repeat);
  for (size_t k = 0; k < kernels.size(); ++k) {
    const Kernel &kernel = kernels[k];
    auto once = [&] {
      parallelChunks(n, threads, kAdamWChunkAlign, kernel.body);
    };
    once(); // warm-up
    std::vector<double> times;
    for (int r = 0; r < repeat; ++r)
      times.push_back(seconds(once));
    std::sort(times.begin(), times.end());
    double bytes = kernel.bytesPerElement * static_cast<double>(n);
    double best = bytes / times.front() / 1e9;
    double median = bytes / times[times.size() / 2] / 1e9;
    if (json)
      std::printf("%s{\"name\": \"%s\", \"what\": \"%s\", "
                  "\"bytes_per_element\": %g, \"best_gbs\": %.3f, "
                  "\"median_gbs\": %.3f}",
                  k ? ", " : "", kernel.name, kernel.what,
                  kernel.bytesPerElement, best, median);
    else
      std::printf("%-10s %6.2f GB/s best  %6.2f GB/s median   %s\n",
                  kernel.name, best, median, kernel.what);
  }
  // Keep the arrays observable so no kernel is optimised away.
  double check = static_cast<double>(pa[n / 3]) + pb[n / 2] + pc[n - 1];
  if (json)
    std::printf("], \"checksum\": %.6g}\n", check);
  else
    std::printf("checksum %.6g\n", check);
  return 0;
}
