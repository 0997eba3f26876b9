//===- DataParallelPlanTest.cpp - A job of several ranks, as planned ------===//
//
// The planner's side of data parallelism (docs/Distributed.md, "Planning a
// job"): the ring formulas against values worked by hand from
// docs/CostModel.md, and tiny planned as a job of 2 x 2 ranks: its plan
// carries the collectives on the comm stream and copies its rank's shards,
// the sim backend replays it, the backends that run the StepRunner refuse
// it by name, and the report's job figures follow from the others.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Analysis/PlanReport.h"
#include "megaslide/Pipelines/Plan.h"
#include "megaslide/Target/ExecPlan/ExportExecPlan.h"
#include "megaslide/runtime/cuda/CudaPlan.h"
#include "megaslide/runtime/plan/StepRunner.h"
#include "megaslide/runtime/plan/Validate.h"
#include "megaslide/runtime/sim/SimBackend.h"

#include "mlir/IR/MLIRContext.h"

#include "gtest/gtest.h"

using namespace megaslide;

namespace {

// (N - 1) (alpha + B / (N beta)), worked by hand for 1 GB on the built-in
// links: one node of 8 on NVLink, 7 x (3 us + 1e9 / 3.6e12 s); two nodes
// of 8 over the network, 15 x (6 us + 1e9 / 8e11 s).
TEST(DataParallelPlanTest, RingFormulasByHand) {
  sim::HardwareModel hw;
  EXPECT_NEAR(sim::ringCollectiveSeconds(1e9, 8, 1, hw),
              7 * (3e-6 + 1e9 / 3.6e12), 1e-12);
  EXPECT_NEAR(sim::ringCollectiveSeconds(1e9, 8, 1, hw), 1.9654444e-3, 1e-9);
  EXPECT_NEAR(sim::ringCollectiveSeconds(1e9, 16, 2, hw), 0.01884, 1e-9);
  // The network is the slower link of a ring that crosses it, whichever
  // that is.
  hw.networkBandwidth = 900e9;
  EXPECT_NEAR(sim::ringCollectiveSeconds(1e9, 16, 2, hw),
              15 * (6e-6 + 1e9 / (16 * 450e9)), 1e-12);
  EXPECT_EQ(sim::ringCollectiveSeconds(1e9, 1, 1, hw), 0);
  // The norm: 2 (N - 1) alpha.
  EXPECT_NEAR(sim::allReduceScalarSeconds(16, 2, hw), 1.8e-4, 1e-12);
  EXPECT_NEAR(sim::allReduceScalarSeconds(8, 1, hw), 4.2e-5, 1e-12);
  // secondsFor prices a collective by its cost inputs.
  exec::CostInputs in;
  in.bytes = 1000000000;
  in.ranks = 8;
  in.nodes = 1;
  EXPECT_NEAR(sim::secondsFor(sim::CostKind::Collective,
                              sim::KernelFamily::None, in,
                              sim::HardwareModel{}),
              1.9654444e-3, 1e-9);
}

TEST(DataParallelPlanTest, LinksAreHardwareFields) {
  llvm::Expected<sim::HardwareModel> hw = sim::parseHardwareModel(
      R"({"nvlink_bandwidth": 9e11, "nvlink_latency": 2e-6,
          "network_bandwidth": 1e11, "network_latency": 5e-6})",
      "links.json");
  ASSERT_TRUE(!!hw) << llvm::toString(hw.takeError());
  EXPECT_EQ(hw->nvlinkBandwidth, 9e11);
  EXPECT_EQ(hw->networkLatency, 5e-6);
  llvm::Expected<sim::HardwareModel> bad =
      sim::parseHardwareModel(R"({"network_latency": 2})", "bad.json");
  ASSERT_FALSE(!!bad);
  EXPECT_EQ(llvm::toString(bad.takeError()),
            "bad.json: hardware field 'network_latency': expected a number in "
            "(0, 1] s, got 2");
  // A one-GPU report leaves them out; everything else writes them.
  EXPECT_FALSE(
      sim::toJson(*hw, /*links=*/false).getAsObject()->get("nvlink_bandwidth"));
  EXPECT_TRUE(sim::toJson(*hw).getAsObject()->get("nvlink_bandwidth"));
}

struct Job {
  mlir::MLIRContext context{mlir::MLIRContext::Threading::DISABLED};
  llvm::Expected<PlanResult> planned = llvm::createStringError("not planned");
  explicit Job(int64_t gpusPerNode, int64_t nodes) {
    PlanOptions options;
    options.gpusPerNode = gpusPerNode;
    options.nodes = nodes;
    planned = planModel(context, "tiny", {17, 64, 64, false}, TrainingOptions{},
                        options);
  }
};

TEST(DataParallelPlanTest, AJobsPlanCopiesShardsAndReplaysOnSim) {
  Job job(2, 2);
  ASSERT_TRUE(!!job.planned) << llvm::toString(job.planned.takeError());
  llvm::Expected<exec::ExecPlan> plan = exportExecPlan(*job.planned->module);
  ASSERT_TRUE(!!plan) << llvm::toString(plan.takeError());
  ASSERT_FALSE(!!exec::validate(*plan));
  int64_t gathers = 0, scatters = 0, fetches = 0;
  for (const exec::Instruction &inst : plan->instructions) {
    if (inst.op == exec::OpCode::AllGather ||
        inst.op == exec::OpCode::ReduceScatter) {
      (inst.op == exec::OpCode::AllGather ? gathers : scatters) += 1;
      EXPECT_EQ(inst.stream, exec::Stream::Comm);
      EXPECT_EQ(inst.cost.ranks, 4);
      EXPECT_EQ(inst.cost.nodes, 2);
      EXPECT_EQ(plan->values[inst.results[0]].viewOf, inst.operands[0]);
    }
    if (inst.op == exec::OpCode::Fetch) {
      ++fetches;
      // Rank 0's shard: 16-element units shared out, rank 0 the largest.
      const exec::TensorType &t = plan->values[inst.results[0]].type;
      int64_t units = (t.numElements() + 15) / 16;
      int64_t shard = std::min(t.numElements(), (units + 3) / 4 * 16);
      EXPECT_EQ(inst.cost.bytes,
                static_cast<uint64_t>(shard * exec::dtypeBytes(t.dtype)));
    }
  }
  EXPECT_EQ(gathers, fetches);
  EXPECT_GT(scatters, 0);

  // The sim backend replays it; the cpu backend refuses it by its first
  // collective; the cuda backend prepares it, without a GPU.
  llvm::Expected<std::unique_ptr<sim::SimBackend>> sim =
      sim::SimBackend::create(*plan, sim::HardwareModel{});
  ASSERT_TRUE(!!sim) << llvm::toString(sim.takeError());
  llvm::Error refused = exec::checkOneRank(*plan, "cpu");
  ASSERT_TRUE(!!refused);
  std::string message = llvm::toString(std::move(refused));
  EXPECT_NE(message.find("the cpu backend cannot run instruction #"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("('all_gather' over 4 ranks)"), std::string::npos)
      << message;
  llvm::Expected<cuda::PreparedPlan> cuda =
      cuda::prepareCudaPlan(*plan, cuda::CudaOptions{});
  ASSERT_TRUE(!!cuda) << llvm::toString(cuda.takeError());
  EXPECT_EQ(plan->jobRanks(), 4);
}

TEST(DataParallelPlanTest, TheJobsFiguresFollowFromTheOthers) {
  Job job(2, 2);
  ASSERT_TRUE(!!job.planned) << llvm::toString(job.planned.takeError());
  const PlanReport &r = job.planned->report;
  const PlanReport::Job &j = r.job;
  EXPECT_EQ(j.ranks(), 4);
  EXPECT_GT(j.collectiveSeconds, 0);
  EXPECT_DOUBLE_EQ(j.normAllReduceSeconds,
                   sim::allReduceScalarSeconds(4, 2, r.hardware));
  EXPECT_DOUBLE_EQ(j.stepSeconds,
                   r.recipe.optimizerStepSeconds + j.normAllReduceSeconds);
  EXPECT_DOUBLE_EQ(j.samplesPerSecond, 4.0 / j.stepSeconds);
  EXPECT_GT(j.oneGpuStepSeconds, 0);
  EXPECT_DOUBLE_EQ(j.oneGpuSamplesPerSecond, 1.0 / j.oneGpuStepSeconds);
  EXPECT_DOUBLE_EQ(j.scalingEfficiency,
                   j.samplesPerSecond / (4 * j.oneGpuSamplesPerSecond));
  // Per node: its 2 ranks' shares and the OS allowance once.
  uint64_t allowance = 64000000000;
  EXPECT_EQ(j.hostPerNodeBytes, 2 * j.hostPerRankBytes + allowance);
  EXPECT_EQ(j.hostPerNodeBytes, r.hostTotal);

  // One GPU: the same host state whole, and no job.
  Job one(1, 1);
  ASSERT_TRUE(!!one.planned) << llvm::toString(one.planned.takeError());
  EXPECT_EQ(one.planned->report.job.ranks(), 1);
  EXPECT_EQ(one.planned->report.job.samplesPerSecond, 0);
  auto category = [](const PlanReport &r, llvm::StringRef name) {
    for (const auto &[n, bytes] : r.hostByCategory)
      if (n == name)
        return bytes;
    return uint64_t(0);
  };
  // tiny's masters shard over 4 ranks in 16-element units: each node holds
  // two shards, about half (rank 0's, the largest, counted twice).
  uint64_t whole = category(one.planned->report, "fp32 master weights");
  uint64_t node = category(r, "fp32 master weights");
  EXPECT_GE(2 * node, whole);
  EXPECT_LT(node, whole);
}

} // namespace
