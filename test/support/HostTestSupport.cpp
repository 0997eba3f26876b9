//===- HostTestSupport.cpp - Plans, states and files for host tests -------===//

#include "megaslide/Testing/HostTestSupport.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <limits>
#include <random>
#include <unistd.h>

using namespace megaslide;
using namespace megaslide::host;
using llvm::StringRef;

namespace megaslide::host::test {

exec::ExecPlan makePlan(const std::vector<ParamSpec> &specs) {
  exec::ExecPlan plan;
  plan.model = "hostio-test";
  plan.modelConfig = R"({"_class_name": "WanTransformer3DModel", )"
                     R"("num_layers": 1, "in_channels": 2})";
  for (const ParamSpec &s : specs) {
    exec::Param p;
    p.name = s.name;
    p.role = s.role;
    p.group = "blocks";
    p.type.shape = s.shape;
    plan.params.push_back(p);
  }
  for (const ParamSpec &s : specs) {
    if (s.role != "master")
      continue;
    for (const char *suffix : {".exp_avg", ".exp_avg_sq"}) {
      exec::Param m;
      m.name = s.name + suffix;
      m.role = "moment";
      m.of = s.name;
      m.type.shape = s.shape;
      plan.params.push_back(m);
    }
  }
  return plan;
}

std::vector<ParamSpec> defaultSpecs() {
  return {{"patch_embedding.weight", {4, 2, 1, 2, 2}},
          {"patch_embedding.bias", {4}},
          {"blocks.0.attn1.to_q.weight", {4, 4}},
          {"blocks.0.scale_shift_table", {1, 6, 4}},
          {"pos_embed", {1, 3, 4}, "frozen"},
          {"scalar", {}},
          {"empty", {0, 3}}};
}

HostState makeState(const exec::ExecPlan &plan, uint32_t seed) {
  HostState state;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const exec::Param &p : plan.params) {
    HostTensor t;
    t.param = &p;
    t.data.resize(static_cast<size_t>(p.type.numElements()));
    for (size_t i = 0; i < t.data.size(); ++i)
      t.data[i] = normal(rng);
    if (t.data.size() >= 4) {
      t.data[0] = -0.0f;
      t.data[1] = std::numeric_limits<float>::denorm_min();
      t.data[2] = 3.0e38f;
      t.data[3] = 1.0f + 1.0f / 1024; // not a bf16 value
    }
    state.index[p.name] = state.tensors.size();
    state.tensors.push_back(std::move(t));
  }
  state.step = 7;
  return state;
}

const HostTensor &get(const HostState &s, StringRef name) {
  return s.tensors[s.index.find(name)->second];
}
HostTensor &get(HostState &s, StringRef name) {
  return s.tensors[s.index.find(name)->second];
}

bool bitEqual(const std::vector<float> &a, const std::vector<float> &b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

std::string errorText(llvm::Error e) {
  return e ? llvm::toString(std::move(e)) : std::string();
}

void ScratchDirTest::SetUp() {
  llvm::SmallString<128> path;
  ASSERT_FALSE(llvm::sys::fs::createUniqueDirectory("megaslide-hostio", path));
  dir = std::string(path);
}

void ScratchDirTest::TearDown() {
  llvm::sys::fs::remove_directories(dir, /*IgnoreErrors=*/true);
}

std::string ScratchDirTest::path(StringRef name) const {
  llvm::SmallString<256> p(dir);
  llvm::sys::path::append(p, name);
  return std::string(p);
}

std::string readAll(StringRef path) {
  auto buffer = llvm::MemoryBuffer::getFile(path, false, false);
  return buffer ? (*buffer)->getBuffer().str() : std::string("<unreadable>");
}

void writeAll(StringRef path, StringRef bytes) {
  std::ofstream out(path.str(), std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void writeSparse(StringRef path, StringRef prefix, uint64_t size) {
  writeAll(path, prefix);
  ASSERT_EQ(::truncate(path.str().c_str(), static_cast<off_t>(size)), 0);
}

FifoWatch::FifoWatch(std::string fifo) : fifo(std::move(fifo)) {
  watcher = std::thread([this] {
    while (!done) {
      int fd = ::open(this->fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
      if (fd >= 0) {
        opened = true;
        ::close(fd);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
}

bool FifoWatch::openedByReader() {
  done = true;
  if (watcher.joinable())
    watcher.join();
  return opened;
}

std::vector<std::string> entries(StringRef dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (llvm::sys::fs::directory_iterator it(dir, ec), end; it != end && !ec;
       it.increment(ec))
    names.push_back(llvm::sys::path::filename(it->path()).str());
  std::sort(names.begin(), names.end());
  return names;
}

} // namespace megaslide::host::test
