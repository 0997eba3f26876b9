//===- ScheduleDialect.td - MegaSlide schedule dialect -----*- tablegen -*-===//
//
// Where values live and when things happen: residency of buffers, async
// transfers between host and device, streams and timepoints, device memory
// packing and budget guards. Compute stays expressed by graph ops; the
// schedule dialect wraps the movement and ordering around them.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_SCHEDULE_DIALECT
#define MEGASLIDE_SCHEDULE_DIALECT

include "dialects/PlanOp.td"
include "mlir/IR/OpBase.td"
include "mlir/IR/AttrTypeBase.td"
include "mlir/IR/EnumAttr.td"

def Schedule_Dialect : Dialect {
  let name = "msched";
  let cppNamespace = "::megaslide::schedule";
  let summary = "Residency, transfers, streams and memory plans of a training step";
  let description = [{
    The planning passes lower a `megaslide` training step in phases:
    residency (attributes), transfers (`msched.fetch`, `msched.h2d`,
    `msched.d2h`, `msched.host_adamw`), streams and timepoints
    (`msched.record`, `msched.wait`, `msched.join`), and memory
    (`msched.pack`, `msched.resource`, `msched.budget_check`). Each phase
    ends with a verify gate (`megaslide-verify-schedule`).
  }];
  let dependentDialects = ["::megaslide::graph::GraphDialect"];
  let useDefaultTypePrinterParser = 1;
}

/// Base class of every schedule op. The backends run a schedule op
/// themselves, launching no kernel; each op that reaches plans says how it
/// is timed (PlanOp.td).
class Schedule_Op<string mnemonic, list<Trait> traits = []>
    : Op<Schedule_Dialect, mnemonic, traits>, PlanOp<"SCHEDULE"> {
  let kernelFamily = "None";
}

def Schedule_Residency : I32EnumAttr<"Residency", "where a buffer lives", [
    I32EnumAttrCase<"host", 0>, I32EnumAttrCase<"pinned", 1>,
    I32EnumAttrCase<"device", 2>, I32EnumAttrCase<"transient", 3>]> {
  let cppNamespace = "::megaslide::schedule";
}

// A stream of the step: an i32 holding an exec::Stream, the enum the
// runtime defines (include/megaslide/runtime/plan/Stream.h: compute 0, h2d 1, d2h 2, host 3,
// comm 4)
// and the compiler shares rather than restates. `record` and `wait` print
// it by name (custom<Stream>); the discardable `msched.stream` of every
// scheduled op holds the same i32 (schedule::getStream).
def Schedule_Stream : TypedSignlessIntegerAttrBase<I32,
    "::megaslide::exec::Stream", "an execution queue"> {
  let predicate = And<[I32Attr.predicate,
      CPred<"::megaslide::exec::isStream("
            "::llvm::cast<::mlir::IntegerAttr>($_self).getInt())">]>;
  let convertFromStorage =
      "static_cast<::megaslide::exec::Stream>($_self.getInt())";
  let constBuilderCall =
      "$_builder.getI32IntegerAttr(static_cast<int32_t>($0))";
}

def Schedule_TimepointType : TypeDef<Schedule_Dialect, "Timepoint"> {
  let mnemonic = "timepoint";
  let summary = "a point on a stream that other streams can wait for";
  let description = [{
    Recorded after the work issued so far on one stream (a CUDA event).
  }];
}

#endif // MEGASLIDE_SCHEDULE_DIALECT
