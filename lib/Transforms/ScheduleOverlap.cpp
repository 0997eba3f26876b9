//===- ScheduleOverlap.cpp - Streams, prefetch and events -----------------===//

#include "megaslide/Transforms/Passes.h"
#include "megaslide/Transforms/Planning.h"

#include "megaslide/Pipelines/PipelineOptions.h"

#include "megaslide/Analysis/CostModel.h"
#include "megaslide/Support/Units.h"
#include "megaslide/runtime/plan/HostPool.h"
#include "megaslide/runtime/support/Packing.h"

#include "mlir/IR/Builders.h"

namespace megaslide {
#define GEN_PASS_DEF_SCHEDULEOVERLAPPASS
#include "megaslide/Transforms/Passes.h.inc"
} // namespace megaslide

#define DEBUG_TYPE "megaslide-schedule-overlap"

using namespace mlir;
using namespace megaslide;
using exec::Stream;
using schedule::getStream;

namespace {

std::optional<Stream> streamFor(Operation *op) {
  if (isa<schedule::FetchOp, schedule::HostToDeviceOp>(op))
    return Stream::HostToDevice;
  if (isa<schedule::DeviceToHostOp>(op))
    return Stream::DeviceToHost;
  if (isa<schedule::HostAdamWOp>(op) || op->hasTrait<OpTrait::IsTerminator>())
    return Stream::Host;
  if (isa<schedule::AllGatherOp, schedule::ReduceScatterOp>(op))
    return Stream::Comm;
  if (isa<graph::GraphDialect>(op->getDialect()))
    return Stream::Compute;
  return std::nullopt;
}

/// Issues the weight fetches and checkpoint reloads of each block
/// `distance` blocks early within its half of the step (forward: ascending
/// blocks; backward: descending), so they stream while earlier blocks
/// compute.
///
/// Linear in the ops of the step: every move is decided on the program
/// order before any move (a move invalidates the block's op order, and
/// asking for it after each move would renumber the whole step once per
/// fetch), then the moves are made in the same order.
void prefetch(func::FuncOp step, Operation *loss, int64_t distance,
              bool emitRemarks) {
  Block &body = step.getBody().front();
  for (bool backward : {false, true}) {
    // Blocks in the order this half computes them, with their first op.
    SmallVector<std::pair<int64_t, Operation *>> segments;
    DenseMap<int64_t, int64_t> segmentOf; // layer -> index in segments
    Operation *firstCompute = nullptr;
    for (Operation &op : body) {
      if (op.isBeforeInBlock(loss) == backward || &op == loss ||
          getStream(&op) != Stream::Compute)
        continue;
      if (!firstCompute)
        firstCompute = &op;
      std::optional<int64_t> layer = getLayer(&op);
      if (layer && segmentOf.try_emplace(*layer, segments.size()).second)
        segments.push_back({*layer, &op});
    }
    if (segments.empty())
      continue;
    SmallVector<Operation *> fetches;
    for (Operation &op : body)
      if (isa<schedule::FetchOp, schedule::HostToDeviceOp>(op) &&
          op.isBeforeInBlock(loss) != backward && getLayer(&op))
        fetches.push_back(&op);
    // Targets are compute ops, which never move, and each fetch moves at
    // most once, so the order before any move answers every question.
    SmallVector<std::pair<Operation *, Operation *>> moves; // fetch, target
    for (Operation *fetch : fetches) {
      auto it = segmentOf.find(*getLayer(fetch));
      if (it == segmentOf.end())
        continue;
      int64_t index = it->second;
      Operation *target = index - distance >= 0
                              ? segments[index - distance].second
                              : firstCompute;
      if (target->isBeforeInBlock(fetch))
        moves.push_back({fetch, target});
    }
    // A fetch's all-gather (a job of several ranks) goes with it.
    for (auto [fetch, target] : moves) {
      fetch->moveBefore(target);
      for (Operation *user : fetch->getUsers())
        if (isa<schedule::AllGatherOp>(user))
          user->moveBefore(target);
    }
    if (!emitRemarks)
      continue;
    // The first compute op after each transfer, in one backward walk.
    DenseMap<Operation *, Operation *> nextCompute;
    Operation *next = nullptr;
    for (Operation &op : llvm::reverse(body)) {
      if (isa<schedule::FetchOp, schedule::HostToDeviceOp>(op))
        nextCompute[&op] = next;
      if (getStream(&op) == Stream::Compute)
        next = &op;
    }
    // A transfer cannot overlap when nothing computes between it and its
    // first use; one remark per block and kind of transfer.
    DenseSet<std::pair<int64_t, int>> reported;
    for (Operation *fetch : fetches) {
      int64_t layer = *getLayer(fetch);
      bool weights = isa<schedule::FetchOp>(fetch);
      if (!reported.insert({layer, weights}).second)
        continue;
      Operation *op = nextCompute.lookup(fetch);
      auto reads = [&](Value v) {
        return llvm::is_contained(op->getOperands(), v) ||
               llvm::any_of(v.getUsers(), [&](Operation *user) {
                 return isa<schedule::AllGatherOp>(user) &&
                        llvm::is_contained(op->getOperands(),
                                           user->getResult(0));
               });
      };
      bool overlapped =
          op && !reads(fetch->getResult(0)) && getLayer(op) != layer;
      if (!overlapped)
        fetch->emitRemark()
            << (weights ? "weights" : "checkpoint reload") << " of block "
            << layer << " (" << (backward ? "backward" : "forward") << ") "
            << (weights ? "are" : "is")
            << " not prefetched ahead of " << (weights ? "their" : "its")
            << " use: "
            << (distance == 0 ? "prefetch-distance is 0"
                              : "no earlier compute in this half of the step");
    }
  }
}

/// Makes every cross-stream dependency explicit: a timepoint recorded
/// after the producer, waited for by the consumer's stream.
void insertEvents(func::FuncOp step) {
  DenseMap<Operation *, Value> recorded;
  DenseSet<std::pair<Value, int>> waited;
  Block &body = step.getBody().front();
  for (Operation &op : llvm::make_early_inc_range(body)) {
    std::optional<Stream> consumer = getStream(&op);
    if (!consumer)
      continue;
    for (Value v : op.getOperands()) {
      Operation *producer = v.getDefiningOp();
      if (!producer)
        continue;
      std::optional<Stream> source = getStream(producer);
      if (!source || *source == *consumer)
        continue;
      Value &tp = recorded[producer];
      if (!tp) {
        OpBuilder b(producer->getBlock(), ++Block::iterator(producer));
        tp = schedule::RecordOp::create(b, producer->getLoc(), *source);
      }
      if (!waited.insert({tp, static_cast<int>(*consumer)}).second)
        continue;
      OpBuilder b(&op);
      schedule::WaitOp::create(b, op.getLoc(), tp, *consumer);
    }
  }
}

} // namespace

LogicalResult megaslide::scheduleOverlap(ModuleOp module,
                                         int64_t prefetchDistance,
                                         int64_t buffers,
                                         int64_t gradientBuffers,
                                         bool emitRemarks) {
  FailureOr<func::FuncOp> step = getTrainStep(module);
  if (failed(step))
    return failure();
  Operation *loss = findLoss(*step);
  if (buffers < 1 || prefetchDistance < 0)
    return module.emitError() << "options 'buffers' (>= 1) and "
                                 "'prefetch-distance' (>= 0) are out of range";
  if (gradientBuffers < 1 || gradientBuffers > 64)
    return module.emitError() << "option 'gradient-buffers' is "
                              << gradientBuffers << "; it must be in [1, 64]";
  int64_t distance = std::min(prefetchDistance, buffers - 1);
  if (distance < prefetchDistance && emitRemarks)
    module.emitRemark() << "prefetch-distance " << prefetchDistance << " needs "
                        << prefetchDistance + 1 << " weight buffers; using "
                        << distance << " with buffers=" << buffers;

  // The attribute's name and its four values made once, not once per op.
  MLIRContext *context = module.getContext();
  StringAttr streamName = StringAttr::get(context, schedule::kStreamAttrName);
  IntegerAttr streamAttrs[exec::kNumStreams];
  for (Operation &op : step->getBody().front())
    if (std::optional<Stream> s = streamFor(&op)) {
      IntegerAttr &attr = streamAttrs[static_cast<int>(*s)];
      if (!attr)
        attr = schedule::getStreamAttr(context, *s);
      op.setAttr(streamName, attr);
    }
  if (loss)
    prefetch(*step, loss, distance, emitRemarks);
  insertEvents(*step);

  // Pinned staging: weight shards in flight, sized by the largest block,
  // and the gradient ring (exec::layoutHostPool, the same rule): runs of
  // one layer's gradient copies, each run in one of `gradientBuffers`
  // slots as large as the largest run. In a job of several ranks a copy
  // stages only its rank's shard (transferBytes, rank 0's: the largest),
  // as layoutHostPool lays it out (exec::hostValueBytes).
  DenseMap<int64_t, uint64_t> weights; // per (block, half)
  uint64_t largestWeights = 0, largestGrads = 0, run = 0;
  std::optional<std::optional<int64_t>> runLayer;
  for (Operation &op : step->getBody().front()) {
    std::optional<int64_t> layer = getLayer(&op);
    if (auto fetch = dyn_cast<schedule::FetchOp>(op); fetch && layer) {
      int64_t key = 2 * *layer + (loss && loss->isBeforeInBlock(&op));
      largestWeights =
          std::max(largestWeights, weights[key] += transferBytes(fetch));
    }
    auto out = dyn_cast<schedule::DeviceToHostOp>(op);
    if (!out || llvm::none_of(out->getUsers(), [](Operation *u) {
          return isa<schedule::HostAdamWOp>(u);
        }))
      continue;
    if (runLayer != layer)
      run = 0;
    runLayer = layer;
    run +=
        alignTo(std::max<int64_t>(transferBytes(out), 1), exec::kHostPoolAlign);
    largestGrads = std::max(largestGrads, run);
  }
  declareResource(module, "weight_staging", schedule::Residency::pinned,
                  (distance + 1) * largestWeights, "pinned staging");
  declareResource(module, "gradient_staging", schedule::Residency::pinned,
                  gradientBuffers * largestGrads, "pinned staging");
  module->setAttr(
      schedule::kGradientBuffersAttrName,
      IntegerAttr::get(IntegerType::get(context, 64), gradientBuffers));
  return success();
}

namespace {

struct ScheduleOverlapPass
    : megaslide::impl::ScheduleOverlapPassBase<ScheduleOverlapPass> {
  ScheduleOverlapPass() = default;
  ScheduleOverlapPass(const ScheduleOverlapPass &other)
      : ScheduleOverlapPassBase(other) {}

  PipelineOption<&PlanningOptions::prefetchDistance> prefetchDistance{*this};
  PipelineOption<&PlanningOptions::buffers> buffers{*this};
  PipelineOption<&PlanningOptions::gradientBuffers> gradientBuffers{*this};

  void runOnOperation() override {
    if (failed(scheduleOverlap(getOperation(), prefetchDistance, buffers,
                               gradientBuffers, /*emitRemarks=*/true)))
      signalPassFailure();
  }
};

} // namespace
