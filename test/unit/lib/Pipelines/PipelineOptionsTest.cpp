//===- PipelineOptionsTest.cpp - Typed planning options -------------------===//
//
// The planning options stay typed from where they are given to the pass
// that reads them (issue 27): a size is parsed once, where it is written,
// and a bad one is an error naming the option there; the pipelines set
// each option a pass declares through its typed setter, never through
// text; the arena's budget has one formula.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Pipelines/Pipelines.h"
#include "megaslide/Transforms/Passes.h"

#include "mlir/IR/BuiltinOps.h"
#include "llvm/Support/raw_ostream.h"

#include "gtest/gtest.h"

#include <string>

using namespace mlir;
using namespace megaslide;

namespace {

std::string pipelineText(OpPassManager &pm) {
  std::string text;
  llvm::raw_string_ostream os(text);
  pm.printAsTextualPipeline(os);
  return text;
}

TEST(ByteSize, KeepsItsTextAndItsBytes) {
  ByteSize size = llvm::cantFail(ByteSize::parse("1.5 TiB"));
  EXPECT_EQ(size.bytes(), 1649267441664u);
  EXPECT_EQ(size.text(), "1.5 TiB");
  // As a pass pipeline needs it.
  EXPECT_EQ(printOptionValue(size), "{1.5 TiB}");
  EXPECT_EQ(printOptionValue(ByteBudget("141GB")), "141GB");
  EXPECT_EQ(ByteSize().bytes(), 0u);
  EXPECT_EQ(ByteSize("0").bytes(), 0u);
}

TEST(ByteSize, ErrorsSayWhy) {
  EXPECT_EQ(llvm::toString(ByteSize::parse("lots").takeError()),
            "'lots' is not a memory size; write e.g. 141GB, 1.5TB (decimal) "
            "or 80GiB, 1.5TiB (binary)");
  EXPECT_EQ(llvm::toString(ByteBudget::parse("0").takeError()),
            "a budget must be positive");
  EXPECT_EQ(llvm::toString(ByteBudget::parse("x").takeError()),
            "'x' is not a memory size; write e.g. 141GB, 1.5TB (decimal) or "
            "80GiB, 1.5TiB (binary)");
  EXPECT_EQ(llvm::cantFail(ByteBudget::parse("1B")).bytes(), 1u);
}

// A size is parsed where the pipeline's options are given. Before, it
// stayed text until a pass read it, so a phase whose passes do not read
// it (the graph phase and host-mem) took any text.
TEST(PipelineOptions, BadSizeIsAnErrorWhereItIsGiven) {
  struct Case {
    const char *options, *error;
  };
  for (Case c : {Case{"host-mem=x", "for the --host-mem option: 'x' is not "
                                    "a memory size"},
                 Case{"gpu-mem=0", "for the --gpu-mem option: a budget must "
                                   "be positive"},
                 Case{"gpu-reserve=-1GB", "for the --gpu-reserve option: "
                                          "'-1GB' is not a memory size"}}) {
    SCOPED_TRACE(c.options);
    PipelineOptions options;
    testing::internal::CaptureStderr();
    LogicalResult parsed = options.parseFromString(c.options);
    std::string errors = testing::internal::GetCapturedStderr();
    EXPECT_TRUE(failed(parsed));
    EXPECT_NE(errors.find(c.error), std::string::npos) << errors;
  }
  PipelineOptions options;
  ASSERT_TRUE(
      succeeded(options.parseFromString("gpu-reserve=0 os-allowance=0")));
  EXPECT_EQ(options.values().gpuReserve.bytes(), 0u);
}

// The pipelines set every option a pass declares, typed: the values reach
// the passes as given, sizes with their text.
TEST(PlanningOptions, PipelinesSetTheOptionsEachPassDeclares) {
  PlanningOptions o;
  o.gpuMemory = ByteBudget("24GB");
  o.gpuReserve = ByteSize("1 GiB");
  o.buffers = 3;
  o.activationPolicy = schedule::ActivationPolicy::offload;
  o.dsaWindow = {3, 5, 8};
  OpPassManager pm(ModuleOp::getOperationName());
  buildMegaSlidePipeline(pm, o);
  std::string text = pipelineText(pm);
  for (const char *pass :
       {"megaslide-rewrite-attention-to-dsa{ radius=4  window={3,5,8}}",
        "megaslide-plan-activations{buffers=3 gpu-mem=24GB gpu-reserve={1 "
        "GiB} policy=offload prefetch-distance=1}",
        "megaslide-check-budget{gpu-mem=24GB gpu-reserve={1 GiB} "
        "host-mem=1.5TB nvme-drives=0 nvme-window=1GiB}",
        "megaslide-plan-residency{experts=1 gpus-per-node=1 host-mem=1.5TB "
        "host-state-policy=\"master-moments\" nodes=1 os-allowance=auto}"})
    EXPECT_NE(text.find(pass), std::string::npos) << pass << "\nin " << text;
}

// Each pass object has its own setters: a copy of a pass manager (as the
// trials of `auto` make) is set without touching the original, and the
// original stays settable once the copy is gone.
TEST(PlanningOptions, ClonedPassesHaveTheirOwnSetters) {
  OpPassManager original(ModuleOp::getOperationName());
  original.addPass(createCheckBudgetPass());
  PlanningOptions small;
  small.gpuMemory = ByteBudget("1GB");
  {
    OpPassManager copy = original;
    setPlanningOptions(*copy.getPasses().begin(), small);
    EXPECT_NE(pipelineText(copy).find("gpu-mem=1GB"), std::string::npos);
    EXPECT_NE(pipelineText(original).find("gpu-mem=141GB"), std::string::npos);
  }
  setPlanningOptions(*original.getPasses().begin(), small);
  EXPECT_NE(pipelineText(original).find("gpu-mem=1GB"), std::string::npos);
  EXPECT_TRUE(declaresPlanningOption(*original.getPasses().begin(), "gpu-mem"));
  EXPECT_FALSE(
      declaresPlanningOption(*original.getPasses().begin(), "buffers"));
}

TEST(PlanningOptions, ArenaBudgetIsTheGpuBudgetLessTheReserve) {
  EXPECT_EQ(arenaBudget(ByteBudget("141GB"), ByteSize("2GiB")), 138852516352u);
  EXPECT_EQ(arenaBudget(ByteBudget("1GB"), ByteSize("0")), 1000000000u);
  // A reserve of more than the GPU leaves the arena nothing.
  EXPECT_EQ(arenaBudget(ByteBudget("1GB"), ByteSize("2GB")), 0u);
}

} // namespace
