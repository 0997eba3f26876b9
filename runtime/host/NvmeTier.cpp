//===- NvmeTier.cpp - Host state in files on NVMe drives ------------------===//
//
// One unnamed file per drive (O_TMPFILE, or a name unlinked at once), so
// the tier's bytes go with the process however it ends and two runs never
// share one. A fixed pool of 4 MiB slots is the RAM window; a slot holds
// one chunk and is free, being read, resident (clean), in use, or being
// written. One io_uring per drive; the lock holder reaps completions.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/host/NvmeTier.h"

#include "megaslide/Support/Units.h"
#include "megaslide/runtime/support/FaultInjection.h"

#include "llvm/ADT/DenseMap.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <linux/magic.h>
#include <mutex>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#if MEGASLIDE_HAVE_LIBURING
#include <liburing.h>
#endif

using namespace megaslide;
using namespace megaslide::host;
using llvm::Error;

namespace {

constexpr uint64_t kAlign = 4096;
constexpr uint64_t kSlotBytes = kTierChunkElements * 4;

uint64_t alignUp(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

Error tierError(const llvm::Twine &message) {
  return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                 "NVMe tier: " + message);
}

Error errnoError(llvm::StringRef dir, const llvm::Twine &action, int err) {
  return tierError(llvm::Twine(dir) + ": " + action + ": " + strerror(err));
}

/// An unnamed file in `dir`, read and written directly when `direct`.
int openTierFile(llvm::StringRef dir, bool direct) {
  int flags = O_RDWR | O_CLOEXEC | (direct ? O_DIRECT : 0);
  int fd = ::open(dir.str().c_str(), flags | O_TMPFILE, 0600);
  if (fd >= 0 || (errno != EOPNOTSUPP && errno != EISDIR))
    return fd;
  // A file system without O_TMPFILE: a unique name, unlinked at once.
  std::string path = (dir + "/.megaslide-tier-XXXXXX").str();
  fd = ::mkostemp(path.data(), O_CLOEXEC);
  if (fd < 0)
    return fd;
  ::unlink(path.c_str());
  if (direct && ::fcntl(fd, F_SETFL, O_DIRECT) != 0) {
    int err = errno;
    ::close(fd);
    errno = err;
    return -1;
  }
  return fd;
}

} // namespace

Error host::checkTierDirectory(llvm::StringRef dir, bool force) {
  struct stat st;
  if (::stat(dir.str().c_str(), &st) != 0)
    return errnoError(dir, "cannot use it as an NVMe tier", errno);
  if (!S_ISDIR(st.st_mode))
    return tierError(dir + ": not a directory");
  if (::access(dir.str().c_str(), W_OK) != 0)
    return errnoError(dir, "cannot write there", errno);
  if (force)
    return Error::success();
  struct statfs fs;
  if (::statfs(dir.str().c_str(), &fs) == 0 &&
      (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC))
    return tierError(dir + " is in RAM (tmpfs): a tier there takes the "
                           "memory it is meant to spare; give a directory "
                           "on an NVMe drive (or --nvme-force to use it "
                           "anyway, e.g. in a test)");
  int fd = openTierFile(dir, /*direct=*/true);
  if (fd < 0) {
    if (errno == EINVAL)
      return tierError(dir + ": its file system refuses O_DIRECT, so every "
                             "read and write would pass through the page "
                             "cache in RAM; give a directory on an NVMe "
                             "drive (or --nvme-force to use it anyway)");
    return errnoError(dir, "cannot create a file there", errno);
  }
  ::close(fd);
  return Error::success();
}

#if !MEGASLIDE_HAVE_LIBURING

class NvmeTier::Impl {};
NvmeTier::NvmeTier(std::unique_ptr<Impl> impl) : impl(std::move(impl)) {}
NvmeTier::~NvmeTier() = default;
llvm::Expected<std::unique_ptr<NvmeTier>>
NvmeTier::create(const Options &, llvm::ArrayRef<TensorSpec>) {
  return tierError("this build has no io_uring (liburing): install "
                   "liburing-dev (scripts/install-deps.sh) and rebuild");
}
void NvmeTier::setVisitOrder(std::vector<std::pair<TensorId, int64_t>>) {}
llvm::Expected<uint8_t *> NvmeTier::acquire(TensorId, int64_t) {
  return tierError("unavailable");
}
Error NvmeTier::release(TensorId, int64_t, bool) {
  return tierError("unavailable");
}
Error NvmeTier::drain() { return Error::success(); }
Error NvmeTier::read(TensorId, int64_t, int64_t, void *) {
  return tierError("unavailable");
}
Error NvmeTier::write(TensorId, int64_t, int64_t, const void *) {
  return tierError("unavailable");
}
const NvmeTier::TensorSpec &NvmeTier::spec(TensorId) const {
  static TensorSpec none;
  return none;
}
int64_t NvmeTier::chunks(TensorId) const { return 0; }
uint64_t NvmeTier::fileBytes() const { return 0; }
uint64_t NvmeTier::windowBytes() const { return 0; }
bool NvmeTier::direct() const { return false; }
NvmeTier::Stats NvmeTier::stats() const { return {}; }

#else

class NvmeTier::Impl {
public:
  enum class State { Free, Reading, Resident, InUse, Writing };
  struct Slot {
    State state = State::Free;
    TensorId tensor = -1;
    int64_t chunk = 0;
    uint64_t done = 0;       ///< bytes of the request transferred so far
    uint64_t lastUse = 0;    ///< for eviction, least recent first
    bool prefetched = false; ///< read ahead and not yet acquired
  };
  struct Tensor {
    TensorSpec spec;
    int64_t firstChunk = 0; ///< global chunk index: drive = index % drives
    std::vector<uint64_t> offsets; ///< each chunk's in its drive's file
  };
  struct Drive {
    std::string dir;
    int fd = -1;
    uint64_t bytes = 0;
    io_uring ring;
    bool ringReady = false;
    unsigned inFlight = 0;
  };

  std::mutex mutex;
  std::vector<Tensor> tensors;
  std::vector<Drive> drives;
  std::vector<Slot> slots;
  uint8_t *window = nullptr;
  size_t windowSize = 0;
  bool isDirect = true;
  llvm::DenseMap<uint64_t, int> resident; ///< chunk key -> slot
  std::vector<std::pair<TensorId, int64_t>> order;
  llvm::DenseMap<uint64_t, size_t> orderIndex;
  size_t cursor = 0;
  uint64_t tick = 0;
  Stats counters;
  std::string failure; ///< the first I/O error; every later call fails

  ~Impl() {
    if (Error e = waitAll())
      llvm::consumeError(std::move(e));
    for (Drive &d : drives) {
      if (d.ringReady)
        io_uring_queue_exit(&d.ring);
      if (d.fd >= 0)
        ::close(d.fd);
    }
    if (window)
      ::munmap(window, windowSize);
  }

  static uint64_t key(TensorId t, int64_t chunk) {
    return (uint64_t(t) << 40) | uint64_t(chunk);
  }
  uint8_t *buffer(int slot) { return window + uint64_t(slot) * kSlotBytes; }
  int64_t chunkElements(TensorId t, int64_t c) const {
    return std::min(kTierChunkElements,
                    tensors[t].spec.elements - c * kTierChunkElements);
  }
  uint64_t ioBytes(TensorId t, int64_t c) const {
    return alignUp(uint64_t(chunkElements(t, c)) *
                   uint64_t(tensors[t].spec.elementBytes));
  }
  Drive &driveOf(TensorId t, int64_t c) {
    return drives[(tensors[t].firstChunk + c) % drives.size()];
  }

  Error failed() const {
    return failure.empty() ? Error::success() : tierError(failure);
  }

  /// Submits what is left of slot `s`'s request.
  Error submit(int s) {
    Slot &slot = slots[s];
    Drive &d = driveOf(slot.tensor, slot.chunk);
    io_uring_sqe *sqe = io_uring_get_sqe(&d.ring);
    while (!sqe) { // the ring is full: make room
      if (Error e = waitOne(d))
        return e;
      sqe = io_uring_get_sqe(&d.ring);
    }
    uint64_t size = ioBytes(slot.tensor, slot.chunk);
    uint64_t offset = tensors[slot.tensor].offsets[slot.chunk] + slot.done;
    if (slot.state == State::Reading)
      io_uring_prep_read(sqe, d.fd, buffer(s) + slot.done, size - slot.done,
                         offset);
    else
      io_uring_prep_write(sqe, d.fd, buffer(s) + slot.done, size - slot.done,
                          offset);
    io_uring_sqe_set_data64(sqe, uint64_t(s));
    ++d.inFlight;
    int r = io_uring_submit(&d.ring);
    if (r < 0)
      return errnoError(d.dir, "io_uring_submit", -r);
    return Error::success();
  }

  /// Handles one completion of drive `d`.
  Error complete(Drive &d, io_uring_cqe *cqe) {
    int s = static_cast<int>(io_uring_cqe_get_data64(cqe));
    int res = cqe->res;
    io_uring_cqe_seen(&d.ring, cqe);
    --d.inFlight;
    Slot &slot = slots[s];
    bool reading = slot.state == State::Reading;
    std::string name = tensors[slot.tensor].spec.name;
    if (res <= 0) {
      int err = res < 0 ? -res : EIO;
      resident.erase(key(slot.tensor, slot.chunk));
      slot = Slot();
      failure =
          llvm::formatv("{0}: {1} of '{2}' failed: {3}", d.dir,
                        reading ? "reading" : "writing", name, strerror(err))
              .str();
      return tierError(failure);
    }
    slot.done += uint64_t(res);
    uint64_t size = ioBytes(slot.tensor, slot.chunk);
    if (slot.done < size) // a short transfer: the rest
      return submit(s);
    (reading ? counters.readBytes : counters.writtenBytes) += size;
    slot.state = State::Resident;
    return Error::success();
  }

  Error waitOne(Drive &d) {
    io_uring_cqe *cqe = nullptr;
    int r = io_uring_wait_cqe(&d.ring, &cqe);
    if (r < 0)
      return errnoError(d.dir, "io_uring_wait_cqe", -r);
    return complete(d, cqe);
  }

  /// Handles every completion already there, waiting for none.
  Error reap() {
    for (Drive &d : drives) {
      io_uring_cqe *cqe = nullptr;
      while (d.inFlight && io_uring_peek_cqe(&d.ring, &cqe) == 0)
        if (Error e = complete(d, cqe))
          return e;
    }
    return Error::success();
  }

  Error waitSlot(int s) {
    while (slots[s].state == State::Reading || slots[s].state == State::Writing)
      if (Error e = waitOne(driveOf(slots[s].tensor, slots[s].chunk)))
        return e;
    return Error::success();
  }

  Error waitAll() {
    for (Drive &d : drives)
      while (d.inFlight)
        if (Error e = waitOne(d))
          return e;
    return Error::success();
  }

  /// A slot to read into: a free one, else the least recently used clean
  /// one (one read ahead only on `demand`, which may also wait for a
  /// write); -1 when read-ahead finds none.
  llvm::Expected<int> takeSlot(bool demand) {
    while (true) {
      if (Error e = reap())
        return std::move(e);
      int best = -1;
      for (int s = 0; s < int(slots.size()); ++s) {
        Slot &slot = slots[s];
        if (slot.state == State::Free)
          return s;
        if (slot.state != State::Resident || (slot.prefetched && !demand))
          continue;
        if (best < 0 || slot.prefetched < slots[best].prefetched ||
            (slot.prefetched == slots[best].prefetched &&
             slot.lastUse < slots[best].lastUse))
          best = s;
      }
      if (best >= 0) {
        resident.erase(key(slots[best].tensor, slots[best].chunk));
        slots[best] = Slot();
        return best;
      }
      if (!demand)
        return -1;
      Drive *busy = nullptr;
      for (Drive &d : drives)
        if (d.inFlight)
          busy = &d;
      if (!busy)
        return tierError(
            llvm::formatv("the window of {0} holds no chunk that is not in use",
                          formatBytes(windowSize)));
      if (Error e = waitOne(*busy))
        return std::move(e);
    }
  }

  /// Starts reading chunk `c` of `t` into slot `s`, or zero-fills it when
  /// the caller overwrites all of it.
  Error startRead(int s, TensorId t, int64_t c, bool overwrite) {
    Slot &slot = slots[s];
    slot.tensor = t;
    slot.chunk = c;
    slot.done = 0;
    resident[key(t, c)] = s;
    if (overwrite) {
      std::memset(buffer(s), 0, ioBytes(t, c));
      slot.state = State::Resident;
      return Error::success();
    }
    slot.state = State::Reading;
    return submit(s);
  }

  /// Reads ahead along the visit order from the cursor while clean slots
  /// are free, keeping a quarter of the window for writes behind.
  Error readAhead() {
    if (order.empty())
      return Error::success();
    size_t limit = std::min<size_t>(
        order.size(), tierReadAheadBytes(windowSize) / kSlotBytes);
    for (size_t i = 0; i < limit; ++i) {
      auto [t, c] = order[(cursor + i) % order.size()];
      if (resident.count(key(t, c)))
        continue;
      llvm::Expected<int> s = takeSlot(/*demand=*/false);
      if (!s)
        return s.takeError();
      if (*s < 0)
        break;
      slots[*s].prefetched = true;
      if (Error e = startRead(*s, t, c, /*overwrite=*/false))
        return e;
    }
    return Error::success();
  }

  llvm::Expected<uint8_t *> acquire(TensorId t, int64_t c, bool visit,
                                    bool overwrite) {
    if (Error e = failed())
      return std::move(e);
    if (t < 0 || t >= TensorId(tensors.size()) || c < 0 ||
        c * kTierChunkElements >= tensors[t].spec.elements)
      return tierError(llvm::formatv("no chunk {0} of tensor #{1}", c, t));
    ++counters.acquires;
    auto it = resident.find(key(t, c));
    int s;
    if (it != resident.end()) {
      s = it->second;
      if (slots[s].state == State::InUse)
        return tierError("chunk " + llvm::Twine(c) + " of '" +
                         tensors[t].spec.name + "' is acquired twice");
      if (Error e = waitSlot(s))
        return std::move(e);
    } else {
      llvm::Expected<int> free = takeSlot(/*demand=*/true);
      if (!free)
        return free.takeError();
      s = *free;
      if (Error e = startRead(s, t, c, overwrite))
        return std::move(e);
      if (!overwrite)
        ++counters.misses;
      if (Error e = waitSlot(s))
        return std::move(e);
    }
    slots[s].state = State::InUse;
    slots[s].prefetched = false;
    if (visit) {
      auto pos = orderIndex.find(key(t, c));
      if (pos != orderIndex.end())
        cursor = (pos->second + 1) % order.size();
      if (Error e = readAhead())
        return std::move(e);
    }
    return buffer(s);
  }

  Error release(TensorId t, int64_t c, bool dirty) {
    auto it = resident.find(key(t, c));
    if (it == resident.end() || slots[it->second].state != State::InUse)
      return tierError("chunk " + llvm::Twine(c) + " of tensor #" +
                       llvm::Twine(t) + " is released but not acquired");
    Slot &slot = slots[it->second];
    slot.lastUse = ++tick;
    if (!dirty) {
      slot.state = State::Resident;
      return Error::success();
    }
    slot.state = State::Writing;
    slot.done = 0;
    return submit(it->second);
  }
};

NvmeTier::NvmeTier(std::unique_ptr<Impl> impl) : impl(std::move(impl)) {}
NvmeTier::~NvmeTier() = default;

llvm::Expected<std::unique_ptr<NvmeTier>>
NvmeTier::create(const Options &options, llvm::ArrayRef<TensorSpec> specs) {
  if (options.dirs.empty())
    return tierError("no directory given");
  if (options.windowBytes < kMinTierWindowBytes)
    return tierError(llvm::formatv("a window of {0} is smaller than the {1} "
                                   "the optimizer's visits need",
                                   formatBytes(options.windowBytes),
                                   formatBytes(kMinTierWindowBytes)));
  auto impl = std::make_unique<Impl>();
  // The layout: chunks round-robin over the drives, each 4 KiB-aligned.
  impl->drives.resize(options.dirs.size());
  int64_t global = 0;
  for (const TensorSpec &spec : specs) {
    if (spec.elements <= 0 ||
        (spec.elementBytes != 1 && spec.elementBytes != 2 &&
         spec.elementBytes != 4))
      return tierError(llvm::formatv("tensor '{0}' of {1} elements of {2} "
                                     "bytes cannot be held",
                                     spec.name, spec.elements,
                                     spec.elementBytes));
    Impl::Tensor t;
    t.spec = spec;
    t.firstChunk = global;
    int64_t n = (spec.elements + kTierChunkElements - 1) / kTierChunkElements;
    impl->tensors.push_back(std::move(t));
    Impl::Tensor &added = impl->tensors.back();
    for (int64_t c = 0; c < n; ++c, ++global) {
      Impl::Drive &d = impl->drives[global % impl->drives.size()];
      added.offsets.push_back(d.bytes);
      d.bytes += impl->ioBytes(TensorId(impl->tensors.size() - 1), c);
    }
  }
  std::optional<uint64_t> limit = fault::writeLimit();
  for (size_t i = 0; i < options.dirs.size(); ++i) {
    Impl::Drive &d = impl->drives[i];
    d.dir = options.dirs[i];
    if (Error e = checkTierDirectory(d.dir, options.force))
      return std::move(e);
    d.fd = openTierFile(d.dir, /*direct=*/true);
    if (d.fd < 0 && errno == EINVAL) { // forced onto a file system without
      impl->isDirect = false;
      d.fd = openTierFile(d.dir, /*direct=*/false);
    }
    if (d.fd < 0)
      return errnoError(d.dir, "cannot create the tier's file", errno);
    // Room for everything now, not a full disk in the middle of a run.
    struct statvfs vfs;
    uint64_t free = ::fstatvfs(d.fd, &vfs) == 0
                        ? uint64_t(vfs.f_bavail) * vfs.f_frsize
                        : UINT64_MAX;
    if (limit)
      free = std::min(free, *limit);
    int err = d.bytes > free ? ENOSPC : 0;
    if (!err && d.bytes)
      err = ::posix_fallocate(d.fd, 0, off_t(d.bytes));
    if (err == ENOSPC)
      return tierError(
          llvm::formatv("{0}: needs {1} for its share of the tier, {2} is free",
                        d.dir, formatBytes(d.bytes), formatBytes(free)));
    if (err)
      return errnoError(
          d.dir, "cannot allocate the tier's " + formatBytes(d.bytes), err);
    // Room for every slot's request: the window bounds what is in flight.
    unsigned entries = unsigned(std::min<uint64_t>(
        std::max<uint64_t>(options.windowBytes / kSlotBytes, 16), 4096));
    int r = io_uring_queue_init(entries, &d.ring, 0);
    if (r < 0)
      return errnoError(d.dir, "io_uring_queue_init", -r);
    d.ringReady = true;
  }
  size_t slots = std::max<size_t>(options.windowBytes / kSlotBytes, 16);
  impl->windowSize = slots * kSlotBytes;
  void *window = ::mmap(nullptr, impl->windowSize, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (window == MAP_FAILED)
    return errnoError("RAM window",
                      "cannot map " + formatBytes(impl->windowSize), errno);
  impl->window = static_cast<uint8_t *>(window);
  impl->slots.resize(slots);
  return std::unique_ptr<NvmeTier>(new NvmeTier(std::move(impl)));
}

void NvmeTier::setVisitOrder(std::vector<std::pair<TensorId, int64_t>> order) {
  std::lock_guard<std::mutex> lock(impl->mutex);
  impl->orderIndex.clear();
  for (size_t i = 0; i < order.size(); ++i)
    impl->orderIndex[Impl::key(order[i].first, order[i].second)] = i;
  impl->order = std::move(order);
  impl->cursor = 0;
}

llvm::Expected<uint8_t *> NvmeTier::acquire(TensorId tensor, int64_t chunk) {
  std::lock_guard<std::mutex> lock(impl->mutex);
  return impl->acquire(tensor, chunk, /*visit=*/true, /*overwrite=*/false);
}

Error NvmeTier::release(TensorId tensor, int64_t chunk, bool dirty) {
  std::lock_guard<std::mutex> lock(impl->mutex);
  return impl->release(tensor, chunk, dirty);
}

Error NvmeTier::drain() {
  std::lock_guard<std::mutex> lock(impl->mutex);
  if (Error e = impl->waitAll())
    return e;
  return impl->failed();
}

Error NvmeTier::read(TensorId tensor, int64_t begin, int64_t end, void *dst) {
  std::lock_guard<std::mutex> lock(impl->mutex);
  int64_t eb = impl->tensors.at(tensor).spec.elementBytes;
  for (int64_t i = begin; i < end;) {
    int64_t c = i / kTierChunkElements, from = i - c * kTierChunkElements;
    int64_t n = std::min(end - i, kTierChunkElements - from);
    llvm::Expected<uint8_t *> buf = impl->acquire(tensor, c, false, false);
    if (!buf)
      return buf.takeError();
    std::memcpy(static_cast<uint8_t *>(dst) + (i - begin) * eb,
                *buf + from * eb, size_t(n * eb));
    if (Error e = impl->release(tensor, c, /*dirty=*/false))
      return e;
    i += n;
  }
  return Error::success();
}

Error NvmeTier::write(TensorId tensor, int64_t begin, int64_t end,
                      const void *src) {
  std::lock_guard<std::mutex> lock(impl->mutex);
  int64_t eb = impl->tensors.at(tensor).spec.elementBytes;
  for (int64_t i = begin; i < end;) {
    int64_t c = i / kTierChunkElements, from = i - c * kTierChunkElements;
    int64_t n = std::min(end - i, kTierChunkElements - from);
    // A whole chunk is not read first.
    bool whole = from == 0 && n == impl->chunkElements(tensor, c);
    llvm::Expected<uint8_t *> buf = impl->acquire(tensor, c, false, whole);
    if (!buf)
      return buf.takeError();
    std::memcpy(*buf + from * eb,
                static_cast<const uint8_t *>(src) + (i - begin) * eb,
                size_t(n * eb));
    if (Error e = impl->release(tensor, c, /*dirty=*/true))
      return e;
    i += n;
  }
  return Error::success();
}

const NvmeTier::TensorSpec &NvmeTier::spec(TensorId tensor) const {
  return impl->tensors.at(tensor).spec;
}

int64_t NvmeTier::chunks(TensorId tensor) const {
  return int64_t(impl->tensors.at(tensor).offsets.size());
}

uint64_t NvmeTier::fileBytes() const {
  uint64_t total = 0;
  for (const Impl::Drive &d : impl->drives)
    total += d.bytes;
  return total;
}

uint64_t NvmeTier::windowBytes() const { return impl->windowSize; }
bool NvmeTier::direct() const { return impl->isDirect; }

NvmeTier::Stats NvmeTier::stats() const {
  std::lock_guard<std::mutex> lock(impl->mutex);
  return impl->counters;
}

#endif
