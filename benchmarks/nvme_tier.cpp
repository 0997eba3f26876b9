//===- nvme_tier.cpp - The NVMe tier against the drive's raw throughput ---===//
//
// What the host optimizer gets from the NVMe tier (runtime/host/NvmeTier.h)
// against what the drive gives anything: the same bytes read, written, and
// read-modified-written (the optimizer's visit: each chunk read, changed,
// written back) through the tier, and as raw O_DIRECT requests of the
// tier's chunk size through io_uring, as many in flight as the tier reads
// ahead (tierReadAheadBytes of its window), with no window, cache or
// bookkeeping. Rounds alternate raw and
// tier so that both see the same machine; each figure is the median over
// the rounds, and the ratio tier / raw is per round, then the median.
//
// Usage: megaslide-tier-bench DIR[,DIR...] [--mib M] [--window W]
//                             [--rounds R]
//   DIR       where the files go (one per drive), on the drive to measure
//   --mib     MiB moved per measurement (default 2048)
//   --window  the tier's RAM window in MiB (default 256); keep it well
//             below --mib, or reads come from the window, not the drive
//   --rounds  (default 5)
// Prints one line per measurement and a JSON object at the end.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/host/NvmeTier.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/Error.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <liburing.h>
#include <string>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

using namespace megaslide::host;

namespace {

constexpr uint64_t kChunk = uint64_t(kTierChunkElements) * 4;

[[noreturn]] void die(const std::string &message) {
  std::fprintf(stderr, "megaslide-tier-bench: %s\n", message.c_str());
  std::exit(1);
}

void check(llvm::Error e) {
  if (e)
    die(llvm::toString(std::move(e)));
}

double now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// Raw O_DIRECT requests of kChunk bytes over files (one per dir, chunks
/// round-robin as the tier stripes them), `slots` in flight in all.
/// mode 0 reads, 1 writes, 2 reads then writes each chunk.
double raw(const std::vector<std::string> &dirs, uint64_t bytes, size_t slots,
           int mode) {
  struct File {
    int fd;
    io_uring ring;
    unsigned inFlight = 0;
  };
  std::vector<File> files(dirs.size());
  void *mem = mmap(nullptr, slots * kChunk, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED)
    die("mmap");
  std::memset(mem, 1, slots * kChunk);
  uint64_t chunks = bytes / kChunk;
  uint64_t perFile = (chunks + dirs.size() - 1) / dirs.size() * kChunk;
  for (size_t i = 0; i < dirs.size(); ++i) {
    files[i].fd =
        open(dirs[i].c_str(), O_RDWR | O_DIRECT | O_TMPFILE | O_CLOEXEC, 0600);
    if (files[i].fd < 0 || posix_fallocate(files[i].fd, 0, off_t(perFile)))
      die("cannot create a file in " + dirs[i]);
    if (io_uring_queue_init(unsigned(slots), &files[i].ring, 0) < 0)
      die("io_uring_queue_init");
  }
  // Writes the data first so reads are of written blocks, as the tier's.
  auto pass = [&](bool write) {
    std::vector<uint64_t> next(dirs.size(), 0);
    uint64_t issued = 0, done = 0;
    std::vector<int> freeSlots;
    for (size_t s = 0; s < slots; ++s)
      freeSlots.push_back(int(s));
    while (done < chunks) {
      while (issued < chunks && !freeSlots.empty()) {
        size_t f = issued % dirs.size();
        int s = freeSlots.back();
        freeSlots.pop_back();
        io_uring_sqe *sqe = io_uring_get_sqe(&files[f].ring);
        char *buf = static_cast<char *>(mem) + size_t(s) * kChunk;
        if (write)
          io_uring_prep_write(sqe, files[f].fd, buf, kChunk, next[f]);
        else
          io_uring_prep_read(sqe, files[f].fd, buf, kChunk, next[f]);
        io_uring_sqe_set_data64(sqe, uint64_t(s));
        next[f] += kChunk;
        ++files[f].inFlight;
        ++issued;
        io_uring_submit(&files[f].ring);
      }
      auto handle = [&](File &file, io_uring_cqe *cqe) {
        if (cqe->res != int(kChunk))
          die("short or failed raw I/O");
        freeSlots.push_back(int(io_uring_cqe_get_data64(cqe)));
        io_uring_cqe_seen(&file.ring, cqe);
        --file.inFlight;
        ++done;
      };
      bool got = false;
      for (File &file : files) {
        io_uring_cqe *cqe;
        while (file.inFlight && io_uring_peek_cqe(&file.ring, &cqe) == 0) {
          handle(file, cqe);
          got = true;
        }
      }
      for (File &file : files)
        if (!got && file.inFlight) {
          io_uring_cqe *cqe;
          if (io_uring_wait_cqe(&file.ring, &cqe) != 0)
            die("io_uring_wait_cqe");
          handle(file, cqe);
          got = true;
        }
    }
  };
  pass(true);
  double start = now();
  if (mode == 0)
    pass(false);
  else if (mode == 1)
    pass(true);
  else {
    pass(false); // the visit's reads, then its writes: the same bytes
    pass(true);
  }
  double seconds = now() - start;
  for (File &file : files) {
    io_uring_queue_exit(&file.ring);
    close(file.fd);
  }
  munmap(mem, slots * kChunk);
  return double(bytes) * (mode == 2 ? 2 : 1) / seconds / 1e9;
}

/// The same through the tier: one tensor of `bytes`, the optimizer's
/// visit order, a window of `window` bytes.
double tier(const std::vector<std::string> &dirs, uint64_t bytes,
            uint64_t window, int mode) {
  NvmeTier::Options options;
  options.dirs = dirs;
  options.windowBytes = window;
  int64_t elements = int64_t(bytes / 4);
  auto created = NvmeTier::create(options, {{"x", elements, 4}});
  if (!created)
    die(llvm::toString(created.takeError()));
  NvmeTier &t = **created;
  std::vector<std::pair<NvmeTier::TensorId, int64_t>> order;
  for (int64_t c = 0; c < t.chunks(0); ++c)
    order.push_back({0, c});
  t.setVisitOrder(order);
  auto visit = [&](bool dirty) {
    for (auto [id, c] : order) {
      auto buf = t.acquire(id, c);
      if (!buf)
        die(llvm::toString(buf.takeError()));
      if (dirty)
        (*buf)[0] ^= 1;
      check(t.release(id, c, dirty));
    }
  };
  std::vector<float> source(kTierChunkElements, 1.0f);
  auto writeAll = [&] {
    for (int64_t c = 0; c < t.chunks(0); ++c)
      check(t.write(0, c * kTierChunkElements, (c + 1) * kTierChunkElements,
                    source.data()));
    check(t.drain());
  };
  writeAll();
  double start = now();
  if (mode == 0)
    visit(false);
  else if (mode == 1)
    writeAll();
  else {
    visit(true);
    check(t.drain());
  }
  double seconds = now() - start;
  return double(bytes) * (mode == 2 ? 2 : 1) / seconds / 1e9;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

} // namespace

constexpr const char *kUsage =
    "usage: megaslide-tier-bench DIR[,DIR...] [--mib M] [--window W] "
    "[--rounds R]\n"
    "  DIR       where the files go (one per drive), on the drive to measure\n"
    "  --mib     MiB moved per measurement (default 2048)\n"
    "  --window  the tier's RAM window in MiB (default 256), at most half of "
    "--mib\n"
    "  --rounds  rounds of raw and tier, alternating (default 5)\n";

int main(int argc, char **argv) {
  if (argc >= 2 && std::string(argv[1]) == "--help") {
    std::printf("%s", kUsage);
    return 0;
  }
  if (argc < 2)
    die(kUsage);
  std::vector<std::string> dirs;
  for (llvm::StringRef d : llvm::split(argv[1], ','))
    dirs.push_back(d.str());
  uint64_t mib = 2048, windowMib = 256;
  int rounds = 5;
  for (int i = 2; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--mib")
      mib = std::strtoull(argv[i + 1], nullptr, 10);
    else if (std::string(argv[i]) == "--window")
      windowMib = std::strtoull(argv[i + 1], nullptr, 10);
    else if (std::string(argv[i]) == "--rounds")
      rounds = std::atoi(argv[i + 1]);
    else
      die(std::string("unknown option ") + argv[i]);
  }
  uint64_t bytes = mib << 20;
  bytes = bytes / kChunk * kChunk;
  const char *names[] = {"read", "write", "read-modify-write"};
  if (windowMib * 2 > mib)
    die("--window must be at most half of --mib");
  std::string json = "{\"mib\": " + std::to_string(mib) +
                     ", \"window_mib\": " + std::to_string(windowMib) +
                     ", \"drives\": " + std::to_string(dirs.size()) +
                     ", \"rounds\": " + std::to_string(rounds);
  for (int mode = 0; mode < 3; ++mode) {
    std::vector<double> r, t, ratio;
    for (int k = 0; k < rounds; ++k) {
      r.push_back(
          raw(dirs, bytes, tierReadAheadBytes(windowMib << 20) / kChunk, mode));
      t.push_back(tier(dirs, bytes, windowMib << 20, mode));
      ratio.push_back(t.back() / r.back());
    }
    std::printf("%-18s raw O_DIRECT %6.2f GB/s  tier %6.2f GB/s  tier/raw "
                "%5.1f%% (medians of %d rounds)\n",
                names[mode], median(r), median(t), 100 * median(ratio), rounds);
    json += ", \"" + std::string(names[mode]) +
            "\": {\"raw_gbs\": " + std::to_string(median(r)) +
            ", \"tier_gbs\": " + std::to_string(median(t)) +
            ", \"ratio\": " + std::to_string(median(ratio)) + "}";
  }
  std::printf("%s}\n", json.c_str());
  return 0;
}
