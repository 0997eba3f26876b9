//===- CudaJobTest.cpp - A job's plan on the cuda backend, without a GPU --===//
//
// The cuda backend running a job of 2 ranks (docs/Distributed.md), the
// ranks as threads each with its own fake device (FakeCuda.h), the fake
// NCCL and host collectives between the threads (ThreadCollectives.h):
// each rank fetches its shard of every master and all-gathers it, and
// reduce-scatters every gradient before copying its shard to the host,
// whose optimizer updates its shard of the state. In f32 this is one
// process taking both micro-batches (--grad-accum 2) bit for bit: the sum
// of two fp32 gradients is one rounding either way, and the fake's
// streams, with their delays, order the work differently every step.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cuda/CudaBackend.h"
#include "megaslide/runtime/dist/Collectives.h"
#include "megaslide/runtime/host/HostOptimizer.h"
#include "megaslide/runtime/plan/Validate.h"
#include "megaslide/runtime/train/Session.h"
#include "megaslide/runtime/train/SyntheticData.h"

#include "megaslide/Testing/FakeCuda.h"
#include "megaslide/Testing/TestPlans.h"
#include "megaslide/Testing/ThreadCollectives.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <vector>

using namespace megaslide;
using namespace megaslide::cuda;

namespace {

constexpr int kSteps = 3;

/// What a run computed: each step's loss and gradient norm, and each
/// tensor of the host state as the rank holds it (from its first element).
struct Trained {
  std::vector<float> losses;
  std::vector<double> norms;
  std::map<std::string, std::pair<int64_t, std::vector<float>>> state;
  std::string error;
};

train::Recipe recipe() {
  train::Recipe r;
  r.lrSchedule = train::LrSchedule::WarmupCosine;
  r.warmupSteps = 1;
  r.decaySteps = kSteps;
  r.emaDecay = 0.9; // sharded like the masters
  return r;
}

/// `plan`'s steps on the current fake device, a rank of `job` (null: one
/// process), the delays of each run of the plan seeded by its number.
Trained train(const exec::ExecPlan &plan, int64_t gradAccum,
              dist::Collectives *job) {
  Trained run;
  auto fail = [&](const std::string &what) {
    run.error += (run.error.empty() ? "" : "\n") + what;
    return run;
  };
  CudaOptions cudaOptions = fake::backendOptions();
  auto prep = prepareCudaPlan(plan, cudaOptions);
  if (!prep)
    return fail(llvm::toString(prep.takeError()));
  std::string why;
  if (!fake::setUpReference(plan, *prep, why))
    return fail("skip: " + why);
  train::SessionOptions so;
  so.backend = "cuda";
  so.seed = 7;
  so.recipe = recipe();
  so.recipe.gradAccum = gradAccum;
  so.collectives = job;
  so.cuda = cudaOptions;
  auto session = train::Session::create(plan, so);
  if (!session)
    return fail(llvm::toString(session.takeError()));
  exec::StepOptions options;
  int64_t runs = 0;
  options.onRunStart = [&] { fake::beginStep(runs++); };
  for (int s = 0; s < kSteps; ++s) {
    // A rank goes on after what the fake device found, as one on a GPU
    // would, rather than leave the others waiting in its collectives; a
    // rank whose step fails aborts its communicator, failing theirs.
    auto report = (*session)->trainStep(options);
    std::vector<std::string> found = fake::endStep();
    if (!found.empty() && run.error.empty())
      run.error = "step " + std::to_string(s) + ": the fake device found:\n" +
                  llvm::join(found, "\n");
    if (!report)
      return fail(llvm::toString(report.takeError()));
    run.losses.push_back(report->result.loss);
    run.norms.push_back(report->gradNorm.value_or(NAN));
  }
  (*session)->flushUpdates();
  for (const host::HostTensor &t : (*session)->state().tensors)
    run.state[t.param->name] = {t.heldBegin(), t.data};
  return run;
}

/// A job of 2 ranks with `perRank` micro-batches each, against one process
/// taking all 2 x perRank; `rtol` 0: bit for bit.
void expectJobIsOneProcess(int64_t perRank, double rtol) {
  std::string why;
  const exec::ExecPlan *one = savedTestPlan("tiny-f32-accum2", why);
  ASSERT_TRUE(one) << why;
  const exec::ExecPlan *job = savedTestPlan("tiny-f32-job2", why);
  ASSERT_TRUE(job) << why;
  ASSERT_EQ(job->jobRanks(), 2);

  fake::useDevice(0);
  Trained want = train(*one, 2 * perRank, nullptr);
  if (want.error.rfind("skip: ", 0) == 0)
    GTEST_SKIP() << want.error;
  ASSERT_TRUE(want.error.empty()) << want.error;

  std::vector<Trained> ranks(2);
  dist::test::runThreadRanks(2, [&](int rank, dist::Collectives &comm) {
    fake::useDevice(rank);
    ranks[rank] = train(*job, perRank, &comm);
  });
  auto near = [&](double got, double want) {
    return got == want || std::fabs(got - want) <= rtol * std::fabs(want);
  };
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const Trained &got = ranks[r];
    ASSERT_TRUE(got.error.empty()) << got.error;
    // Every rank reports the job's loss and norm. The norm is summed over
    // the ranks' shards, in double: another order than one process's.
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_PRED2(near, got.losses[s], want.losses[s]) << "step " << s;
      EXPECT_NEAR(got.norms[s], want.norms[s],
                  std::max(rtol, 1e-12) * want.norms[s]);
    }
    // Each rank holds its shard of every master, moment and EMA: the
    // same values as the same elements of one process's (rtol 0: bits).
    ASSERT_EQ(got.state.size(), want.state.size());
    int64_t shards = 0;
    for (const auto &[name, held] : got.state) {
      const auto &[begin, values] = held;
      const std::vector<float> &whole = want.state.at(name).second;
      ASSERT_LE(begin + static_cast<int64_t>(values.size()),
                static_cast<int64_t>(whole.size()))
          << name;
      shards += values.size() < whole.size();
      // Relative to the tensor's largest value: moments near 0 cancel.
      float scale = 0;
      for (float w : whole)
        scale = std::max(scale, std::fabs(w));
      for (size_t i = 0; i < values.size(); ++i)
        ASSERT_LE(std::fabs(values[i] - whole[begin + i]), rtol * scale)
            << name << " element " << begin + i << ": " << values[i]
            << " against " << whole[begin + i];
    }
    EXPECT_GT(shards, 0) << "nothing is sharded";
  }
}

// One micro-batch per rank: each gradient is summed once, on the device,
// as one process adds its two (one fp32 rounding), and kept as the rank's
// shard for the update.
TEST(CudaJobTest, TwoRanksStepAsOneProcessWithTwoMicroBatches) {
  expectJobIsOneProcess(1, 0);
}

// Two micro-batches per rank: the host sums the rank's device-reduced
// shards in fp32, (g0 + g2) + (g1 + g3) where one process adds
// ((g0 + g1) + g2) + g3: the same within float rounding.
TEST(CudaJobTest, TwoRanksOfTwoMicroBatchesStepAsOneProcessWithFour) {
  expectJobIsOneProcess(2, 1e-5);
}

/// exec::validate holds a plan to one job: a fetch marked for 3 ranks in
/// the plan of a job of 2 is named.
TEST(CudaJobTest, APlanIsForOneJob) {
  std::string why;
  const exec::ExecPlan *saved = savedTestPlan("tiny-f32-job2", why);
  ASSERT_TRUE(saved) << why;
  ASSERT_FALSE(exec::validate(*saved));
  exec::ExecPlan plan = *saved;
  auto fetch = llvm::find_if(plan.instructions, [](const exec::Instruction &i) {
    return i.op == exec::OpCode::Fetch;
  });
  ASSERT_NE(fetch, plan.instructions.end());
  fetch->attrs["ranks"] = int64_t(3);
  std::string message = llvm::toString(exec::validate(plan));
  EXPECT_NE(message.find("('fetch') is for 3 ranks, the plan's first "
                         "collective for 2: a plan is for one job"),
            std::string::npos)
      << message;
}

/// What every rank knows alike is refused before any of them waits for
/// the others: a job's plan outside its job, a plan of one rank on a rank
/// of a job.
TEST(CudaJobTest, APlanForAnotherJobIsRefusedAtOnce) {
  std::string why;
  const exec::ExecPlan *one = savedTestPlan("tiny-f32-accum2", why);
  ASSERT_TRUE(one) << why;
  const exec::ExecPlan *job = savedTestPlan("tiny-f32-job2", why);
  ASSERT_TRUE(job) << why;
  auto alone = CudaBackend::create(*job, fake::backendOptions());
  ASSERT_FALSE(!!alone);
  EXPECT_EQ(llvm::toString(alone.takeError()),
            "the plan is for a job of 2 rank(s) and this process is not a "
            "rank of a job: launch one process per GPU (mpirun -np N, srun "
            "-n N; docs/Distributed.md)");
  dist::test::runThreadRanks(3, [&](int rank, dist::Collectives &comm) {
    CudaOptions options = fake::backendOptions();
    options.job = &comm;
    for (const exec::ExecPlan *plan : {one, job}) {
      auto gpu = CudaBackend::create(*plan, options);
      ASSERT_FALSE(!!gpu);
      EXPECT_NE(llvm::toString(gpu.takeError())
                    .find("rank(s) and this process is rank " +
                          std::to_string(rank) +
                          " of a job of 3: plan the "
                          "step for the job"),
                std::string::npos);
    }
  });
}

/// A run's backends (one per bucket) share the job's communicator: rank 0
/// makes a second backend while rank 1 keeps its first, with no
/// collective call (a new communicator would wait for rank 1 for ever),
/// and the two step together.
TEST(CudaJobTest, ALaterBackendReusesTheCommunicator) {
  std::string why;
  const exec::ExecPlan *job = savedTestPlan("tiny-f32-job2", why);
  ASSERT_TRUE(job) << why;
  auto shapes = train::InputShapes::of(*job);
  ASSERT_TRUE(!!shapes) << llvm::toString(shapes.takeError());
  exec::StepInputs in = llvm::cantFail(train::SyntheticData(*shapes, 5).next());
  std::vector<std::string> errors(2);
  dist::test::runThreadRanks(2, [&](int rank, dist::Collectives &comm) {
    fake::useDevice(rank);
    CudaOptions options = fake::backendOptions();
    options.job = &comm;
    auto prep = prepareCudaPlan(*job, options);
    ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
    if (!fake::setUpReference(*job, *prep, why))
      return;
    auto first = CudaBackend::create(*job, options);
    ASSERT_TRUE(!!first) << llvm::toString(first.takeError());
    std::unique_ptr<CudaBackend> gpu = std::move(*first);
    if (rank == 0) {
      options.collectives = gpu->deviceCollectives();
      ASSERT_TRUE(options.collectives);
      gpu.reset();
      auto second = CudaBackend::create(*job, options);
      ASSERT_TRUE(!!second) << llvm::toString(second.takeError());
      gpu = std::move(*second);
      EXPECT_EQ(gpu->deviceCollectives(), options.collectives);
    }
    host::HostState state = host::initHostState(*job, 3, rank, 2);
    host::HostOptimizer optimizer;
    host::HostOptimizer::Options o;
    o.deferred = true;
    o.collectives = &comm;
    o.deviceReduces = true;
    optimizer.prepare(*job, state, o);
    exec::StepOptions so;
    so.applyUpdates = false;
    so.retainGradient = [&](const exec::Instruction &inst,
                            const exec::HostGradient &g) {
      optimizer.retain(inst, g);
    };
    fake::beginStep(rank);
    auto step = gpu->step(in, state, so);
    errors[rank] = step ? llvm::join(fake::endStep(), "\n")
                        : llvm::toString(step.takeError());
  });
  if (!why.empty())
    GTEST_SKIP() << why;
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

} // namespace
