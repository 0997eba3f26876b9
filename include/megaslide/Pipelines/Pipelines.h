//===- Pipelines.h - Named planning pipelines -------------------*- C++ -*-===//

#ifndef MEGASLIDE_PIPELINES_PIPELINES_H
#define MEGASLIDE_PIPELINES_PIPELINES_H

#include "mlir/Pass/PassManager.h"
#include "mlir/Pass/PassOptions.h"

#include <string>

namespace megaslide {

enum class AttentionKind { Dsa, Global };

struct PipelineOptions : mlir::PassPipelineOptions<PipelineOptions> {
  Option<std::string> gpuMemory{*this, "gpu-mem",
                                llvm::cl::desc("Device memory budget"),
                                llvm::cl::init("141GB")};
  Option<std::string> gpuReserve{
      *this, "gpu-reserve",
      llvm::cl::desc("Device memory kept for the CUDA context and libraries"),
      llvm::cl::init("2GiB")};
  Option<std::string> hostMemory{*this, "host-mem",
                                 llvm::cl::desc("Host memory budget"),
                                 llvm::cl::init("1.5TB")};
  Option<std::string> osAllowance{
      *this, "os-allowance",
      llvm::cl::desc("Host memory reserved for the OS and runtime"),
      llvm::cl::init("64GB")};
  Option<int64_t> buffers{*this, "buffers",
                          llvm::cl::desc("Weight-shard buffers on device"),
                          llvm::cl::init(2)};
  Option<int64_t> prefetchDistance{
      *this, "prefetch-distance",
      llvm::cl::desc("Blocks ahead that weights are fetched"),
      llvm::cl::init(1)};
  Option<std::string> activationPolicy{
      *this, "activation-policy",
      llvm::cl::desc("keep | recompute | offload | auto"),
      llvm::cl::init("auto")};
  Option<std::string> hostStatePolicy{
      *this, "host-state-policy",
      llvm::cl::desc("master-moments | persistent-bf16 | bf16-moments"),
      llvm::cl::init("master-moments")};
  Option<AttentionKind> attention{
      *this, "attention", llvm::cl::desc("Self-attention over video tokens"),
      llvm::cl::init(AttentionKind::Dsa),
      llvm::cl::values(clEnumValN(AttentionKind::Dsa, "dsa",
                                  "3D Deformable Slide Attention"),
                       clEnumValN(AttentionKind::Global, "global",
                                  "keep global attention"))};
  ListOption<int64_t> dsaWindow{
      *this, "dsa-window",
      llvm::cl::desc("3D-DSA key window (t,y,x) in tokens (default 9,15,24)")};
  ListOption<int64_t> dsaTile{
      *this, "dsa-tile",
      llvm::cl::desc("3D-DSA query tile (t,y,x) in tokens (default 3,5,8)")};
  Option<int64_t> dsaRadius{
      *this, "dsa-radius",
      llvm::cl::desc("Largest displacement 3D-DSA offset estimation searches"),
      llvm::cl::init(4)};
  Option<std::string> target{*this, "target",
                             llvm::cl::desc("Kernel target (sm_90a)"),
                             llvm::cl::init("sm_90a")};
  Option<bool> reportBytesMoved{
      *this, "report-bytes-moved",
      llvm::cl::desc("Remark the PCIe bytes each block moves "
                     "(megaslide-report-bytes-moved)"),
      llvm::cl::init(false)};
};

/// Graph phase: attention rewrite (3D-DSA unless attention=global).
void buildGraphPipeline(mlir::OpPassManager &pm, const PipelineOptions &o);
/// Schedule phase: residency, activations, transfers, streams.
void buildSchedulePipeline(mlir::OpPassManager &pm, const PipelineOptions &o);
/// Memory phase: packing and budget checks.
void buildMemoryPipeline(mlir::OpPassManager &pm, const PipelineOptions &o);
/// The whole planning pipeline, `megaslide-pipeline`: the three phases,
/// then the optional reports.
void buildMegaSlidePipeline(mlir::OpPassManager &pm, const PipelineOptions &o);

/// Registers the pipelines above by name with megaslide-opt.
void registerPipelines();

} // namespace megaslide

#endif // MEGASLIDE_PIPELINES_PIPELINES_H
