//===- NvmeTier.h - Host state in files on NVMe drives ----------*- C++ -*-===//
//
// The NVMe tier (docs/Runtime.md, "NVMe tier"): tensors of the host state
// that a plan moves out of RAM (ExecPlan::tierRoles) live in files on one
// or more drives and stream through a bounded RAM window as the host
// optimizer visits them. I/O is the kernel's asynchronous I/O: io_uring
// (liburing) with O_DIRECT on aligned buffers, chunks striped round-robin
// over the drives, reads ahead of the optimizer in the order it visits
// parameters and writes behind it.
//
// The tier is scratch, never a source of truth: a checkpoint is written
// from it and holds everything, and a run (or a resume) fills it from the
// initial state or a checkpoint. So a crash, whatever it interrupts, can
// never leave a checkpoint inconsistent with it.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_HOST_NVMETIER_H
#define MEGASLIDE_RUNTIME_HOST_NVMETIER_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace megaslide::host {

/// Elements per chunk, the unit of I/O and of the optimizer's visits: a
/// chunk of any tensor is a multiple of 4096 bytes (O_DIRECT's alignment)
/// for elements of 1, 2 or 4 bytes, and chunk k of every tensor of a
/// parameter covers the same elements.
inline constexpr int64_t kTierChunkElements = int64_t(1) << 20;
/// The RAM window's default size, and its smallest: a window holds
/// chunks in flight (read ahead, in use, written behind), each at most
/// 4 MiB; 1 GiB keeps 256 of them, enough to keep several drives' queues
/// full, and 64 MiB the 16 an update of several tensors needs.
inline constexpr uint64_t kDefaultTierWindowBytes = uint64_t(1) << 30;
inline constexpr uint64_t kMinTierWindowBytes = uint64_t(64) << 20;

/// Why `dir` cannot hold a tier, if it cannot: it is not a writable
/// directory, it is in RAM (tmpfs, ramfs), or its file system refuses
/// O_DIRECT. With `force`, only the first is an error (the tier then uses
/// buffered I/O where O_DIRECT is refused).
llvm::Error checkTierDirectory(llvm::StringRef dir, bool force);

/// Where a tier lives and how much RAM it streams through.
struct NvmeTierOptions {
  std::vector<std::string> dirs; ///< one per drive
  uint64_t windowBytes = kDefaultTierWindowBytes;
  bool force = false; ///< checkTierDirectory's
};

/// The reads the tier keeps in flight ahead of the optimizer: three
/// quarters of the window's slots (the rest is for the chunk in use and
/// the writes behind it).
inline constexpr uint64_t tierReadAheadBytes(uint64_t windowBytes) {
  return windowBytes / (uint64_t(kTierChunkElements) * 4) * 3 / 4 *
         (uint64_t(kTierChunkElements) * 4);
}

class NvmeTier {
public:
  using Options = NvmeTierOptions;
  /// A tensor the tier holds: its elements and their size in bytes.
  struct TensorSpec {
    std::string name;
    int64_t elements = 0;
    int64_t elementBytes = 4;
  };
  using TensorId = int64_t;

  /// Creates the tier's files (one per drive, locked for this process,
  /// replacing what a dead run left) with room for every tensor, allocated
  /// before any long work: a drive without room is an error naming it, the
  /// bytes needed and free. Every tensor reads as zeros until written.
  static llvm::Expected<std::unique_ptr<NvmeTier>>
  create(const Options &options, llvm::ArrayRef<TensorSpec> tensors);
  ~NvmeTier();
  NvmeTier(const NvmeTier &) = delete;
  NvmeTier &operator=(const NvmeTier &) = delete;

  /// The order the optimizer visits chunks, repeated every step: what it
  /// reads ahead of the current visit.
  void setVisitOrder(std::vector<std::pair<TensorId, int64_t>> order);

  /// Chunk `chunk` of `tensor` in RAM (its bytes, at most
  /// kTierChunkElements elements), read if it is not there yet; valid
  /// until release(). A chunk may be acquired by one caller at a time.
  llvm::Expected<uint8_t *> acquire(TensorId tensor, int64_t chunk);
  /// Gives the chunk back: `dirty` writes it behind (the caller changed
  /// it), else it stays cached until its room is needed.
  llvm::Error release(TensorId tensor, int64_t chunk, bool dirty);
  /// Waits for every write in flight and makes it durable (fdatasync).
  llvm::Error drain();

  /// Copies elements [begin, end) of `tensor` to `dst` or from `src`
  /// through the window (checkpoints, weights, initial values).
  llvm::Error read(TensorId tensor, int64_t begin, int64_t end, void *dst);
  llvm::Error write(TensorId tensor, int64_t begin, int64_t end,
                    const void *src);

  const TensorSpec &spec(TensorId tensor) const;
  int64_t chunks(TensorId tensor) const;
  /// Bytes of the files on the drives, and of the RAM window.
  uint64_t fileBytes() const;
  uint64_t windowBytes() const;
  /// Whether the files are opened with O_DIRECT (false only when forced
  /// onto a file system that refuses it).
  bool direct() const;

  /// Traffic since creation: bytes read from and written to the drives,
  /// and acquires whose chunk no read had started for (the read-ahead
  /// missed it).
  struct Stats {
    uint64_t readBytes = 0, writtenBytes = 0;
    uint64_t acquires = 0, misses = 0;
  };
  Stats stats() const;

  class Impl;

private:
  explicit NvmeTier(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl;
};

} // namespace megaslide::host

#endif // MEGASLIDE_RUNTIME_HOST_NVMETIER_H
