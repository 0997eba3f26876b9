//===- Pipelines.cpp - Named planning pipelines ---------------------------===//

#include "megaslide/Pipelines/Pipelines.h"

#include "megaslide/Transforms/Passes.h"
#include "megaslide/Transforms/Planning.h"

#include "mlir/Pass/PassRegistry.h"

using namespace mlir;
using namespace megaslide;

PlanningOptions PipelineOptions::values() const {
  PlanningOptions v;
#define MEGASLIDE_OPTION(FIELD, TYPE, NAME, INIT, HELP, PASS, FLAG)           \
  v.FIELD = FIELD;
#define MEGASLIDE_TRIPLE_OPTION(FIELD, NAME, HELP, PASS, FLAG)                \
  v.FIELD.assign(FIELD.begin(), FIELD.end());
#include "megaslide/Pipelines/PipelineOptions.def"
  return v;
}

/// Adds `pass` with every planning option it declares (PipelineOption) set
/// from `o`: the builders name passes, never their options.
static void addPass(OpPassManager &pm, std::unique_ptr<Pass> pass,
                    const PlanningOptions &o) {
  setPlanningOptions(*pass, o);
  pm.addPass(std::move(pass));
}

/// A verify gate: the invariants `phase` promises hold from here on.
static void addVerifyGate(OpPassManager &pm, StringRef phase) {
  VerifySchedulePassOptions gate;
  gate.phase = phase.str();
  pm.addPass(createVerifySchedulePass(gate));
}

/// The schedule phase after the activations: shared with the trials of
/// `auto`, which must see the transfers and streams the plan will have.
static void addTransfersAndStreams(OpPassManager &pm,
                                   const PlanningOptions &o) {
  addPass(pm, createInsertTransfersPass(), o);
  addVerifyGate(pm, "transfers");
  // Streams and prefetch change program order, which liveness reads.
  addPass(pm, createScheduleOverlapPass(), o);
  addVerifyGate(pm, "streams");
}

/// Packing, shared with the trials of `auto` (same alignment).
static void addPacking(OpPassManager &pm, const PlanningOptions &o) {
  // Last: offsets are only valid for the final program order.
  addPass(pm, createPlanMemoryPass(), o);
}

void megaslide::buildGraphPipeline(OpPassManager &pm,
                                   const PlanningOptions &o) {
  // First, while attention is still one op: everything after plans memory
  // and time for the attention that will actually run.
  if (o.attention == AttentionKind::Dsa)
    addPass(pm, createRewriteAttentionToDsaPass(), o);
}

void megaslide::buildActivationTrialPipeline(OpPassManager &pm,
                                             const PlanningOptions &o) {
  addTransfersAndStreams(pm, o);
  addPacking(pm, o);
}

void megaslide::buildSchedulePipeline(OpPassManager &pm,
                                      const PlanningOptions &o) {
  // The host-state policy decides the types of persistent state, which
  // the transfers below read.
  addPass(pm, createPlanResidencyPass(), o);
  // Recomputation clones forward ops, including their weight reads, so it
  // runs before those reads become transfers.
  OpPassManager trials(ModuleOp::getOperationName());
  buildActivationTrialPipeline(trials, o);
  addPass(pm, createPlanActivationsPass(std::move(trials)), o);
  addTransfersAndStreams(pm, o);
  // Last in the phase: every other host buffer (checkpoints, staging) is
  // declared by now, so `update=auto` sees what the host has left; the
  // trials need no marks, which change neither device memory nor order.
  addPass(pm, createDeferUpdatesPass(), o);
}

void megaslide::buildMemoryPipeline(OpPassManager &pm,
                                    const PlanningOptions &o) {
  addPacking(pm, o);
  addPass(pm, createCheckBudgetPass(), o);
  addVerifyGate(pm, "memory");
}

void megaslide::buildMegaSlidePipeline(OpPassManager &pm,
                                       const PlanningOptions &o) {
  buildGraphPipeline(pm, o);
  buildSchedulePipeline(pm, o);
  buildMemoryPipeline(pm, o);
  // After the memory gate: it reads the final transfers (plan-memory adds
  // none) and reports only plans that fit; it changes nothing.
  if (o.reportBytesMoved)
    addPass(pm, createReportBytesMovedPass(), o);
}

/// Registers `build` under `name`, with the pipeline options.
static void registerPipeline(StringRef name, StringRef description,
                             void (*build)(OpPassManager &,
                                           const PlanningOptions &)) {
  PassPipelineRegistration<PipelineOptions>(
      name, description, [build](OpPassManager &pm, const PipelineOptions &o) {
        build(pm, o.values());
      });
}

void megaslide::registerPipelines() {
  registerPipeline("megaslide-pipeline",
                   "Plans a training step: 3D-DSA, residency, activations, "
                   "transfers, overlap, memory, budgets",
                   buildMegaSlidePipeline);
  registerPipeline("megaslide-graph-pipeline",
                   "Graph phase of megaslide-pipeline", buildGraphPipeline);
  registerPipeline("megaslide-schedule-pipeline",
                   "Schedule phase of megaslide-pipeline",
                   buildSchedulePipeline);
  registerPipeline("megaslide-memory-pipeline",
                   "Memory phase of megaslide-pipeline", buildMemoryPipeline);
  registerPipeline("megaslide-activation-trial-pipeline",
                   "What activation-policy=auto runs on a copy of the step "
                   "for each choice: the schedule phase after the "
                   "activations, then packing",
                   buildActivationTrialPipeline);
}
