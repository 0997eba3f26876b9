//===- GraphDialect.td - MegaSlide graph dialect -----------*- tablegen -*-===//
//
// The graph dialect: a DiT training step (forward, loss, backward, optimizer)
// as ops on tensors. Scheduling concerns (residency, transfers, streams) live
// in the schedule dialect; nothing here says where a value is stored.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_GRAPH_DIALECT
#define MEGASLIDE_GRAPH_DIALECT

include "dialects/PlanOp.td"
include "mlir/IR/OpBase.td"

def Graph_Dialect : Dialect {
  let name = "megaslide";
  let cppNamespace = "::megaslide::graph";
  let summary = "Tensor-level ops of a video Diffusion Transformer training step";
  let description = [{
    The `megaslide` dialect describes one training step of a Diffusion
    Transformer with tensor semantics: patch embedding, timestep and text
    conditioning, normalisation, adaLN modulation, global attention with 3D
    RoPE, 3D Deformable Slide Attention (3D-DSA), the flow-matching loss,
    the backward op of every forward op, and the AdamW update.

    Persistent model state (fp32 master weights, AdamW moments, frozen
    buffers) is declared by module-level `megaslide.param` symbols and
    accessed with `megaslide.load` / `megaslide.store`, like globals.
  }];
  let dependentDialects = ["::mlir::func::FuncDialect"];
}

/// Base class of every graph op. A graph op in a plan is a kernel, timed
/// by the roofline (PlanOp.td); most run as grid-stride elementwise or
/// reduction kernels on the cuda backend, the others say which family.
class Graph_Op<string mnemonic, list<Trait> traits = []>
    : Op<Graph_Dialect, mnemonic, traits>, PlanOp<"GRAPH"> {
  let costKind = "Device";
  let kernelFamily = "Elementwise";
}

#endif // MEGASLIDE_GRAPH_DIALECT
