//===- ScheduleOps.td - MegaSlide schedule ops -------------*- tablegen -*-===//

#ifndef MEGASLIDE_SCHEDULE_OPS
#define MEGASLIDE_SCHEDULE_OPS

include "dialects/Schedule/ScheduleDialect.td"
include "dialects/Schedule/SchedulePolicies.td"
include "mlir/IR/SymbolInterfaces.td"
include "mlir/Interfaces/SideEffectInterfaces.td"
include "mlir/Interfaces/InferTypeOpInterface.td"

//===----------------------------------------------------------------------===//
// Resources
//===----------------------------------------------------------------------===//

def Schedule_ResourceOp : Schedule_Op<"resource", [Symbol]> {
  let summary = "declares a buffer pool that is not a tensor of the model";
  let notInPlans = "declared outside the step, for the memory reports";
  let description = [{
    The device arena, pinned staging buffers, the host pool of offloaded
    activation checkpoints, the data batch and the host allowance for the
    OS and runtime. `category` groups it in memory reports.

    ```mlir
    msched.resource @device_arena device size(1048576) category("arena")
    msched.resource @weight_staging pinned size(8388608) category("pinned staging")
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name, Schedule_Residency:$residency,
                       ConfinedAttr<I64Attr, [IntNonNegative]>:$size,
                       StrAttr:$category);
  let assemblyFormat = [{
    $sym_name $residency `size` `(` $size `)` `category` `(` $category `)` attr-dict
  }];
}

def Schedule_BudgetCheckOp : Schedule_Op<"budget_check"> {
  let summary = "runtime guard: the resource must fit the budget";
  let notInPlans = "the plan's `arena_budget_bytes`";
  let description = [{
    Placed before the first use of a resource; `megaslide-check-budget`
    places one for `@device_arena`. The exporter writes its budget into the
    execution plan (`arena_budget_bytes`), and the cuda backend refuses,
    before it allocates, a plan whose arena exceeds it, naming the arena
    and the budget (docs/ExecutionPlan.md).

    ```mlir
    msched.budget_check @device_arena budget(141000000000)
    ```
  }];
  let arguments = (ins FlatSymbolRefAttr:$resource,
                       ConfinedAttr<I64Attr, [IntPositive]>:$budget);
  let assemblyFormat = "$resource `budget` `(` $budget `)` attr-dict";
}

def Schedule_PackOp : Schedule_Op<"pack"> {
  let summary = "a device-memory packing problem and, once solved, its solution";
  let notInPlans = "the plan's `arena_bytes`, `alignment` and value offsets";
  let description = [{
    One slice per device buffer: `sizes[i]` bytes live from op index
    `starts[i]` to `ends[i]` (inclusive, in program order). The solver
    fills `offsets` (multiples of `alignment`) so that slices live at the
    same time never overlap, and `arena_size`, the planned device peak.

    ```mlir
    msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, 512>,
                 starts = array<i64: 0, 1>, ends = array<i64: 2, 3>,
                 offsets = array<i64: 0, 1024>, arena_size = 1536 : i64}
    ```
  }];
  let arguments = (ins ConfinedAttr<I64Attr, [IntPositive]>:$alignment,
                       DenseI64ArrayAttr:$sizes, DenseI64ArrayAttr:$starts,
                       DenseI64ArrayAttr:$ends,
                       OptionalAttr<DenseI64ArrayAttr>:$offsets,
                       OptionalAttr<I64Attr>:$arena_size);
  let assemblyFormat = "attr-dict";
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Transfers and host work
//===----------------------------------------------------------------------===//

def Schedule_FetchOp : Schedule_Op<"fetch", [
    DeclareOpInterfaceMethods<SymbolUserOpInterface>]> {
  let summary = "streams a parameter's working copy from host to device";
  let costKind = "Fetch";
  let description = [{
    Reads the persistent host tensor `param` (fp32 master, frozen buffer or
    persistent bf16 copy), converts it to the result's element type while
    staging it in pinned memory, and copies it to the device.

    ```mlir
    %w = msched.fetch @"blocks.0.attn1.to_q.weight" : tensor<64x64xbf16>
    ```

    `applies_update` (set by `megaslide-defer-updates` on the first fetch
    in the step of each parameter a deferred `msched.host_adamw` updates,
    or of its persistent bf16 copy): the fetch waits for that parameter's
    deferred update, which runs before it, so the step reads the updated
    weights.

    `ranks` (set by `megaslide-insert-transfers` in a job of several
    ranks): the host state is sharded over the ranks, so the fetch stages
    and copies only this rank's shard (`dist::shardRange`) into its part of
    the result; the `msched.all_gather` that follows fills the rest.
  }];
  let arguments = (ins FlatSymbolRefAttr:$param, UnitAttr:$applies_update,
                       OptionalAttr<ConfinedAttr<I64Attr, [IntMinValue<2>]>>:$ranks);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$param attr-dict `:` type($result)";
}

def Schedule_HostToDeviceOp : Schedule_Op<"h2d", [SameOperandsAndResultType]> {
  let summary = "copies a host tensor to the device";
  let costKind = "HostToDevice";
  let description = [{
    Used for the data batch and for reloading offloaded activation
    checkpoints.

    ```mlir
    %d = msched.h2d %h : tensor<1x16x64xbf16>
    ```
  }];
  let arguments = (ins AnyRankedTensor:$input);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
}

def Schedule_DeviceToHostOp : Schedule_Op<"d2h", [SameOperandsAndResultType]> {
  let summary = "copies a device tensor to the host";
  let costKind = "DeviceToHost";
  let description = [{
    Used for gradients on their way to the host optimizer, offloaded
    activation checkpoints and the loss.

    ```mlir
    %h = msched.d2h %g : tensor<64x64xbf16>
    ```

    `ranks` (a gradient in a job of several ranks, after its
    `msched.reduce_scatter`): only this rank's shard of the summed gradient
    is copied, for the host optimizer's shard of the parameter.
  }];
  let arguments = (ins AnyRankedTensor:$input,
                       OptionalAttr<ConfinedAttr<I64Attr, [IntMinValue<2>]>>:$ranks);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
}

def Schedule_HostAdamWOp : Schedule_Op<"host_adamw", [
    DeclareOpInterfaceMethods<SymbolUserOpInterface>]> {
  let summary = "AdamW update of one parameter's host state";
  let costKind = "HostAdamW";
  let description = [{
    Updates the fp32 master of `param` and its two moments (the
    `megaslide.param moment ... of @param` tensors) in place with the host
    gradient, as `megaslide.adamw` defines; refreshes a persistent bf16
    copy when the host-state policy keeps one.

    ```mlir
    msched.host_adamw @"blocks.0.attn1.to_q.weight", %g, %step {lr = 1.0e-05 : f64}
        : tensor<64x64xbf16>, tensor<i64>
    ```

    `deferred` (set by `megaslide-defer-updates`): the op retains the
    gradient on the host (summing its squared norm and whether it is
    finite) instead of updating; the update, with the step's global
    clipping factor, runs before the next step's first fetch of the
    parameter, the fetch marked `applies_update`.
  }];
  let arguments = (ins FlatSymbolRefAttr:$param, AnyRankedTensor:$grad,
                       0DTensorOf<[I64]>:$step,
                       DefaultValuedAttr<F64Attr, "1.0e-4">:$lr,
                       DefaultValuedAttr<F64Attr, "0.9">:$beta1,
                       DefaultValuedAttr<F64Attr, "0.999">:$beta2,
                       DefaultValuedAttr<F64Attr, "1.0e-8">:$eps,
                       DefaultValuedAttr<F64Attr, "0.0">:$weight_decay,
                       UnitAttr:$deferred);
  let assemblyFormat = [{
    $param `,` $grad `,` $step attr-dict `:` type($grad) `,` type($step)
  }];
}

//===----------------------------------------------------------------------===//
// Device collectives
//===----------------------------------------------------------------------===//

class Schedule_CollectiveOp<string mnemonic, string what>
    : Schedule_Op<mnemonic, [SameOperandsAndResultType]> {
  let summary = what;
  let costKind = "Collective";
  let arguments = (ins AnyRankedTensor:$input,
                       ConfinedAttr<I64Attr, [IntMinValue<2>]>:$ranks,
                       ConfinedAttr<I64Attr, [IntPositive]>:$nodes,
                       ConfinedAttr<I64Attr, [IntNonNegative]>:$send_bytes);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
  let hasVerifier = 1;
}

def Schedule_AllGatherOp : Schedule_CollectiveOp<"all_gather",
    "gathers every rank's shard of a device tensor, in place"> {
  let description = [{
    In a job of `ranks` ranks over `nodes` nodes, each rank holds its shard
    (`dist::shardRange`) of the tensor, written by a `msched.fetch` marked
    with `ranks`; after the all-gather (NCCL, a ring) every rank holds all
    of it. In place: the result is a view of the operand's device buffer,
    as a reshape's is. `send_bytes` is what each rank sends over its links:
    (ranks - 1) shards. Placed on the `comm` stream by
    `megaslide-schedule-overlap`.

    ```mlir
    %w = msched.fetch @"blocks.0.attn1.to_q.weight" {ranks = 8 : i64} : tensor<64x64xbf16>
    %all = msched.all_gather %w {ranks = 8 : i64, nodes = 1 : i64, send_bytes = 7168 : i64} : tensor<64x64xbf16>
    ```
  }];
}

def Schedule_ReduceScatterOp : Schedule_CollectiveOp<"reduce_scatter",
    "sums a device tensor over the ranks, each rank keeping its shard, in place"> {
  let description = [{
    A gradient of a job of `ranks` ranks over `nodes` nodes: after the
    reduce-scatter (NCCL, a ring) each rank's shard (`dist::shardRange`) of
    the result holds the sum over the ranks, which the following
    `msched.d2h` marked with `ranks` copies to the host optimizer of its
    shard. In place: the result is a view of the operand's device buffer.
    `send_bytes` is what each rank sends: (ranks - 1) shards. On the
    `comm` stream.

    ```mlir
    %sum = msched.reduce_scatter %g {ranks = 8 : i64, nodes = 1 : i64, send_bytes = 7168 : i64} : tensor<64x64xbf16>
    %h = msched.d2h %sum {ranks = 8 : i64} : tensor<64x64xbf16>
    ```
  }];
}

//===----------------------------------------------------------------------===//
// Timepoints
//===----------------------------------------------------------------------===//

def Schedule_RecordOp : Schedule_Op<"record"> {
  let summary = "records a timepoint after the work issued so far on a stream";
  let costKind = "None";
  let description = [{
    ```mlir
    %tp = msched.record h2d
    ```
  }];
  let arguments = (ins Schedule_Stream:$stream);
  let results = (outs Schedule_TimepointType:$timepoint);
  let assemblyFormat = "custom<Stream>($stream) attr-dict";
}

def Schedule_WaitOp : Schedule_Op<"wait"> {
  let summary = "makes a stream wait for a timepoint";
  let costKind = "None";
  let description = [{
    Work issued on `stream` after the wait starts after the timepoint.

    ```mlir
    msched.wait %tp compute
    ```
  }];
  let arguments = (ins Schedule_TimepointType:$timepoint,
                       Schedule_Stream:$stream);
  let assemblyFormat = "$timepoint custom<Stream>($stream) attr-dict";
}

def Schedule_JoinOp : Schedule_Op<"join", [Pure]> {
  let summary = "a timepoint reached when all given timepoints are";
  let notInPlans = "the events of the waits on it";
  let description = [{
    ```mlir
    %all = msched.join %a, %b
    ```
  }];
  let arguments = (ins Variadic<Schedule_TimepointType>:$timepoints);
  let results = (outs Schedule_TimepointType:$result);
  let assemblyFormat = "$timepoints attr-dict";
  let hasVerifier = 1;
}

#endif // MEGASLIDE_SCHEDULE_OPS
