//===- Pipelines.cpp - Named planning pipelines ---------------------------===//

#include "megaslide/Pipelines/Pipelines.h"

#include "megaslide/Transforms/Passes.h"

#include "mlir/Pass/PassRegistry.h"

using namespace mlir;
using namespace megaslide;

/// A verify gate: the invariants `phase` promises hold from here on.
static void addVerifyGate(OpPassManager &pm, StringRef phase) {
  VerifySchedulePassOptions gate;
  gate.phase = phase.str();
  pm.addPass(createVerifySchedulePass(gate));
}

void megaslide::buildGraphPipeline(OpPassManager &pm,
                                   const PipelineOptions &o) {
  // First, while attention is still one op: everything after plans memory
  // and time for the attention that will actually run.
  if (o.attention == AttentionKind::Dsa) {
    RewriteAttentionToDsaPassOptions dsa;
    dsa.window.assign(o.dsaWindow.begin(), o.dsaWindow.end());
    dsa.tile.assign(o.dsaTile.begin(), o.dsaTile.end());
    dsa.radius = o.dsaRadius;
    pm.addPass(createRewriteAttentionToDsaPass(dsa));
  }
}

void megaslide::buildSchedulePipeline(OpPassManager &pm,
                                      const PipelineOptions &o) {
  // The host-state policy decides the types of persistent state, which
  // the transfers below read.
  PlanResidencyPassOptions residency;
  residency.hostStatePolicy = o.hostStatePolicy;
  residency.osAllowance = o.osAllowance;
  pm.addPass(createPlanResidencyPass(residency));
  // Recomputation clones forward ops, including their weight reads, so it
  // runs before those reads become transfers.
  PlanActivationsPassOptions activations;
  activations.policy = o.activationPolicy;
  activations.gpuMemory = o.gpuMemory;
  activations.gpuReserve = o.gpuReserve;
  activations.prefetchDistance = o.prefetchDistance;
  activations.buffers = o.buffers;
  pm.addPass(createPlanActivationsPass(activations));
  pm.addPass(createInsertTransfersPass());
  addVerifyGate(pm, "transfers");
  // Streams and prefetch change program order, which liveness reads.
  ScheduleOverlapPassOptions overlap;
  overlap.prefetchDistance = o.prefetchDistance;
  overlap.buffers = o.buffers;
  pm.addPass(createScheduleOverlapPass(overlap));
  addVerifyGate(pm, "streams");
}

void megaslide::buildMemoryPipeline(OpPassManager &pm,
                                    const PipelineOptions &o) {
  // Last: offsets are only valid for the final program order.
  pm.addPass(createPlanMemoryPass());
  CheckBudgetPassOptions budget;
  budget.gpuMemory = o.gpuMemory;
  budget.gpuReserve = o.gpuReserve;
  budget.hostMemory = o.hostMemory;
  pm.addPass(createCheckBudgetPass(budget));
  addVerifyGate(pm, "memory");
}

void megaslide::buildMegaSlidePipeline(OpPassManager &pm,
                                       const PipelineOptions &o) {
  buildGraphPipeline(pm, o);
  buildSchedulePipeline(pm, o);
  buildMemoryPipeline(pm, o);
  // After the memory gate: it reads the final transfers (plan-memory adds
  // none) and reports only plans that fit; it changes nothing.
  if (o.reportBytesMoved)
    pm.addPass(createReportBytesMovedPass());
}

void megaslide::registerPipelines() {
  PassPipelineRegistration<PipelineOptions>(
      "megaslide-pipeline",
      "Plans a training step: 3D-DSA, residency, activations, transfers, "
      "overlap, memory, budgets",
      buildMegaSlidePipeline);
  PassPipelineRegistration<PipelineOptions>("megaslide-graph-pipeline",
                                            "Graph phase of megaslide-pipeline",
                                            buildGraphPipeline);
  PassPipelineRegistration<PipelineOptions>(
      "megaslide-schedule-pipeline", "Schedule phase of megaslide-pipeline",
      buildSchedulePipeline);
  PassPipelineRegistration<PipelineOptions>(
      "megaslide-memory-pipeline", "Memory phase of megaslide-pipeline",
      buildMemoryPipeline);
}
