//===- StepRunnerTest.cpp - The step runner's device contract -------------===//
//
// A conformance test of exec::Device, as IREE's HAL conformance suite tests
// its drivers: a device written only from the primitives' contract
// (StepRunner.h) runs the saved tiny plans (TestPlans.h; global attention
// and 3D-DSA) through the same exec::StepRunner as the cpu backend and
// must match it bit for bit: losses, gradients, gradient norms, the host
// state after streaming and deferred updates (host::HostOptimizer, as
// train::Session drives it), and a step skipped for a non-finite loss.
// It shares the cpu backend's host primitives (cpu::HostDevice: casts,
// copies, the cpu kernels) but binds memory its own way: every value in a
// buffer of its own, allocated when the runner makes it live and freed
// when the runner releases it, so a value released too early or a view
// bound to the wrong bytes shows as a difference.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/plan/StepRunner.h"

#include "megaslide/runtime/cpu/CpuBackend.h"
#include "megaslide/runtime/cpu/HostDevice.h"
#include "megaslide/runtime/host/HostOptimizer.h"
#include "megaslide/runtime/plan/DeferredUpdates.h"
#include "megaslide/runtime/train/SyntheticData.h"

#include "megaslide/Testing/TestPlans.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>

using namespace megaslide;
using exec::Home;

namespace {

/// The primitives over plain host memory (cpu::HostDevice: each done
/// before it returns, graph ops on the cpu kernels), every device value in
/// a buffer of its own while it is live.
class HostTestDevice final : public cpu::HostDevice {
public:
  explicit HostTestDevice(const exec::ExecPlan &plan)
      : HostDevice(plan, llvm::cantFail(cpu::bindGraphKernels(plan))),
        buffers(plan.values.size()) {
    for (size_t id = 0; id < plan.values.size(); ++id)
      if (plan.values[id].home != Home::Device)
        buffers[id].resize(plan.values[id].type.bytes());
  }

  int64_t peakLiveBytes = 0;

  const char *name() const override { return "host-test"; }
  uint8_t *hostData(int64_t id) override { return buffers[id].data(); }

  llvm::Error allocate(size_t i) override {
    const exec::Instruction &inst = plan.instructions[i];
    for (int64_t r : inst.results) {
      const exec::Value &v = plan.values[r];
      if (v.home != Home::Device || v.viewOf)
        continue;
      if (!buffers[r].empty())
        return llvm::createStringError("%" + llvm::Twine(r) +
                                       " allocated twice");
      buffers[r].assign(v.type.bytes(), 0xA5); // no zeros to rely on
      liveBytes += v.type.bytes();
    }
    for (const exec::Range &w : inst.workspace)
      liveBytes += w.size;
    peakLiveBytes = std::max(peakLiveBytes, liveBytes);
    return llvm::Error::success();
  }
  void release(size_t i, llvm::ArrayRef<int64_t> dead) override {
    for (const exec::Range &w : plan.instructions[i].workspace)
      liveBytes -= w.size;
    for (int64_t id : dead)
      if (plan.values[id].home == Home::Device) {
        liveBytes -= buffers[id].size();
        buffers[id] = {};
      }
  }
  void measureMemory(exec::MemoryStats &stats) override {
    stats.measuredLiveBytes = peakLiveBytes;
  }

private:
  void resetMemory() override { liveBytes = peakLiveBytes = 0; }
  /// A value's bytes: its own buffer, or its base's for a view.
  uint8_t *bytesOf(int64_t id) override {
    while (plan.values[id].viewOf)
      id = *plan.values[id].viewOf;
    EXPECT_FALSE(buffers[id].empty()) << "%" << id << " is not live";
    return buffers[id].data();
  }

  std::vector<std::vector<uint8_t>> buffers; ///< per value; empty: free
  int64_t liveBytes = 0;
};

/// A step's observable outcome.
struct Outcome {
  exec::StepResult result;
  std::map<std::string, std::vector<float>> gradients;
};

/// Runs one step with `options` (onGradient recorded).
Outcome step(exec::StepRunner &runner, const exec::StepInputs &in,
             host::HostState &state, exec::StepOptions options) {
  Outcome out;
  options.onGradient = [&](llvm::StringRef name, llvm::ArrayRef<float> g) {
    out.gradients[name.str()] = g.vec();
  };
  llvm::Expected<exec::StepResult> r = runner.run(in, state, options);
  EXPECT_TRUE(!!r) << llvm::toString(r.takeError());
  if (r)
    out.result = std::move(*r);
  return out;
}

/// Bit for bit: fp32 values compared as their bits, NaN included.
bool sameBits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

void expectSameOutcome(const Outcome &got, const Outcome &want) {
  EXPECT_TRUE(sameBits(got.result.loss, want.result.loss))
      << got.result.loss << " against " << want.result.loss;
  EXPECT_EQ(got.result.skipped, want.result.skipped);
  EXPECT_EQ(std::memcmp(&got.result.gradSquaredNorm,
                        &want.result.gradSquaredNorm, sizeof(double)),
            0)
      << got.result.gradSquaredNorm << " against "
      << want.result.gradSquaredNorm;
  EXPECT_EQ(got.result.memory.measuredLiveBytes,
            want.result.memory.measuredLiveBytes);
  EXPECT_EQ(got.gradients.size(), want.gradients.size());
  for (const auto &[name, g] : want.gradients) {
    auto it = got.gradients.find(name);
    EXPECT_TRUE(it != got.gradients.end() && it->second == g)
        << "the gradient of " << name << " differs";
  }
}

void expectSameState(const host::HostState &got, const host::HostState &want) {
  EXPECT_EQ(got.step, want.step);
  EXPECT_EQ(got.incomplete, want.incomplete);
  ASSERT_EQ(got.tensors.size(), want.tensors.size());
  for (size_t t = 0; t < got.tensors.size(); ++t)
    EXPECT_TRUE(got.tensors[t].data == want.tensors[t].data &&
                got.tensors[t].bf16 == want.tensors[t].bf16)
        << got.tensors[t].param->name << " differs";
}

/// The test device and the cpu backend's, each with its runner and state.
struct Pair {
  explicit Pair(const exec::ExecPlan &plan)
      : plan(plan), device(plan),
        cpu(llvm::cantFail(cpu::CpuBackend::create(plan))),
        runner(plan, device), testState(host::initHostState(plan, 3)),
        cpuState(testState) {}
  const exec::ExecPlan &plan;
  HostTestDevice device;
  std::unique_ptr<cpu::CpuBackend> cpu;
  exec::StepRunner runner;
  host::HostState testState, cpuState;
};

/// The cpu backend's step, through the same recording as step().
Outcome cpuStep(cpu::CpuBackend &backend, const exec::StepInputs &in,
                host::HostState &state, exec::StepOptions options) {
  Outcome out;
  options.onGradient = [&](llvm::StringRef name, llvm::ArrayRef<float> g) {
    out.gradients[name.str()] = g.vec();
  };
  llvm::Expected<exec::StepResult> r = backend.step(in, state, options);
  EXPECT_TRUE(!!r) << llvm::toString(r.takeError());
  if (r)
    out.result = std::move(*r);
  return out;
}

class StepRunnerConformanceTest
    : public ::testing::TestWithParam<const char *> {
protected:
  /// The saved plan, its updates deferred or streaming.
  exec::ExecPlan plan(bool deferred) {
    std::string why;
    const exec::ExecPlan *saved = savedTestPlan(GetParam(), why);
    EXPECT_TRUE(saved) << why;
    exec::ExecPlan p = saved ? *saved : exec::ExecPlan();
    exec::setDeferredUpdates(p, deferred);
    return p;
  }
  std::vector<exec::StepInputs> batches(const exec::ExecPlan &p, int n) {
    auto shapes = train::InputShapes::of(p);
    EXPECT_TRUE(!!shapes) << llvm::toString(shapes.takeError());
    train::SyntheticData data(*shapes, 5);
    std::vector<exec::StepInputs> out;
    for (int k = 0; k < n; ++k)
      out.push_back(llvm::cantFail(data.next()));
    return out;
  }
};

// Tests that the streaming update (every host_adamw applied as its
// gradient arrives, the loss guard before the first) gives the cpu
// backend's losses, gradients, norms, live bytes and state, step by step.
TEST_P(StepRunnerConformanceTest, StreamingStepsMatchTheCpuBackend) {
  exec::ExecPlan p = plan(/*deferred=*/false);
  Pair pair(p);
  int k = 0;
  for (const exec::StepInputs &in : batches(p, 3)) {
    SCOPED_TRACE("step " + std::to_string(++k));
    exec::StepOptions options;
    options.lr = 1e-3 * k;     // a schedule's
    options.gradScale = 0.75f; // clipping's
    options.trace = true;
    Outcome want = cpuStep(*pair.cpu, in, pair.cpuState, options);
    Outcome got = step(pair.runner, in, pair.testState, options);
    expectSameOutcome(got, want);
    expectSameState(pair.testState, pair.cpuState);
    EXPECT_FALSE(want.result.skipped);
    EXPECT_GT(want.result.gradSquaredNorm, 0);
    EXPECT_FALSE(want.gradients.empty());
    EXPECT_EQ(got.result.spans.size(), want.result.spans.size());
    if (HasFailure())
      break;
  }
  EXPECT_EQ(pair.testState.step, 3);
}

// Tests the deferred update as train::Session drives it: each step
// retains its gradients (no update, no commit), the host optimizer
// decides, and the next step's fetches apply the pending updates before
// their casts. Both devices must end in the same state.
TEST_P(StepRunnerConformanceTest, DeferredStepsMatchTheCpuBackend) {
  exec::ExecPlan p = plan(/*deferred=*/true);
  Pair pair(p);
  host::HostOptimizer::Options o;
  o.deferred = true;
  o.maxGradNorm = 0.5;
  o.emaDecay = 0.9;
  host::HostOptimizer testOpt, cpuOpt;
  testOpt.prepare(p, pair.testState, o);
  cpuOpt.prepare(p, pair.cpuState, o);
  auto deferredOptions = [](host::HostOptimizer &opt) {
    exec::StepOptions options;
    options.applyUpdates = false;
    options.retainGradient = [&opt](const exec::Instruction &inst,
                                    const exec::HostGradient &g) {
      opt.retain(inst, g);
    };
    options.beforeFetch = [&opt](llvm::StringRef param) {
      opt.applyPending(param);
    };
    return options;
  };
  int k = 0;
  for (const exec::StepInputs &in : batches(p, 3)) {
    SCOPED_TRACE("step " + std::to_string(++k));
    Outcome want =
        cpuStep(*pair.cpu, in, pair.cpuState, deferredOptions(cpuOpt));
    Outcome got =
        step(pair.runner, in, pair.testState, deferredOptions(testOpt));
    expectSameOutcome(got, want);
    EXPECT_EQ(want.result.gradSquaredNorm, 0) << "the trainer sums";
    llvm::Expected<double> wantNorm = cpuOpt.retainedNorm();
    llvm::Expected<double> gotNorm = testOpt.retainedNorm();
    ASSERT_TRUE(!!wantNorm && !!gotNorm);
    EXPECT_EQ(*gotNorm, *wantNorm);
    ASSERT_TRUE(std::isfinite(*wantNorm));
    EXPECT_EQ(testOpt.decide(*gotNorm, 1e-3), cpuOpt.decide(*wantNorm, 1e-3));
    expectSameState(pair.testState, pair.cpuState);
    if (HasFailure())
      break;
  }
  testOpt.flush();
  cpuOpt.flush();
  expectSameState(pair.testState, pair.cpuState);
  EXPECT_EQ(pair.testState.step, 3);
  host::HostState initial = host::initHostState(p, 3);
  for (size_t t = 0; t < initial.tensors.size(); ++t) {
    if (initial.tensors[t].param->role == "master") {
      EXPECT_NE(pair.testState.tensors[t].data, initial.tensors[t].data)
          << initial.tensors[t].param->name << " was not updated";
    }
  }
}

// Tests that a non-finite loss skips a streaming step on both: no update,
// no gradient handed out, no step counted, the state bitwise as before;
// and that the next, finite step runs as usual.
TEST_P(StepRunnerConformanceTest, NonFiniteLossSkipsTheStepOnBoth) {
  exec::ExecPlan p = plan(/*deferred=*/false);
  Pair pair(p);
  std::vector<exec::StepInputs> in = batches(p, 2);
  exec::StepInputs bad = in[0];
  bad["noise"][0] = NAN;
  host::HostState before = pair.cpuState;
  Outcome want = cpuStep(*pair.cpu, bad, pair.cpuState, {});
  Outcome got = step(pair.runner, bad, pair.testState, {});
  EXPECT_TRUE(std::isnan(want.result.loss));
  EXPECT_TRUE(want.result.skipped);
  EXPECT_TRUE(want.gradients.empty());
  expectSameOutcome(got, want);
  expectSameState(pair.cpuState, before);
  expectSameState(pair.testState, before);

  want = cpuStep(*pair.cpu, in[1], pair.cpuState, {});
  got = step(pair.runner, in[1], pair.testState, {});
  EXPECT_FALSE(want.result.skipped);
  expectSameOutcome(got, want);
  expectSameState(pair.testState, pair.cpuState);
  EXPECT_EQ(pair.testState.step, 1);
}

INSTANTIATE_TEST_SUITE_P(GlobalAndDsaAttention, StepRunnerConformanceTest,
                         ::testing::Values("tiny", "tiny-dsa"));

} // namespace
