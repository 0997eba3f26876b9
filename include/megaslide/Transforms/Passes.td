//===- Passes.td - MegaSlide planning passes ---------------*- tablegen -*-===//
//
// The passes that turn a `megaslide` training step into a schedule: where
// each value lives, what is transferred when, on which stream, at which
// device offset, and whether it fits. The order is the pipeline's
// (lib/Pipelines/Pipelines.cpp).
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TRANSFORMS_PASSES
#define MEGASLIDE_TRANSFORMS_PASSES

include "mlir/Pass/PassBase.td"

def RewriteAttentionToDsaPass : Pass<"megaslide-rewrite-attention-to-dsa",
                                     "mlir::ModuleOp"> {
  let summary = "Rewrites global self-attention into 3D Deformable Slide Attention";
  let description = [{
    Replaces every `megaslide.attention` whose queries and keys carry 3D
    RoPE over a token grid (self-attention over video tokens) by
    `megaslide.dsa3d_offsets` + `megaslide.dsa3d`, and its
    `megaslide.attention_grad` by `megaslide.dsa3d_grad` reading the
    forward's output and fp32 log-sum-exp [B, H, N]. Cross-attention
    to text is left alone. A remark says why an attention is kept global
    (e.g. a grid smaller than the window).

    Its planning options are declared in the pass, from
    include/megaslide/Pipelines/PipelineOptions.def (listed in
    docs/reference/PipelineOptions.md).
  }];
  let dependentDialects = ["megaslide::graph::GraphDialect"];
  let options = [
    ListOption<"layers", "layers", "int64_t",
               "Blocks to rewrite (default: all)">,
  ];
}

def PlanResidencyPass : Pass<"megaslide-plan-residency", "mlir::ModuleOp"> {
  let summary = "Gives every persistent tensor and value a home";
  let description = [{
    Applies the host-state policy: persistent state stays on the host
    (`master-moments`: fp32 master + AdamW m + v, 12 B/param;
    `persistent-bf16`: plus a bf16 working copy, 14 B/param;
    `bf16-moments`: moments in bf16, 8 B/param; `int8-moments`: block-wise
    8-bit moments, 6 B/param + 8 B per 256; `factored-moments`: bf16 m and
    a factored v of every matrix, ~6 B/param; the last two for a job of one
    rank, their moment declarations kept fp32 and their host bytes counted
    by schedule::momentBytes). Records the policy on the
    module and declares the host resources that are not tensors of the
    model (data batch, OS and runtime allowance).

    Its planning options are declared in the pass, from
    include/megaslide/Pipelines/PipelineOptions.def (listed in
    docs/reference/PipelineOptions.md).
  }];
  let dependentDialects = ["megaslide::schedule::ScheduleDialect"];
}

def PlanActivationsPass : Pass<"megaslide-plan-activations",
                               "mlir::ModuleOp"> {
  let summary = "Chooses, per block, how activations survive until backward";
  let description = [{
    `keep`: every activation stays on device until its gradient use.
    `recompute`: only the block input (the checkpoint) is kept on device;
    the block's forward is cloned before its backward and recomputed.
    `offload`: like recompute, with the checkpoint moved to host memory
    between forward and backward. `auto` keeps everything when that fits
    `gpu-mem`, else recomputes, and offloads the checkpoints of as many
    leading blocks as needed to fit (they live longest), measuring each
    choice with `megaslide-activation-trial-pipeline` on a copy.

    Its planning options are declared in the pass, from
    include/megaslide/Pipelines/PipelineOptions.def (listed in
    docs/reference/PipelineOptions.md).
  }];
  let dependentDialects = ["megaslide::schedule::ScheduleDialect"];
}

def InsertTransfersPass : Pass<"megaslide-insert-transfers",
                               "mlir::ModuleOp"> {
  let summary = "Makes every host/device crossing an explicit transfer";
  let description = [{
    Each device use of host state becomes a `msched.fetch` (cast into
    pinned staging, then copied); the batch is copied in with
    `msched.h2d`; gradients leave per layer with `msched.d2h`, and each
    layer's `msched.host_adamw` is placed right after its gradient lands,
    overlapping the rest of backward. Offloaded checkpoints get a
    `msched.d2h` after their forward and a `msched.h2d` before the
    recomputation.

    A job of several ranks (`gpus-per-node` x `nodes` > 1; the host state
    sharded over them) copies 1/N: every fetch, marked `ranks`, copies its
    rank's shard and is followed by a `msched.all_gather`; every gradient
    is `msched.reduce_scatter`ed before its `msched.d2h`, marked `ranks`,
    copies its rank's shard of the sum. The module records the job
    (`msched.gpus_per_node`, `msched.nodes`).
  }];
  let dependentDialects = ["megaslide::schedule::ScheduleDialect"];
}

def ScheduleOverlapPass : Pass<"megaslide-schedule-overlap", "mlir::ModuleOp"> {
  let summary = "Assigns streams, prefetches weight shards and adds events";
  let description = [{
    Compute runs on the compute stream, host-to-device copies on `h2d`,
    device-to-host copies on `d2h`, the optimizer on `host`, the device
    collectives of a job of several ranks on `comm`. Weight
    fetches of block `i` (with their all-gathers) are issued `prefetch-distance` blocks ahead
    (bounded by `buffers` - 1 shards in flight), so transfers hide behind
    compute; every cross-stream dependency becomes `msched.record` +
    `msched.wait`. A remark names each transfer that cannot be overlapped
    and why.

    Its planning options are declared in the pass, from
    include/megaslide/Pipelines/PipelineOptions.def (listed in
    docs/reference/PipelineOptions.md).
  }];
  let dependentDialects = ["megaslide::schedule::ScheduleDialect"];
}

def DeferUpdatesPass : Pass<"megaslide-defer-updates", "mlir::ModuleOp"> {
  let summary = "Chooses when the host AdamW updates and sizes the recipe's host buffers";
  let description = [{
    Decides the update mode (`update`): `deferred` retains every gradient
    on the host until backward ends, so the step can clip by the global
    norm and skip on a non-finite gradient, and updates each parameter
    before the next step's first fetch of it (overlapping the next
    forward); `streaming` updates each parameter as soon as its gradient
    lands (overlapping the backward). `auto` defers when `host-mem` holds
    the retained gradients and the EMA besides everything declared so
    far, and otherwise streams, with a remark giving the bytes and what
    would fit. `grad-accum` > 1 accumulates gradients in an fp32 host
    buffer and needs the deferred update (`streaming` is an error).

    Deferred: every `msched.host_adamw` gets `deferred` and the first
    `msched.fetch` in the step of each updated parameter (or of its
    persistent bf16 copy) gets `applies_update`. Declares the host
    buffers the recipe needs (`retained_gradients` in the gradients'
    type, or `gradient_accumulator` in fp32; `ema_weights`), records the
    choices on the module (`msched.update`, `msched.grad_accum`,
    `msched.ema`) and changes no program order.

    Its planning options are declared in the pass, from
    include/megaslide/Pipelines/PipelineOptions.def (listed in
    docs/reference/PipelineOptions.md).
  }];
  let dependentDialects = ["megaslide::schedule::ScheduleDialect"];
}

def PlanMemoryPass : Pass<"megaslide-plan-memory", "mlir::ModuleOp"> {
  let summary = "Packs every device buffer into one arena at static offsets";
  let description = [{
    Computes the live interval of every device value (and of attention
    workspaces) in program order, reifies the packing problem as a
    `msched.pack` op, solves it (best-fit linear scan, aligned slices),
    and annotates each defining op with `msched.offsets`. The arena size
    is the planned device peak.
  }];
  let dependentDialects = ["megaslide::schedule::ScheduleDialect"];
  let options = [
    Option<"alignment", "alignment", "int64_t", "256",
           "Byte alignment of every slice">,
  ];
}

def CheckBudgetPass : Pass<"megaslide-check-budget", "mlir::ModuleOp"> {
  let summary = "Fails when the plan exceeds the device or host budget";
  let description = [{
    Compares the arena (device) and the host total (persistent state,
    staging, offloaded checkpoints, batch, allowance) to the budgets. Over
    budget: an error on the largest consumer with notes naming the largest
    live buffers and what would make it fit. With `nvme-drives` > 0 and
    the host over budget, first spills the set of tierable roles (AdamW
    moments, EMA) that fits moving the fewest bytes per step to the NVMe
    tier, recorded as `msched.host_tier` (roles and the RAM window) for the
    exporter's `host_tier`. Within budget: inserts an
    `msched.budget_check` of the arena, whose budget the exporter carries
    into the execution plan for the cuda backend's device guard.

    Its planning options are declared in the pass, from
    include/megaslide/Pipelines/PipelineOptions.def (listed in
    docs/reference/PipelineOptions.md).
  }];
  let dependentDialects = ["megaslide::schedule::ScheduleDialect"];
}

def VerifySchedulePass : Pass<"megaslide-verify-schedule", "mlir::ModuleOp"> {
  let dependentDialects = ["megaslide::schedule::ScheduleDialect"];
  let summary = "Verify gate: checks the invariants a planning phase promises";
  let description = [{
    `transfers`: no graph op reads host state directly (no
    `megaslide.load`, `megaslide.store`, `megaslide.adamw` left in the
    step). `streams`: every op of the step has a stream. `memory`: every
    device value has an offset inside the arena.
  }];
  let options = [
    Option<"phase", "phase", "std::string", "\"memory\"",
           "transfers | streams | memory">,
  ];
}

def ReportBytesMovedPass : Pass<"megaslide-report-bytes-moved",
                                "mlir::ModuleOp"> {
  let summary = "Reports the bytes each transformer block moves over PCIe";
  let description = [{
    Runs on a step that has its transfers (after
    `megaslide-insert-transfers`; in `megaslide-pipeline` with
    `report-bytes-moved=true`, after the memory phase) and changes nothing.
    Emits one remark per transformer block (per `megaslide.layer` value),
    on the block's first transfer, and one for the transfers outside the
    blocks (embeddings, head, data batch, loss): the bytes copied
    host->device (`msched.fetch` + `msched.h2d`) and device->host
    (`msched.d2h`), and how many transfers carry them. Bytes are counted
    as the cost model counts them (`costInputsOf`: result bytes of the
    transfer). For `megaslide-105b` at 81x720x1280, where `auto` offloads
    block 3's checkpoint and recomputes the block:

    ```
    remark: block 3 moves 9.91 GB (9.23 GiB) host->device in 55 transfers, 5.89 GB (5.48 GiB) device->host in 28 transfers
    ```

    A block (or the group outside the blocks) moving fewer than
    `min-bytes` in both directions together is not reported.
    docs/AddingAPass.md walks through this pass as the example of adding
    one.
  }];
  let dependentDialects = ["megaslide::schedule::ScheduleDialect"];
  let options = [
    Option<"minBytes", "min-bytes", "::megaslide::ByteSize", "\"0\"",
           "Skip blocks that move fewer bytes than this, both directions "
           "together (e.g. 1GB, 512MiB)">,
  ];
  let statistics = [
    Statistic<"hostToDeviceBytes", "host-to-device-bytes",
              "Bytes copied host->device per step">,
    Statistic<"deviceToHostBytes", "device-to-host-bytes",
              "Bytes copied device->host per step">,
    Statistic<"numTransfers", "transfers", "Transfers in the step">,
  ];
}

#endif // MEGASLIDE_TRANSFORMS_PASSES
