//===- CudaBackendGuardsTest.cpp - The cuda backend's guards --------------===//
//
// What the cuda backend refuses or keeps, without a GPU: plans it cannot
// run (alignment below 256 bytes, a graph op off the compute stream), an
// arena over the budget the plan was checked against, the device-memory
// margin, MEGASLIDE_CUDA_SYNC and the errors of a GPU fault, the final loss
// copied into pinned memory, the library search, and pinned pools kept
// across backends (a bucket switch). The backend runs on the fake device
// (FakeCuda.h) with the dense kernels as the cpu reference: what these
// check is the backend's bookkeeping, not the kernels.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cuda/CudaApi.h"
#include "megaslide/runtime/cuda/Libraries.h"
#include "megaslide/runtime/cuda/CudaBackend.h"
#include "megaslide/runtime/cuda/Nvrtc.h"
#include "megaslide/runtime/host/HostState.h"
#include "megaslide/runtime/support/Packing.h"
#include "megaslide/runtime/train/SyntheticData.h"

#include "megaslide/Testing/FakeCuda.h"
#include "megaslide/Testing/TestPlans.h"

#include "llvm/ADT/StringExtras.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>

#include <dlfcn.h>
#include <unistd.h>

using namespace megaslide;
using namespace megaslide::cuda;
using exec::DType;
using exec::TensorType;
namespace fs = std::filesystem;

namespace {

/// Sets an environment variable for a scope (unset: nullopt).
class ScopedEnv {
public:
  ScopedEnv(const char *name, std::optional<std::string> value) : name(name) {
    if (const char *old = std::getenv(name))
      saved = old;
    set(value);
  }
  ~ScopedEnv() { set(saved); }

private:
  void set(const std::optional<std::string> &v) {
    if (v)
      ::setenv(name, v->c_str(), 1);
    else
      ::unsetenv(name);
  }
  const char *name;
  std::optional<std::string> saved;
};

//===----------------------------------------------------------------------===//
// Plans the backend refuses
//===----------------------------------------------------------------------===//

/// latents -> h2d -> gelu -> d2h: the least a graph op needs, its stream
/// chosen by the test.
exec::ExecPlan geluPlan(exec::Stream geluStream) {
  exec::ExecPlan p;
  p.model = "gelu";
  p.alignment = 256;
  TensorType t{DType::BF16, {2, 64}};
  auto value = [&](exec::Home home, int64_t offset, const char *name = "") {
    exec::Value v;
    v.type = t;
    v.home = home;
    v.name = name;
    v.offset = offset;
    p.values.push_back(v);
    return static_cast<int64_t>(p.values.size() - 1);
  };
  int64_t in = value(exec::Home::Input, -1, "latents");
  int64_t x = value(exec::Home::Device, 0), y = value(exec::Home::Device, 256);
  int64_t out = value(exec::Home::Host, -1);
  p.inputs = {in};
  p.outputs = {out};
  p.arenaBytes = 512;
  auto inst = [&](exec::OpCode op, exec::Stream s, std::vector<int64_t> ops,
                  std::vector<int64_t> res) {
    exec::Instruction i;
    i.op = op;
    i.stream = s;
    i.operands = std::move(ops);
    i.results = std::move(res);
    p.instructions.push_back(i);
  };
  auto event = [&](exec::Stream from, exec::Stream to) {
    exec::Instruction r;
    r.op = exec::OpCode::Record;
    r.stream = from;
    r.event = p.numEvents++;
    p.instructions.push_back(r);
    exec::Instruction w;
    w.op = exec::OpCode::Wait;
    w.stream = to;
    w.event = r.event;
    p.instructions.push_back(w);
  };
  inst(exec::OpCode::HostToDevice, exec::Stream::HostToDevice, {in}, {x});
  event(exec::Stream::HostToDevice, geluStream);
  inst(exec::parseOpCode("gelu").value(), geluStream, {x}, {y});
  event(geluStream, exec::Stream::DeviceToHost);
  inst(exec::OpCode::DeviceToHost, exec::Stream::DeviceToHost, {y}, {out});
  return p;
}

TEST(CudaPlanGuardsTest, PlanOfTheRightFormPrepares) {
  auto prep = prepareCudaPlan(geluPlan(exec::Stream::Compute));
  EXPECT_TRUE(!!prep) << llvm::toString(prep.takeError());
}

// Item 10 of issue 25: buffers of a plan aligned below 256 bytes would
// reach cuBLASLt and the vector kernels misaligned.
TEST(CudaPlanGuardsTest, RefusesAlignmentBelow256) {
  exec::ExecPlan plan = geluPlan(exec::Stream::Compute);
  plan.alignment = 128;
  auto prep = prepareCudaPlan(plan);
  ASSERT_FALSE(!!prep);
  EXPECT_EQ(llvm::toString(prep.takeError()),
            "the plan's alignment is 128 bytes; the cuda backend needs at "
            "least 256 (recompile the plan for this backend)");
}

// Item 9: one kernel scratch and one cuBLASLt workspace serve every graph
// op, so a graph op on a copy stream could overlap another in them.
TEST(CudaPlanGuardsTest, RefusesGraphOpsOffTheComputeStream) {
  for (exec::Stream s :
       {exec::Stream::HostToDevice, exec::Stream::DeviceToHost}) {
    auto prep = prepareCudaPlan(geluPlan(s));
    ASSERT_FALSE(!!prep) << exec::streamName(s);
    EXPECT_EQ(llvm::toString(prep.takeError()),
              "instruction #3 ('gelu'): a graph op on the " +
                  std::string(exec::streamName(s)) +
                  " stream; the cuda backend runs graph ops on the compute "
                  "stream only (they share its kernel scratch and cuBLASLt "
                  "workspace)");
  }
}

//===----------------------------------------------------------------------===//
// The backend on the fake device
//===----------------------------------------------------------------------===//

exec::StepInputs tinyInputs(const exec::ExecPlan &plan) {
  auto shapes = train::InputShapes::of(plan);
  return llvm::cantFail(
      train::SyntheticData(llvm::cantFail(std::move(shapes)), 5).next());
}

/// What a step on the fake device found: nothing.
void expectClean(const std::string &context) {
  std::vector<std::string> errors = fake::endStep();
  EXPECT_TRUE(errors.empty()) << context << ":\n" << llvm::join(errors, "\n");
}

// Item 8: the guard measures free memory once the modules, the cuBLASLt
// handle and its workspace are loaded, and keeps a margin for local memory
// and lazily loaded code. Free memory of exactly what the arena, scratch
// and workspace take, which passed before, is refused naming the margin;
// that plus the margin is enough.
TEST(CudaBackendGuardsTest, DeviceMemoryGuardKeepsAMargin) {
  std::string why;
  const exec::ExecPlan *plan = savedTestPlan("tiny", why);
  ASSERT_TRUE(plan) << why;
  CudaOptions options = fake::backendOptions();
  auto prep = prepareCudaPlan(*plan, options);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  int64_t needed = std::max<int64_t>(plan->arenaBytes, 256) +
                   alignTo(prep->scratchBytes, 256) + prep->dsaFallbackBytes;
  // The fake device: 132 SMs of 2048 threads, 1 KiB each, and 64 MiB.
  int64_t margin = int64_t(132) * 2048 * 1024 + (int64_t(64) << 20);
  fake::Options tight;
  tight.freeBytes = needed + options.gemmWorkspaceBytes;
  if (!fake::setUpReference(*plan, *prep, why, tight))
    GTEST_SKIP() << why;
  {
    auto gpu = CudaBackend::create(*plan, options);
    ASSERT_FALSE(!!gpu);
    std::string msg = llvm::toString(gpu.takeError());
    EXPECT_NE(msg.find("the plan needs " + std::to_string(needed) +
                       " bytes of device memory"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("keeps a margin of " + std::to_string(margin) +
                       " bytes (1 KiB of local memory for each of the "
                       "270336 threads the device holds at once, 64 MiB "
                       "for code loaded on first use), but fake device has " +
                       std::to_string(*tight.freeBytes) + " bytes free"),
              std::string::npos)
        << msg;
  }
  fake::Options enough;
  enough.freeBytes = needed + margin;
  ASSERT_TRUE(fake::setUpReference(*plan, *prep, why, enough));
  auto gpu = CudaBackend::create(*plan, options);
  EXPECT_TRUE(!!gpu) << llvm::toString(gpu.takeError());
}

// Issue 27: the device guard holds the plan to the arena budget it was
// checked against (arena_budget_bytes, msched.budget_check), before it
// allocates: an arena beyond it is refused, naming both; one exactly at
// the budget runs.
TEST(CudaBackendGuardsTest, DeviceGuardHoldsThePlanToItsBudget) {
  std::string why;
  const exec::ExecPlan *saved = savedTestPlan("tiny", why);
  ASSERT_TRUE(saved) << why;
  ASSERT_TRUE(saved->arenaBudgetBytes) << "the planner's plan has a budget";
  exec::ExecPlan plan = *saved;
  auto prep = prepareCudaPlan(plan);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  if (!fake::setUpReference(plan, *prep, why))
    GTEST_SKIP() << why;
  plan.arenaBudgetBytes = plan.arenaBytes - 1;
  {
    auto gpu = CudaBackend::create(plan, fake::backendOptions());
    ASSERT_FALSE(!!gpu);
    EXPECT_EQ(llvm::toString(gpu.takeError()),
              "the plan's device arena is " + std::to_string(plan.arenaBytes) +
                  " bytes but the plan was checked against an arena budget "
                  "of " +
                  std::to_string(plan.arenaBytes - 1) +
                  " bytes (its arena_budget_bytes: --gpu-mem less "
                  "--gpu-reserve); recompile the plan");
  }
  plan.arenaBudgetBytes = plan.arenaBytes;
  ASSERT_TRUE(fake::setUpReference(plan, *prep, why));
  auto gpu = CudaBackend::create(plan, fake::backendOptions());
  EXPECT_TRUE(!!gpu) << llvm::toString(gpu.takeError());
}

// Item 11: a bad MEGASLIDE_CUDA_SYNC is an error at create, like a bad
// MEGASLIDE_NUM_THREADS.
TEST(CudaBackendGuardsTest, BadSyncSettingIsAnError) {
  std::string why;
  const exec::ExecPlan *plan = savedTestPlan("tiny", why);
  ASSERT_TRUE(plan) << why;
  auto prep = prepareCudaPlan(*plan);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  if (!fake::setUpReference(*plan, *prep, why))
    GTEST_SKIP() << why;
  ScopedEnv sync("MEGASLIDE_CUDA_SYNC", "yes");
  auto gpu = CudaBackend::create(*plan, fake::backendOptions());
  ASSERT_FALSE(!!gpu);
  EXPECT_EQ(llvm::toString(gpu.takeError()),
            "MEGASLIDE_CUDA_SYNC must be 0 or 1 (1: synchronise after every "
            "device command and name the one that fails), not 'yes'");
}

/// The instruction and kernel of the n-th kernel launch of a step (the
/// backend launches in program order, only from graph ops).
std::pair<size_t, std::string> nthLaunch(const PreparedPlan &prep, int64_t n) {
  for (size_t i = 0; i < prep.instructions.size(); ++i)
    if (const auto &lowered = prep.instructions[i].lowered)
      for (const LoweredStep &s : lowered->steps)
        if (auto *l = std::get_if<KernelLaunch>(&s))
          if (--n == 0)
            return {i, l->kernel.name()};
  return {0, ""};
}

// Item 11: a kernel's illegal address surfaces at whatever synchronises
// next; every message of it says the process must restart. Without
// MEGASLIDE_CUDA_SYNC it points at the setting; with it the error names
// the instruction and the kernel that faulted.
TEST(CudaBackendGuardsTest, GpuFaultNamesTheKernelUnderSync) {
  std::string why;
  const exec::ExecPlan *plan = savedTestPlan("tiny", why);
  ASSERT_TRUE(plan) << why;
  auto prep = prepareCudaPlan(*plan);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  constexpr int64_t kFaulty = 5; // the 5th launch of the step
  auto [inst, kernel] = nthLaunch(*prep, kFaulty);
  ASSERT_FALSE(kernel.empty());
  exec::StepInputs in = tinyInputs(*plan);
  for (bool sync : {false, true}) {
    SCOPED_TRACE(sync ? "MEGASLIDE_CUDA_SYNC=1" : "without sync");
    ScopedEnv env("MEGASLIDE_CUDA_SYNC",
                  sync ? std::optional<std::string>("1") : std::nullopt);
    fake::Options options;
    options.fault = fake::Fault{"cuLaunchKernel", kFaulty,
                                700 /* CUDA_ERROR_ILLEGAL_ADDRESS */, true};
    if (!fake::setUpReference(*plan, *prep, why, options))
      GTEST_SKIP() << why;
    auto gpu = CudaBackend::create(*plan, fake::backendOptions());
    ASSERT_TRUE(!!gpu) << llvm::toString(gpu.takeError());
    host::HostState state = host::initHostState(*plan, 3);
    fake::beginStep(0);
    auto r = (*gpu)->step(in, state, {});
    ASSERT_FALSE(!!r);
    std::string msg = llvm::toString(r.takeError());
    EXPECT_TRUE(fake::endStep().empty());
    EXPECT_NE(msg.find("FAKE_ERROR: fake driver error (a sticky error: the "
                       "CUDA context is unusable, the process must restart"),
              std::string::npos)
        << msg;
    // The call that reports it (the event's record or its wait) depends on
    // when the fake stream runs the kernel; the instruction and the kernel
    // do not.
    std::string named = "instruction #" + std::to_string(inst) + " ('" +
                        exec::opName(plan->instructions[inst].op) +
                        "'): kernel " + kernel + " failed on the GPU: ";
    if (sync) {
      EXPECT_EQ(msg.find(named), 0u) << msg;
      EXPECT_NE(msg.find(" (MEGASLIDE_CUDA_SYNC=1): FAKE_ERROR"),
                std::string::npos)
          << msg;
    } else {
      EXPECT_EQ(msg.find(named), std::string::npos) << msg;
      EXPECT_NE(msg.find("rerun with MEGASLIDE_CUDA_SYNC=1 to find the "
                         "kernel"),
                std::string::npos)
          << msg;
    }
  }
}

// Item 12: a plan whose loss stays on the device (its output is the
// device value) has it copied at the end of the step into pinned memory;
// the fake device reports an asynchronous copy to pageable memory.
TEST(CudaBackendGuardsTest, FinalLossIsCopiedIntoPinnedMemory) {
  std::string why;
  const exec::ExecPlan *tiny = savedTestPlan("tiny", why);
  ASSERT_TRUE(tiny) << why;
  exec::ExecPlan plan = *tiny;
  // The d2h of the loss: its operand becomes the plan's output.
  int64_t deviceLoss = -1;
  for (const exec::Instruction &inst : plan.instructions)
    if (inst.op == exec::OpCode::DeviceToHost &&
        inst.results[0] == plan.outputs[0])
      deviceLoss = inst.operands[0];
  ASSERT_GE(deviceLoss, 0);
  plan.outputs = {deviceLoss};
  auto prep = prepareCudaPlan(plan);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  if (!fake::setUpReference(plan, *prep, why))
    GTEST_SKIP() << why;
  auto gpu = CudaBackend::create(plan, fake::backendOptions());
  ASSERT_TRUE(!!gpu) << llvm::toString(gpu.takeError());
  host::HostState state = host::initHostState(plan, 3);
  fake::beginStep(0);
  auto r = (*gpu)->step(tinyInputs(plan), state, {});
  expectClean("the step");
  ASSERT_TRUE(!!r) << llvm::toString(r.takeError());
  EXPECT_TRUE(std::isfinite(r->loss));
  EXPECT_GT(r->loss, 0);
}

// Item 14: Session::useBucket destroys one bucket's backend before it
// creates the next; the pinned pools outlive it. A -> B -> A -> B pins
// nothing once each plan's pools have been pinned once, and says what it
// pinned on stderr when it does.
TEST(CudaBackendGuardsTest, PinnedPoolsAreKeptAcrossBucketSwitches) {
  std::string why;
  const exec::ExecPlan *a = savedTestPlan("tiny", why);
  ASSERT_TRUE(a) << why;
  const exec::ExecPlan *b = savedTestPlan("tiny-dsa", why);
  ASSERT_TRUE(b) << why;
  auto prepA = prepareCudaPlan(*a);
  ASSERT_TRUE(!!prepA) << llvm::toString(prepA.takeError());
  auto prepB = prepareCudaPlan(*b);
  ASSERT_TRUE(!!prepB) << llvm::toString(prepB.takeError());
  // The fake device checks the candidates of one plan: the switches
  // create the backends alone (a step of B under A's setUp would not
  // match), then each plan steps once under its own.
  if (!fake::setUpReference(*a, *prepA, why))
    GTEST_SKIP() << why;
  std::vector<int64_t> pins;
  std::vector<std::string> said;
  for (const exec::ExecPlan *plan : {a, b, a, b}) {
    int64_t before = fake::stats().calls["cuMemHostAlloc"];
    testing::internal::CaptureStderr();
    {
      auto gpu = CudaBackend::create(*plan, fake::backendOptions());
      ASSERT_TRUE(!!gpu) << llvm::toString(gpu.takeError());
    }
    said.push_back(testing::internal::GetCapturedStderr());
    pins.push_back(fake::stats().calls["cuMemHostAlloc"] - before);
  }
  EXPECT_EQ(pins[0], 4) << "inputs, host values, staging, loss";
  EXPECT_EQ(said[0].find("megaslide: cuda backend: pinned "), 0u) << said[0];
  EXPECT_NE(said[0].find(" bytes of host memory in "), std::string::npos);
  EXPECT_NE(said[0].find(" s (0 bytes kept from the previous backend)"),
            std::string::npos)
      << said[0];
  EXPECT_EQ(pins[2], 0) << "A after B";
  EXPECT_EQ(pins[3], 0) << "B after A";
  EXPECT_EQ(said[2], "");
  EXPECT_EQ(said[3], "");

  // Kept blocks serve a step as pinned memory of its own would.
  for (auto [plan, prep] : {std::pair(a, &*prepA), std::pair(b, &*prepB)}) {
    ASSERT_TRUE(fake::setUpReference(*plan, *prep, why));
    for (int k = 0; k < 2; ++k) {
      auto gpu = CudaBackend::create(*plan, fake::backendOptions());
      ASSERT_TRUE(!!gpu) << llvm::toString(gpu.takeError());
      host::HostState state = host::initHostState(*plan, 3);
      fake::beginStep(k);
      auto r = (*gpu)->step(tinyInputs(*plan), state, {});
      expectClean(plan->model + " step " + std::to_string(k));
      ASSERT_TRUE(!!r) << llvm::toString(r.takeError());
    }
    EXPECT_EQ(fake::stats().calls["cuMemHostAlloc"], 4)
        << "the second backend pinned again";
  }
}

//===----------------------------------------------------------------------===//
// Where the CUDA libraries are looked for
//===----------------------------------------------------------------------===//

// Item 13: besides lib64, a toolkit's lib and targets/<arch>-linux/lib,
// and torch's pip wheels (site-packages/nvidia/<pkg>/lib).
TEST(CudaApiGuardsTest, LibrariesAreLookedForBeyondLib64) {
  fs::path root = fs::temp_directory_path() /
                  ("megaslide-cuda-libs-" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::path conda = root / "conda", toolkit = root / "toolkit",
           venv = root / "venv";
  fs::path inLib = conda / "lib" / "libcublasLt.so.13";
  fs::path inTargets =
      toolkit / "targets" / "x86_64-linux" / "lib" / "libcublasLt.so.13";
  fs::path inWheel = venv / "lib" / "python3.11" / "site-packages" / "nvidia" /
                     "cublas" / "lib" / "libcublasLt.so.12";
  // The real library where there is one (so that it loads), else a file.
  const char *real = "/usr/local/cuda/lib64/libcublasLt.so.13";
  for (const fs::path &p : {inLib, inTargets, inWheel}) {
    fs::create_directories(p.parent_path());
    if (fs::exists(real))
      fs::create_symlink(real, p);
    else
      std::ofstream(p.string()) << "";
  }
  std::vector<std::string> names = {"libcublasLt.so.13", "libcublasLt.so.12"};
  auto tried = [&](const char *cudaHome, const char *cudaPath,
                   const char *virtualEnv) {
    ScopedEnv home("CUDA_HOME", cudaHome ? std::optional<std::string>(cudaHome)
                                         : std::nullopt);
    ScopedEnv path("CUDA_PATH", cudaPath ? std::optional<std::string>(cudaPath)
                                         : std::nullopt);
    ScopedEnv env("VIRTUAL_ENV", virtualEnv
                                     ? std::optional<std::string>(virtualEnv)
                                     : std::nullopt);
    return cudaLibraryCandidates(names);
  };
  std::vector<std::string> got =
      tried(conda.c_str(), toolkit.c_str(), venv.c_str());
  ASSERT_GE(got.size(), 5u);
  EXPECT_EQ(got[0], names[0]) << "the loader's path first";
  EXPECT_EQ(got[1], names[1]);
  auto at = [&](const fs::path &p) {
    return std::find(got.begin(), got.end(), p.string()) - got.begin();
  };
  EXPECT_LT(at(inLib), at(inTargets)) << llvm::join(got, "\n");
  EXPECT_LT(at(inTargets), at(inWheel)) << llvm::join(got, "\n");
  EXPECT_LT(at(inWheel), static_cast<long>(got.size()))
      << llvm::join(got, "\n");
  // Nothing set: none of them.
  got = tried(nullptr, nullptr, nullptr);
  EXPECT_EQ(at(inLib), static_cast<long>(got.size()));
  EXPECT_EQ(at(inWheel), static_cast<long>(got.size()));
  if (fs::exists(real)) {
    void *h = dlopen(inTargets.c_str(), RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(h, nullptr) << dlerror();
    EXPECT_NE(dlsym(h, "cublasLtCreate"), nullptr);
    dlclose(h);
  }
  fs::remove_all(root);
}

} // namespace
