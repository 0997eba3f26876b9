//===- SchedulePolicies.td - Planning policies -------------*- tablegen -*-===//
//
// The choices of the planning passes' policy options. The passes record
// the choice on the module by its string; the bytes of host state each
// host-state policy costs per parameter, and what each case means, are
// beside the enums in SchedulePolicies.h.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_SCHEDULE_POLICIES
#define MEGASLIDE_SCHEDULE_POLICIES

include "mlir/IR/EnumAttr.td"

def Schedule_ActivationPolicy : I32EnumAttr<"ActivationPolicy",
    "how a block's activations survive until backward", [
    I32EnumAttrCase<"keep", 0>, I32EnumAttrCase<"recompute", 1>,
    I32EnumAttrCase<"offload", 2>,
    // Chooses one of the above per block; never recorded on a block.
    I32EnumAttrCase<"automatic", 3, "auto">]> {
  let cppNamespace = "::megaslide::schedule";
  let genSpecializedAttr = 0;
}

def Schedule_HostStatePolicy : I32EnumAttr<"HostStatePolicy",
    "what persistent state the host keeps", [
    I32EnumAttrCase<"master_moments", 0, "master-moments">,
    I32EnumAttrCase<"persistent_bf16", 1, "persistent-bf16">,
    I32EnumAttrCase<"bf16_moments", 2, "bf16-moments">,
    I32EnumAttrCase<"int8_moments", 3, "int8-moments">,
    I32EnumAttrCase<"factored_moments", 4, "factored-moments">]> {
  let cppNamespace = "::megaslide::schedule";
  let genSpecializedAttr = 0;
}

def Schedule_UpdatePolicy : I32EnumAttr<"UpdatePolicy",
    "when the host AdamW updates a parameter", [
    // Chooses one of the others by the host budget; never recorded.
    I32EnumAttrCase<"automatic", 0, "auto">,
    I32EnumAttrCase<"deferred", 1>, I32EnumAttrCase<"streaming", 2>]> {
  let cppNamespace = "::megaslide::schedule";
  let genSpecializedAttr = 0;
}

def Schedule_EmaPolicy : I32EnumAttr<"EmaPolicy",
    "whether and in which type the host keeps an EMA of the weights", [
    I32EnumAttrCase<"none", 0>, I32EnumAttrCase<"f32", 1>,
    I32EnumAttrCase<"bf16", 2>]> {
  let cppNamespace = "::megaslide::schedule";
  let genSpecializedAttr = 0;
}

#endif // MEGASLIDE_SCHEDULE_POLICIES
