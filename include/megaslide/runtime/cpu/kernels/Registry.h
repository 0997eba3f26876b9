//===- Registry.h - Where the cpu graph kernels are registered --*- C++ -*-===//
//
// Each kernel file adds its ops to the table findGraphKernel serves.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_KERNELS_REGISTRY_H
#define MEGASLIDE_RUNTIME_CPU_KERNELS_REGISTRY_H

#include "megaslide/runtime/cpu/GraphKernels.h"

namespace megaslide::cpu {

using GraphKernelTable = exec::OpTable<GraphKernel>;

/// linear*, norms, modulate/gate, activations, add, bias_add, cast, split,
/// concat, zeros (kernels/Dense.cpp).
void registerDenseKernels(GraphKernelTable &table);
/// patch_embed, patchify/unpatchify, timestep_embedding, embedding, rope3d,
/// attention, dsa3d*, flow_interpolate, flow_matching_loss
/// (kernels/Video.cpp).
void registerVideoKernels(GraphKernelTable &table);

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_KERNELS_REGISTRY_H
