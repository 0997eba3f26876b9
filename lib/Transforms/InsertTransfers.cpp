//===- InsertTransfers.cpp - Explicit host/device crossings ---------------===//

#include "megaslide/Transforms/Passes.h"
#include "megaslide/Transforms/Planning.h"

#include "megaslide/Analysis/CostModel.h"
#include "megaslide/Pipelines/PipelineOptions.h"

#include "mlir/IR/Builders.h"

namespace megaslide {
#define GEN_PASS_DEF_INSERTTRANSFERSPASS
#include "megaslide/Transforms/Passes.h.inc"
} // namespace megaslide

#define DEBUG_TYPE "megaslide-insert-transfers"

using namespace mlir;
using namespace megaslide;
using namespace megaslide::graph;

namespace {

void copyLayer(Operation *from, Operation *to) {
  if (Attribute layer = from->getAttr(kLayerAttrName))
    to->setAttr(kLayerAttrName, layer);
}

bool isDeviceCompute(Operation *op) {
  return isa<GraphDialect>(op->getDialect()) &&
         !isa<AdamWOp, LoadOp, StoreOp>(op);
}

/// The batch arrives in pinned memory and is copied in at the start.
void copyInBatch(func::FuncOp step) {
  Block &body = step.getBody().front();
  OpBuilder b(&body, body.begin());
  for (BlockArgument arg : body.getArguments()) {
    if (llvm::none_of(arg.getUsers(), isDeviceCompute))
      continue;
    auto copy = schedule::HostToDeviceOp::create(b, arg.getLoc(), arg);
    arg.replaceUsesWithIf(
        copy, [](OpOperand &use) { return isDeviceCompute(use.getOwner()); });
  }
}

/// load + cast of host state becomes one fetch (cast in pinned staging).
LogicalResult fetchParameters(ModuleOp module, func::FuncOp step) {
  bool persistentCopies =
      module->getAttrOfType<StringAttr>(kHostStatePolicyAttr) &&
      module->getAttrOfType<StringAttr>(kHostStatePolicyAttr).getValue() ==
          schedule::stringifyEnum(schedule::HostStatePolicy::persistent_bf16);
  SymbolTable symbols(module);
  for (auto load : llvm::make_early_inc_range(step.getOps<LoadOp>())) {
    auto param = symbols.lookup<ParamOp>(load.getParam());
    if (param.getRole() == ParamRole::moment)
      continue; // read by the optimizer, which moves to the host
    for (OpOperand &use : llvm::make_early_inc_range(load->getUses())) {
      Operation *user = use.getOwner();
      if (!isDeviceCompute(user))
        continue;
      OpBuilder b(user);
      auto cast = dyn_cast<CastOp>(user);
      Type type = cast ? cast.getType() : load.getType();
      std::string source = param.getSymName().str();
      if (persistentCopies && param.getRole() == ParamRole::master &&
          mlir::getElementTypeOrSelf(type).isBF16())
        source += ".bf16";
      auto fetch = schedule::FetchOp::create(b, load.getLoc(), type, source,
                                             /*applies_update=*/false,
                                             /*ranks=*/nullptr);
      copyLayer(user, fetch);
      if (cast) {
        cast.replaceAllUsesWith(fetch.getResult());
        cast.erase();
      } else {
        use.set(fetch);
      }
    }
    if (load->use_empty())
      load.erase();
  }
  return success();
}

/// Each AdamW moves to the host: the gradient leaves right after it is
/// produced and the update follows at once, overlapping the rest of the
/// backward.
LogicalResult moveOptimizerToHost(func::FuncOp step) {
  DenseMap<Operation *, Operation *> lastAfter; // grad producer -> last op
  Block &body = step.getBody().front();
  for (auto adamw : llvm::make_early_inc_range(step.getOps<AdamWOp>())) {
    auto master = adamw.getParam().getDefiningOp<LoadOp>();
    if (!master)
      return adamw.emitOpError()
             << "updates a value that is not a loaded megaslide.param; the "
                "host optimizer needs the parameter's symbol";
    Value grad = adamw.getGrad();
    Operation *producer = grad.getDefiningOp();
    Operation *anchor = producer ? lastAfter.lookup(producer) : nullptr;
    if (!anchor)
      anchor = producer;
    OpBuilder b(step.getContext());
    if (anchor)
      b.setInsertionPointAfter(anchor);
    else
      b.setInsertionPointToStart(&body);
    auto out = schedule::DeviceToHostOp::create(b, adamw.getLoc(), grad,
                                                /*ranks=*/nullptr);
    auto update = schedule::HostAdamWOp::create(
        b, adamw.getLoc(), master.getParamAttr(), out, adamw.getStep(),
        adamw.getLrAttr(), adamw.getBeta1Attr(), adamw.getBeta2Attr(),
        adamw.getEpsAttr(), adamw.getWeightDecayAttr());
    copyLayer(adamw, out);
    copyLayer(adamw, update);
    if (producer)
      lastAfter[producer] = update;

    SmallVector<Operation *> dead(adamw->getUsers().begin(),
                                  adamw->getUsers().end()); // the stores
    for (Operation *store : dead)
      store->erase();
    SmallVector<Operation *> loads;
    for (Value v : {adamw.getParam(), adamw.getM(), adamw.getV()})
      if (auto load = v.getDefiningOp<LoadOp>())
        loads.push_back(load);
    adamw.erase();
    for (Operation *load : loads)
      if (load->use_empty())
        load->erase();
  }
  return success();
}

/// A job of several ranks shards every parameter's host state over them:
/// each fetch copies only its rank's shard and the ranks all-gather the
/// rest on the device; each gradient is reduce-scattered on the device and
/// each rank copies only its shard of the sum to its host optimizer.
void insertCollectives(ModuleOp module, func::FuncOp step, JobSize job) {
  MLIRContext *context = module.getContext();
  auto i64 = [&](int64_t v) {
    return IntegerAttr::get(IntegerType::get(context, 64), v);
  };
  module->setAttr(kGpusPerNodeAttr, i64(job.gpusPerNode));
  module->setAttr(kNodesAttr, i64(job.nodes));
  int64_t ranks = job.ranks();
  auto sendBytes = [&](Type type) {
    return i64((ranks - 1) * static_cast<int64_t>(shardBytes(type, ranks)));
  };
  for (auto fetch :
       llvm::make_early_inc_range(step.getOps<schedule::FetchOp>())) {
    fetch.setRanksAttr(i64(ranks));
    OpBuilder b(fetch->getBlock(), ++Block::iterator(fetch));
    auto gather = schedule::AllGatherOp::create(
        b, fetch.getLoc(), fetch.getType(), fetch, i64(ranks), i64(job.nodes),
        sendBytes(fetch.getType()));
    copyLayer(fetch, gather);
    fetch.getResult().replaceAllUsesExcept(gather, gather);
  }
  for (auto update : step.getOps<schedule::HostAdamWOp>()) {
    auto out = update.getGrad().getDefiningOp<schedule::DeviceToHostOp>();
    if (!out || out.getRanks())
      continue;
    OpBuilder b(out);
    Value grad = out.getInput();
    auto sum = schedule::ReduceScatterOp::create(
        b, out.getLoc(), grad.getType(), grad, i64(ranks), i64(job.nodes),
        sendBytes(grad.getType()));
    copyLayer(out, sum);
    out.getInputMutable().assign(sum);
    out.setRanksAttr(i64(ranks));
  }
}

} // namespace

LogicalResult megaslide::insertTransfers(ModuleOp module, JobSize job) {
  FailureOr<func::FuncOp> step = getTrainStep(module);
  if (failed(step))
    return failure();
  copyInBatch(*step);
  if (failed(fetchParameters(module, *step)))
    return failure();
  if (failed(moveOptimizerToHost(*step)))
    return failure();
  if (job.ranks() > 1)
    insertCollectives(module, *step, job);
  // The loss is read on the host.
  auto ret = cast<func::ReturnOp>(step->getBody().front().getTerminator());
  OpBuilder b(ret);
  for (OpOperand &operand : ret->getOpOperands())
    operand.set(schedule::DeviceToHostOp::create(b, ret.getLoc(), operand.get(),
                                                 /*ranks=*/nullptr));
  return success();
}

namespace {

struct InsertTransfersPass
    : megaslide::impl::InsertTransfersPassBase<InsertTransfersPass> {
  InsertTransfersPass() = default;
  InsertTransfersPass(const InsertTransfersPass &other)
      : InsertTransfersPassBase(other) {}

  PipelineOption<&PlanningOptions::gpusPerNode> gpusPerNode{*this};
  PipelineOption<&PlanningOptions::nodes> nodes{*this};

  void runOnOperation() override {
    ModuleOp module = getOperation();
    for (auto [name, value] : {std::pair{"gpus-per-node", int64_t(gpusPerNode)},
                               std::pair{"nodes", int64_t(nodes)}})
      if (value < 1) {
        module.emitError() << "option '" << name << "' is " << value
                           << "; it must be at least 1";
        return signalPassFailure();
      }
    if (failed(insertTransfers(module, {gpusPerNode, nodes})))
      signalPassFailure();
  }
};

} // namespace
