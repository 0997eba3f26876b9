//===- Pipelines.h - Named planning pipelines -------------------*- C++ -*-===//

#ifndef MEGASLIDE_PIPELINES_PIPELINES_H
#define MEGASLIDE_PIPELINES_PIPELINES_H

#include "megaslide/Pipelines/PipelineOptions.h"

#include "mlir/Pass/PassManager.h"
#include "mlir/Pass/PassOptions.h"

namespace megaslide {

/// The planning options as the options of the registered pipelines
/// (megaslide-opt --megaslide-pipeline="gpu-mem=24GB ...").
struct PipelineOptions : mlir::PassPipelineOptions<PipelineOptions> {
#define MEGASLIDE_OPTION(FIELD, TYPE, NAME, INIT, HELP, PASS, FLAG)           \
  Option<TYPE, OptionParserFor<TYPE>> FIELD{*this, NAME, llvm::cl::desc(HELP), \
                                            llvm::cl::init(INIT)};
#define MEGASLIDE_TRIPLE_OPTION(FIELD, NAME, HELP, PASS, FLAG)                \
  ListOption<int64_t> FIELD{*this, NAME, llvm::cl::desc(HELP)};
#include "megaslide/Pipelines/PipelineOptions.def"

  PlanningOptions values() const;
};

/// Graph phase: attention rewrite (3D-DSA unless attention=global).
void buildGraphPipeline(mlir::OpPassManager &pm, const PlanningOptions &o);
/// Schedule phase: residency, activations, transfers, streams.
void buildSchedulePipeline(mlir::OpPassManager &pm, const PlanningOptions &o);
/// Memory phase: packing and budget checks.
void buildMemoryPipeline(mlir::OpPassManager &pm, const PlanningOptions &o);
/// The whole planning pipeline, `megaslide-pipeline`: the three phases,
/// then the optional reports.
void buildMegaSlidePipeline(mlir::OpPassManager &pm, const PlanningOptions &o);
/// What `activation-policy=auto` runs on a copy of the step to measure a
/// choice of policies: the schedule phase after the activations, then the
/// packing of the memory phase, from the same steps as those phases.
void buildActivationTrialPipeline(mlir::OpPassManager &pm,
                                  const PlanningOptions &o);

/// Registers the pipelines above by name with megaslide-opt.
void registerPipelines();

/// docs/reference/PipelineOptions.md: every planning option with its
/// default, the passes that read it, its flag and its C API / Python key.
void printOptionReference(llvm::raw_ostream &os);

} // namespace megaslide

#endif // MEGASLIDE_PIPELINES_PIPELINES_H
