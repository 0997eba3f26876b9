//===- DeviceBuffers.cpp - Device buffers of a scheduled step -------------===//

#include "megaslide/Analysis/DeviceBuffers.h"

#include "megaslide/Analysis/CostModel.h"

#include "dialects/Graph/GraphOps.h"
#include "dialects/Schedule/ScheduleOps.h"
#include "megaslide/runtime/plan/Liveness.h"

#include "mlir/IR/BuiltinTypes.h"
#include "llvm/Support/raw_ostream.h"

using namespace mlir;
using namespace megaslide;

namespace {

bool onDevice(Operation *op) {
  std::optional<exec::Stream> stream = schedule::getStream(op);
  return stream && (*stream == exec::Stream::Compute ||
                    *stream == exec::Stream::HostToDevice ||
                    *stream == exec::Stream::Comm);
}

} // namespace

Value megaslide::viewedValue(Operation *op) {
  if (isa<graph::ReshapeOp, schedule::AllGatherOp, schedule::ReduceScatterOp>(
          op))
    return op->getOperand(0);
  return {};
}

namespace {

llvm::StringRef categorize(Value v) {
  Operation *def = v.getDefiningOp();
  if (isa<schedule::FetchOp>(def))
    return "weights";
  if (auto copy = dyn_cast<schedule::HostToDeviceOp>(def))
    return isa<BlockArgument>(copy.getInput()) ? "data batch" : "checkpoints";
  if (def->hasAttr(schedule::kCheckpointAttrName))
    return "checkpoints";
  for (Operation *user : v.getUsers()) {
    // A job's gradient leaves through its reduce-scatter.
    if (isa<schedule::ReduceScatterOp>(user))
      return "gradients";
    if (isa<schedule::DeviceToHostOp>(user) &&
        llvm::any_of(user->getUsers(),
                     [](Operation *u) { return isa<schedule::HostAdamWOp>(u); }))
      return "gradients";
  }
  return "activations";
}

} // namespace

DevicePeak megaslide::findDevicePeak(const DeviceBuffers &buffers) {
  DevicePeak peak;
  std::vector<Slice> slices;
  slices.reserve(buffers.buffers.size());
  for (const DeviceBuffer &b : buffers.buffers)
    slices.push_back(b.slice);
  // The runtime counts a plan's live bytes the same way (Liveness.h).
  peak.live = exec::liveBytesAt(slices, buffers.numSteps);
  peak.bytes = -1;
  for (int64_t t = 0; t < buffers.numSteps; ++t)
    if (peak.live[t] > peak.bytes)
      peak.bytes = peak.live[t], peak.step = t;
  peak.bytes = std::max<int64_t>(peak.bytes, 0);
  for (const DeviceBuffer &b : buffers.buffers)
    if (b.slice.start <= peak.step && peak.step <= b.slice.end) {
      peak.buffers.push_back(&b);
      peak.byCategory[b.category.str()] += b.slice.size;
    }
  llvm::stable_sort(peak.buffers, [](auto *a, auto *b) {
    return a->slice.size > b->slice.size;
  });
  return peak;
}

uint64_t megaslide::workspaceBytes(Operation *op) {
  // 3D-DSA: the forward's log-sum-exp is its second result, a buffer like
  // any other, so the forward needs no scratch. The backward needs the fp32
  // row sums D = rowsum(dO * O), one per (batch, head, token), which its
  // dQ kernel writes and its dK/dV kernel reads; dK and dV are written once
  // by the key tiles that own them, with no accumulators
  // (docs/Dsa3dKernels.md).
  if (auto g = dyn_cast<graph::Dsa3dGradOp>(op)) {
    auto s = cast<RankedTensorType>(g.getQuery().getType()).getShape();
    return 4 * uint64_t(s[0] * s[1] * s[2]);
  }
  Value q;
  uint64_t rows = 0;
  if (auto a = dyn_cast<graph::AttentionOp>(op))
    q = a.getQuery(), rows = 1;
  else if (auto a = dyn_cast<graph::AttentionGradOp>(op))
    q = a.getQuery(), rows = 2;
  if (!q)
    return 0;
  auto shape = cast<RankedTensorType>(q.getType()).getShape();
  // [B, N, H, Dh] -> one fp32 per (batch, token, head) and statistic.
  return rows * 4 * shape[0] * shape[1] * shape[2];
}

std::string DeviceBuffer::describe() const {
  std::string s;
  llvm::raw_string_ostream os(s);
  os << category << " ";
  if (!value) {
    os << owner->getName().stripDialect();
  } else if (auto fetch = value.getDefiningOp<schedule::FetchOp>()) {
    os << fetch.getParam();
  } else {
    os << value.getDefiningOp()->getName().stripDialect() << " output";
  }
  if (layer)
    os << " of block " << *layer;
  if (value) {
    auto type = cast<RankedTensorType>(value.getType());
    os << " [";
    llvm::interleaveComma(type.getShape(), os);
    os << "] " << type.getElementType();
  }
  return s;
}

DeviceBuffers megaslide::collectDeviceBuffers(func::FuncOp step) {
  DeviceBuffers result;
  Block &body = step.getBody().front();
  // Sized up front: growing these tables rehashes and copies them, which
  // for a step of a million ops costs more than filling them.
  size_t numOps = body.getOperations().size();
  result.index.reserve(numOps);
  for (Operation &op : body)
    if (!isa<schedule::PackOp, schedule::BudgetCheckOp>(op))
      result.index[&op] = result.numSteps++;

  // Reshapes and the in-place collectives are views: they share their
  // input's buffer, whose value (the first of a chain of views, defined
  // before all of them) names it.
  DenseMap<Value, Value> viewed; // view -> the buffer's value
  SmallVector<Value> values;
  values.reserve(numOps);
  for (Operation &op : body) {
    if (!onDevice(&op))
      continue;
    for (Value r : op.getResults())
      values.push_back(r);
    // A view of a device value.
    if (Value input = viewedValue(&op))
      if (Operation *def = input.getDefiningOp(); def && onDevice(def)) {
        Value base = viewed.lookup(input);
        viewed[op.getResult(0)] = base ? base : input;
      }
  }
  SmallVector<std::pair<Operation *, uint64_t>> workspaces;
  for (Operation &op : body)
    if (uint64_t bytes = workspaceBytes(&op))
      workspaces.push_back({&op, bytes});
  result.bufferOf.reserve(values.size());
  result.buffers.reserve(values.size() + workspaces.size());
  for (Value v : values) {
    int64_t start = result.index[v.getDefiningOp()], end = start;
    for (Operation *user : v.getUsers())
      end = std::max(end, result.index.lookup(user));
    size_t buffer;
    if (Value base = viewed.lookup(v)) {
      // The base came earlier in program order: its buffer exists.
      buffer = result.bufferOf.lookup(base);
      Slice &s = result.buffers[buffer].slice;
      s.start = std::min(s.start, start);
      s.end = std::max(s.end, end);
    } else {
      buffer = result.buffers.size();
      DeviceBuffer b;
      b.value = v;
      b.owner = v.getDefiningOp();
      b.slice = {static_cast<int64_t>(tensorBytes(v.getType())), start, end};
      b.category = categorize(v);
      b.layer = graph::getLayer(b.owner);
      result.buffers.push_back(b);
    }
    result.bufferOf[v] = buffer;
  }
  for (auto [op, bytes] : workspaces) {
    DeviceBuffer b;
    b.owner = op;
    int64_t at = result.index[op];
    b.slice = {static_cast<int64_t>(bytes), at, at};
    b.category = "attention workspace";
    b.layer = graph::getLayer(op);
    result.buffers.push_back(b);
  }
  return result;
}
