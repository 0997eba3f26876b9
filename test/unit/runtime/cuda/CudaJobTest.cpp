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
#include "megaslide/runtime/train/Session.h"

#include "megaslide/Testing/FakeCuda.h"
#include "megaslide/Testing/TestPlans.h"
#include "megaslide/Testing/ThreadCollectives.h"

#include "llvm/ADT/StringExtras.h"

#include <gtest/gtest.h>

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

TEST(CudaJobTest, TwoRanksStepAsOneProcessWithTwoMicroBatches) {
  std::string why;
  const exec::ExecPlan *one = savedTestPlan("tiny-f32-accum2", why);
  ASSERT_TRUE(one) << why;
  const exec::ExecPlan *job = savedTestPlan("tiny-f32-job2", why);
  ASSERT_TRUE(job) << why;
  ASSERT_EQ(job->jobRanks(), 2);

  fake::useDevice(0);
  Trained want = train(*one, 2, nullptr);
  if (want.error.rfind("skip: ", 0) == 0)
    GTEST_SKIP() << want.error;
  ASSERT_TRUE(want.error.empty()) << want.error;

  std::vector<Trained> ranks(2);
  dist::test::runThreadRanks(2, [&](int rank, dist::Collectives &comm) {
    fake::useDevice(rank);
    ranks[rank] = train(*job, 1, &comm);
  });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const Trained &got = ranks[r];
    ASSERT_TRUE(got.error.empty()) << got.error;
    // Every rank reports the job's loss and norm. The norm is summed over
    // the ranks' shards, in double: another order than one process's.
    EXPECT_EQ(got.losses, want.losses);
    for (int s = 0; s < kSteps; ++s)
      EXPECT_NEAR(got.norms[s], want.norms[s], 1e-12 * want.norms[s]);
    // Each rank holds its shard of every master, moment and EMA: the
    // same bits as the same elements of one process's.
    ASSERT_EQ(got.state.size(), want.state.size());
    int64_t shards = 0;
    for (const auto &[name, held] : got.state) {
      const auto &[begin, values] = held;
      const std::vector<float> &whole = want.state.at(name).second;
      ASSERT_LE(begin + static_cast<int64_t>(values.size()),
                static_cast<int64_t>(whole.size()))
          << name;
      shards += values.size() < whole.size();
      for (size_t i = 0; i < values.size(); ++i)
        ASSERT_EQ(values[i], whole[begin + i])
            << name << " element " << begin + i;
    }
    EXPECT_GT(shards, 0) << "nothing is sharded";
  }
}

} // namespace
