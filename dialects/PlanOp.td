//===- PlanOp.td - How an execution plan carries an op -----*- tablegen -*-===//
//
// What the runtime knows of each graph and schedule op: whether execution
// plans carry it, how the planner and the sim backend time it, and which
// kernels the cuda backend launches for it. `megaslide-tblgen
// -gen-plan-ops` writes these fields of every op as the runtime's op
// vocabulary, include/megaslide/runtime/plan/Ops.def, which the runtime
// compiles without MLIR or TableGen (docs/AddingAnOp.md, step 5).
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_PLAN_OP
#define MEGASLIDE_PLAN_OP

/// Mixed into the base class of a dialect's ops. `kind` names the Ops.def
/// macro of its ops, MEGASLIDE_<kind>_OP.
class PlanOp<string kind> {
  string planOpKind = kind;
  // Why plans never carry the op; empty for an op they carry, by its
  // mnemonic, as the exec::OpCode named after its C++ class without `Op`.
  string notInPlans = "";
  // How the planner and the sim backend time the op (sim::CostKind, which
  // formula of sim::secondsFor): `Device` for a kernel (a roofline over its
  // FLOPs and bytes), `None` for an op that does no work, and the schedule
  // ops their own (`Fetch`, `HostToDevice`, `DeviceToHost`, `HostAdamW`,
  // `Collective`).
  string costKind = ?;
  // The kernels the cuda backend launches for the op (sim::KernelFamily),
  // which pick its efficiency in the hardware description
  // (docs/CostModel.md, "Kernel families"): `Gemm` (cuBLASLt),
  // `AttentionFwd`, `AttentionBwd`, `Dsa3dFwd`, `Dsa3dBwd`, `Dsa3dOffsets`,
  // `Elementwise` (the grid-stride elementwise and reduction kernels), or
  // `None` for an op that launches none (views, transfers, the host
  // optimizer, events).
  string kernelFamily = ?;
}

#endif // MEGASLIDE_PLAN_OP
