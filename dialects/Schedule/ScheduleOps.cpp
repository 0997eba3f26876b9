//===- ScheduleOps.cpp - MegaSlide schedule op verifiers ------------------===//

#include "dialects/Schedule/ScheduleOps.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/OpImplementation.h"

#include <map>
#include <queue>

using namespace mlir;
using namespace megaslide;
using namespace megaslide::schedule;

LogicalResult PackOp::verify() {
  ArrayRef<int64_t> sizes = getSizes(), starts = getStarts(), ends = getEnds();
  size_t n = sizes.size();
  if (starts.size() != n || ends.size() != n)
    return emitOpError() << "needs one start and one end per slice: " << n
                         << " sizes, " << starts.size() << " starts, "
                         << ends.size() << " ends";
  for (size_t i = 0; i < n; ++i) {
    if (sizes[i] < 0)
      return emitOpError() << "slice " << i << " has negative size "
                           << sizes[i];
    if (starts[i] < 0 || starts[i] > ends[i])
      return emitOpError() << "slice " << i << " has an empty lifetime ["
                           << starts[i] << ", " << ends[i] << "]";
  }
  if (!getOffsets())
    return success();
  ArrayRef<int64_t> offsets = *getOffsets();
  if (offsets.size() != n)
    return emitOpError() << "has " << offsets.size() << " offsets for " << n
                         << " slices";
  if (!getArenaSize())
    return emitOpError() << "a solved pack needs 'arena_size'";
  int64_t arena = static_cast<int64_t>(*getArenaSize());
  int64_t align = static_cast<int64_t>(getAlignment());
  for (size_t i = 0; i < n; ++i) {
    if (offsets[i] < 0 || offsets[i] % align != 0)
      return emitOpError() << "slice " << i << " offset " << offsets[i]
                           << " is not a non-negative multiple of the "
                              "alignment "
                           << align;
    if (offsets[i] + sizes[i] > arena)
      return emitOpError() << "slice " << i << " ends at byte "
                           << offsets[i] + sizes[i] << ", past the arena of "
                           << arena << " bytes";
  }

  // Sweep over time; slices alive together must not share bytes. Active
  // slices are disjoint, so checking the address neighbours suffices.
  std::vector<size_t> order;
  for (size_t i = 0; i < n; ++i)
    if (sizes[i] > 0)
      order.push_back(i);
  llvm::sort(order, [&](size_t a, size_t b) { return starts[a] < starts[b]; });
  std::map<int64_t, size_t> active; // offset -> slice
  using Expiry = std::pair<int64_t, size_t>;
  std::priority_queue<Expiry, std::vector<Expiry>, std::greater<Expiry>> expiry;
  for (size_t i : order) {
    while (!expiry.empty() && expiry.top().first < starts[i]) {
      active.erase(offsets[expiry.top().second]);
      expiry.pop();
    }
    auto next = active.lower_bound(offsets[i]);
    auto conflict = [&](size_t j) {
      return emitOpError() << "slices " << j << " and " << i
                           << " are live together but overlap in bytes ["
                           << std::max(offsets[i], offsets[j]) << ", "
                           << std::min(offsets[i] + sizes[i],
                                       offsets[j] + sizes[j])
                           << ")";
    };
    if (next != active.end() && next->first < offsets[i] + sizes[i])
      return conflict(next->second);
    if (next != active.begin()) {
      size_t prev = std::prev(next)->second;
      if (offsets[prev] + sizes[prev] > offsets[i])
        return conflict(prev);
    }
    active[offsets[i]] = i;
    expiry.push({ends[i], i});
  }
  return success();
}

/// Resolves `param` to a megaslide.param and checks that `type` is its
/// shape (any floating element type: the working copy may be narrower).
static FailureOr<graph::ParamOp>
lookupParam(Operation *op, FlatSymbolRefAttr param, RankedTensorType type,
            SymbolTableCollection &symbolTable) {
  auto decl = symbolTable.lookupNearestSymbolFrom<graph::ParamOp>(op, param);
  if (!decl)
    return op->emitOpError()
           << "'" << param.getValue() << "' does not name a megaslide.param";
  if (decl.getTensorType().getShape() != type.getShape())
    return op->emitOpError()
           << "type " << type << " does not have the shape of "
           << decl.getType() << " declared by '" << param.getValue() << "'";
  return decl;
}

LogicalResult FetchOp::verifySymbolUses(SymbolTableCollection &symbolTable) {
  FailureOr<graph::ParamOp> decl =
      lookupParam(*this, getParamAttr(), getType(), symbolTable);
  if (failed(decl))
    return failure();
  graph::ParamRole role = decl->getRole();
  if (role != graph::ParamRole::master && role != graph::ParamRole::frozen &&
      role != graph::ParamRole::weight)
    return emitOpError() << "can only fetch weights, not a '"
                         << graph::stringifyParamRole(role) << "' tensor";
  if (!isa<FloatType>(getType().getElementType()))
    return emitOpError() << "fetches floating-point working copies, got "
                         << getType().getElementType();
  return success();
}

LogicalResult
HostAdamWOp::verifySymbolUses(SymbolTableCollection &symbolTable) {
  FailureOr<graph::ParamOp> decl =
      lookupParam(*this, getParamAttr(),
                  cast<RankedTensorType>(getGrad().getType()), symbolTable);
  if (failed(decl))
    return failure();
  if (decl->getRole() != graph::ParamRole::master)
    return emitOpError() << "updates trainable parameters; '" << getParam()
                         << "' is a '"
                         << graph::stringifyParamRole(decl->getRole())
                         << "' tensor";
  return success();
}

/// A job of `ranks` ranks over `nodes` nodes has the same GPUs on each.
template <typename Op> static LogicalResult verifyCollective(Op op) {
  int64_t ranks = op.getRanks(), nodes = op.getNodes();
  if (nodes > ranks || ranks % nodes != 0)
    return op.emitOpError() << "has " << ranks << " ranks over " << nodes
                            << " nodes; each node must run the same number "
                               "of ranks";
  return success();
}

LogicalResult AllGatherOp::verify() { return verifyCollective(*this); }
LogicalResult ReduceScatterOp::verify() { return verifyCollective(*this); }

LogicalResult JoinOp::verify() {
  if (getTimepoints().empty())
    return emitOpError() << "needs at least one timepoint";
  return success();
}

std::optional<exec::Stream> schedule::getStream(Operation *op) {
  auto attr = op->getAttrOfType<IntegerAttr>(kStreamAttrName);
  if (!attr || !attr.getType().isSignlessInteger(32) ||
      !exec::isStream(attr.getInt()))
    return std::nullopt;
  return static_cast<exec::Stream>(attr.getInt());
}

IntegerAttr schedule::getStreamAttr(MLIRContext *context, exec::Stream stream) {
  return IntegerAttr::get(IntegerType::get(context, 32),
                          static_cast<int32_t>(stream));
}

/// custom<Stream>: a stream by its name (exec::streamName).
static ParseResult parseStream(OpAsmParser &parser, IntegerAttr &stream) {
  SMLoc loc = parser.getCurrentLocation();
  std::string name;
  if (failed(parser.parseKeywordOrString(&name)))
    return failure();
  std::optional<exec::Stream> parsed = exec::parseStream(name);
  if (!parsed)
    return parser.emitError(loc) << "expected a stream (compute, h2d, d2h or "
                                    "host), got '"
                                 << name << "'";
  stream = getStreamAttr(parser.getContext(), *parsed);
  return success();
}

static void printStream(OpAsmPrinter &printer, Operation *,
                        IntegerAttr stream) {
  printer << exec::streamName(static_cast<exec::Stream>(stream.getInt()));
}

#define GET_OP_CLASSES
#include "dialects/Schedule/ScheduleOps.cpp.inc"
