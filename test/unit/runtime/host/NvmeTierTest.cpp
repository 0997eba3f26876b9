//===- NvmeTierTest.cpp - The NVMe tier's files, window and I/O -----------===//

#include "megaslide/runtime/host/NvmeTier.h"
#include "megaslide/Testing/HostTestSupport.h"

#include "llvm/Support/FileSystem.h"

#include "gtest/gtest.h"

#include <cstring>
#include <random>

using namespace megaslide;
using namespace megaslide::host;
using namespace megaslide::host::test;

namespace {

class NvmeTierTest : public ScratchDirTest {
protected:
  /// Two "drives": directories of the scratch dir's file system.
  NvmeTier::Options options(uint64_t window = kMinTierWindowBytes) {
    NvmeTier::Options o;
    for (const char *name : {"d0", "d1"}) {
      EXPECT_FALSE(llvm::sys::fs::create_directory(path(name)));
      o.dirs.push_back(path(name));
    }
    o.windowBytes = window;
    return o;
  }
};

/// Tensors over several chunks, partial last chunks, and 1-, 2- and
/// 4-byte elements: 45 chunks of up to 4 MiB, more than the 16 slots of
/// the smallest window, so chunks are evicted and read again.
std::vector<NvmeTier::TensorSpec> specs() {
  return {{"a.exp_avg", 30 * kTierChunkElements + 12345, 4},
          {"a.exp_avg_sq", 3 * kTierChunkElements + 7, 4},
          {"b.ema", 10 * kTierChunkElements - 1, 2},
          {"c.codes", 1000, 1}};
}

/// Reads and writes through the tier against the same changes in RAM:
/// zeros at first, whole and partial writes, read-modify-write visits in
/// order and out of it, through a window of a third of the chunks.
TEST_F(NvmeTierTest, MatchesTheSameChangesInRam) {
  auto tier = NvmeTier::create(options(), specs());
  ASSERT_TRUE(static_cast<bool>(tier)) << errorText(tier.takeError());
  NvmeTier &t = **tier;
  EXPECT_TRUE(t.direct());
  const std::vector<NvmeTier::TensorSpec> all = specs();
  std::vector<std::vector<uint8_t>> ram;
  for (const NvmeTier::TensorSpec &s : specs())
    ram.emplace_back(size_t(s.elements * s.elementBytes), 0);
  std::mt19937 rng(7);
  auto check = [&](int64_t id) {
    const NvmeTier::TensorSpec &s = all[id];
    std::vector<uint8_t> back(size_t(s.elements * s.elementBytes), 0xAB);
    ASSERT_FALSE(static_cast<bool>(t.read(id, 0, s.elements, back.data())));
    EXPECT_TRUE(back == ram[id]) << s.name;
  };
  for (int64_t id = 0; id < 4; ++id)
    check(id); // zeros before any write

  // Whole tensors, then a range across chunk boundaries.
  for (int64_t id = 0; id < 4; ++id) {
    for (uint8_t &b : ram[id])
      b = uint8_t(rng());
    ASSERT_FALSE(
        static_cast<bool>(t.write(id, 0, all[id].elements, ram[id].data())));
  }
  std::vector<uint8_t> part(size_t(3 * kTierChunkElements * 4));
  for (uint8_t &b : part)
    b = uint8_t(rng());
  int64_t from = kTierChunkElements - 5;
  ASSERT_FALSE(static_cast<bool>(
      t.write(0, from, from + 3 * kTierChunkElements, part.data())));
  std::memcpy(ram[0].data() + from * 4, part.data(), part.size());

  // The optimizer's visits: acquire, change, release dirty, in the visit
  // order for two steps, then a chunk out of order.
  std::vector<std::pair<NvmeTier::TensorId, int64_t>> order;
  for (int64_t id : {0, 1, 2})
    for (int64_t c = 0; c < t.chunks(id); ++c)
      order.push_back({id, c});
  t.setVisitOrder(order);
  for (int step = 0; step < 2; ++step)
    for (auto [id, c] : order) {
      auto buf = t.acquire(id, c);
      ASSERT_TRUE(static_cast<bool>(buf)) << errorText(buf.takeError());
      const NvmeTier::TensorSpec &s = all[id];
      int64_t n =
          std::min(kTierChunkElements, s.elements - c * kTierChunkElements) *
          s.elementBytes;
      uint8_t *mirror =
          ram[id].data() + c * kTierChunkElements * s.elementBytes;
      for (int64_t k = 0; k < n; k += 97) {
        (*buf)[k] ^= uint8_t(step + 1);
        mirror[k] ^= uint8_t(step + 1);
      }
      ASSERT_FALSE(static_cast<bool>(t.release(id, c, /*dirty=*/true)));
    }
  auto buf = t.acquire(3, 0);
  ASSERT_TRUE(static_cast<bool>(buf));
  (*buf)[999] = 42;
  ram[3][999] = 42;
  ASSERT_FALSE(static_cast<bool>(t.release(3, 0, true)));
  ASSERT_FALSE(static_cast<bool>(t.drain()));
  for (int64_t id = 0; id < 4; ++id)
    check(id);

  NvmeTier::Stats stats = t.stats();
  EXPECT_GT(stats.readBytes, 0u);
  EXPECT_GT(stats.writtenBytes, t.fileBytes()); // every chunk, some twice
}

// Tests that the tier reads ahead along the visit order: in a pass that
// writes nothing behind (so every clean slot can take a read), only the
// first visit starts its own read, through a window of a third of the
// chunks.
TEST_F(NvmeTierTest, ReadsAheadInVisitOrder) {
  auto tier = NvmeTier::create(options(), specs());
  ASSERT_TRUE(static_cast<bool>(tier)) << errorText(tier.takeError());
  NvmeTier &t = **tier;
  std::vector<std::pair<NvmeTier::TensorId, int64_t>> order;
  for (int64_t c = 0; c < t.chunks(0); ++c)
    for (int64_t id : {0, 1, 2})
      if (c < t.chunks(id))
        order.push_back({id, c});
  t.setVisitOrder(order);
  for (int pass = 0; pass < 2; ++pass)
    for (auto [id, c] : order) {
      ASSERT_TRUE(static_cast<bool>(t.acquire(id, c)));
      ASSERT_FALSE(static_cast<bool>(t.release(id, c, /*dirty=*/false)));
    }
  EXPECT_EQ(t.stats().acquires, 2 * order.size());
  EXPECT_EQ(t.stats().misses, 1u);
  EXPECT_GE(t.stats().readBytes, 2 * t.fileBytes() - (4u << 20));
}

TEST_F(NvmeTierTest, Refusals) {
  NvmeTier::Options o = options();
  // Acquired twice, released unacquired, a chunk that does not exist.
  auto tier = NvmeTier::create(o, specs());
  ASSERT_TRUE(static_cast<bool>(tier));
  ASSERT_TRUE(static_cast<bool>((*tier)->acquire(1, 0)));
  EXPECT_EQ(errorText((*tier)->acquire(1, 0).takeError()),
            "NVMe tier: chunk 0 of 'a.exp_avg_sq' is acquired twice");
  EXPECT_EQ(errorText((*tier)->release(1, 1, false)),
            "NVMe tier: chunk 1 of tensor #1 is released but not acquired");
  EXPECT_EQ(errorText((*tier)->acquire(1, 4).takeError()),
            "NVMe tier: no chunk 4 of tensor #1");

  NvmeTier::Options small = o;
  small.windowBytes = 1 << 20;
  EXPECT_EQ(errorText(NvmeTier::create(small, specs()).takeError()),
            "NVMe tier: a window of 1.05 MB (1.00 MiB) is smaller than the "
            "67.11 MB (64.00 MiB) the optimizer's visits need");
  NvmeTier::Options file = o;
  file.dirs = {path("d0/file")};
  writeAll(path("d0/file"), "x");
  EXPECT_EQ(errorText(NvmeTier::create(file, specs()).takeError()),
            "NVMe tier: " + path("d0/file") + ": not a directory");
}

// Tests that a tier in RAM is refused unless forced, and then works with
// buffered I/O where O_DIRECT is refused.
TEST_F(NvmeTierTest, RefusesTmpfsUnlessForced) {
  if (!llvm::sys::fs::is_directory("/dev/shm"))
    GTEST_SKIP() << "no /dev/shm";
  std::string text = errorText(checkTierDirectory("/dev/shm", false));
  EXPECT_NE(text.find("/dev/shm is in RAM (tmpfs)"), std::string::npos) << text;
  EXPECT_FALSE(static_cast<bool>(checkTierDirectory("/dev/shm", true)));
  NvmeTier::Options o;
  o.dirs = {"/dev/shm"};
  o.windowBytes = kMinTierWindowBytes;
  o.force = true;
  auto tier = NvmeTier::create(o, {{"x", 5000, 4}});
  ASSERT_TRUE(static_cast<bool>(tier)) << errorText(tier.takeError());
  std::vector<float> v(5000), back(5000);
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = float(i) * 0.5f;
  ASSERT_FALSE(static_cast<bool>((*tier)->write(0, 0, 5000, v.data())));
  ASSERT_FALSE(static_cast<bool>((*tier)->read(0, 0, 5000, back.data())));
  EXPECT_EQ(v, back);
}

// Tests that a drive without room for its share is refused before any
// write, naming the directory and the bytes.
TEST_F(NvmeTierTest, FullDiskBeforeAnyWrite) {
  NvmeTier::Options o = options();
  FileSizeLimit limit(1 << 20);
  std::string text = errorText(NvmeTier::create(o, specs()).takeError());
  EXPECT_NE(text.find("NVMe tier: " + o.dirs[0] +
                      ": cannot allocate the tier's 77.65 MB (74.05 MiB): "
                      "File too large"),
            std::string::npos)
      << text;
}

} // namespace
