//===- PlanFlags.cpp - Command-line flags shared by the tools -------------===//

#include "PlanFlags.h"

#include "HardwareFlag.h"

#include "plan/HyperParameters.h"

using namespace llvm;
using namespace megaslide;

cl::OptionCategory tools::planCategory("Model, video and planning options");

namespace {
using tools::planCategory;

// Not cl::Required: megaslide-run --plan FILE needs no model, and each tool
// says what to give instead of cl's "must be specified at least once".
cl::opt<std::string> model("model", cl::cat(planCategory),
                           cl::desc("Preset name or path to a JSON config"),
                           cl::value_desc("NAME|FILE"));
cl::opt<int64_t> frames("frames", cl::cat(planCategory),
                        cl::desc("Video frames (pixels unless --latent)"));
cl::opt<int64_t> height("height", cl::cat(planCategory),
                        cl::desc("Video height"));
cl::opt<int64_t> width("width", cl::cat(planCategory), cl::desc("Video width"));
cl::opt<bool> latent("latent", cl::cat(planCategory),
                     cl::desc("Sizes are in latent elements, not pixels"));
cl::opt<int64_t> batch("batch", cl::init(1), cl::cat(planCategory),
                       cl::desc("Samples per training step"));
cl::opt<int64_t> textLen("text-len", cl::init(0), cl::cat(planCategory),
                         cl::desc("Text tokens per prompt (default: config)"));
cl::opt<double> learningRate(
    "lr", cl::cat(planCategory),
    cl::desc("AdamW learning rate (default: the config's learning_rate, "
             "else 1e-5)"));
cl::opt<double> weightDecay("weight-decay", cl::init(0.0),
                            cl::cat(planCategory),
                            cl::desc("AdamW decoupled weight decay"));
cl::opt<std::string> gpuMem("gpu-mem", cl::init("141GB"), cl::cat(planCategory),
                            cl::desc("GPU memory budget (GB, GiB, TB, TiB)"));
cl::opt<std::string> gpuReserve(
    "gpu-reserve", cl::init("2GiB"), cl::cat(planCategory),
    cl::desc("Part of the GPU budget kept for the CUDA context and libraries"));
cl::opt<std::string> hostMem("host-mem", cl::init("1.5TB"),
                             cl::cat(planCategory),
                             cl::desc("Host memory budget"));
cl::opt<std::string>
    osAllowance("os-allowance", cl::init("64GB"), cl::cat(planCategory),
                cl::desc("Host memory reserved for the OS and runtime"));
cl::opt<std::string>
    activationPolicy("activation-policy", cl::init("auto"),
                     cl::cat(planCategory),
                     cl::desc("keep | recompute | offload | auto"));
cl::opt<std::string> hostStatePolicy(
    "host-state-policy", cl::init("master-moments"), cl::cat(planCategory),
    cl::desc("master-moments | persistent-bf16 | bf16-moments"));
cl::opt<std::string> attention("attention", cl::init("dsa"),
                               cl::cat(planCategory), cl::desc("dsa | global"));
cl::opt<std::string>
    precision("precision", cl::init("bf16"), cl::cat(planCategory),
              cl::desc("Compute precision of activations, working weights "
                       "and gradients: bf16 | f32 (masters and moments are "
                       "fp32 either way)"));
cl::list<int64_t> dsaWindow("dsa-window", cl::CommaSeparated,
                            cl::cat(planCategory),
                            cl::desc("3D-DSA key window t,y,x in tokens "
                                     "(default 9,15,24)"));
cl::list<int64_t> dsaTile("dsa-tile", cl::CommaSeparated, cl::cat(planCategory),
                          cl::desc("3D-DSA query tile t,y,x in tokens "
                                   "(default 3,5,8)"));
cl::opt<int64_t> dsaRadius("dsa-radius", cl::init(4), cl::cat(planCategory),
                           cl::desc("Largest displacement offset estimation "
                                    "searches"));
cl::opt<int64_t> buffers("buffers", cl::init(2), cl::cat(planCategory),
                         cl::desc("Weight-shard buffers on device"));
// Not "prefetch-distance": LLVM's own options already own that name.
cl::opt<int64_t> prefetch("prefetch", cl::init(1), cl::cat(planCategory),
                          cl::desc("Blocks ahead that weights are fetched"));
} // namespace

Expected<tools::PlanFlags> tools::readPlanFlags() {
  PlanFlags f;
  f.model = model;
  f.videoGiven = frames.getNumOccurrences() && height.getNumOccurrences() &&
                 width.getNumOccurrences();
  f.video = {frames, height, width, latent};
  f.training.batch = batch;
  if (textLen.getNumOccurrences())
    f.training.textLen = textLen;
  // The rule configs, the C API and loaded plans are held to as well.
  if (learningRate.getNumOccurrences())
    if (std::optional<std::string> problem =
            exec::checkAdamWHyperParameter("lr", learningRate))
      return createStringError("--lr " + *problem);
  if (std::optional<std::string> problem =
          exec::checkAdamWHyperParameter("weight_decay", weightDecay))
    return createStringError("--weight-decay " + *problem);
  f.training.learningRate = learningRate;
  f.training.weightDecay = weightDecay;
  Expected<ComputeType> computeType = parseComputeType(precision);
  if (!computeType)
    return computeType.takeError();
  f.training.computeType = *computeType;

  PlanOptions &o = f.options;
  o.gpuMemory = gpuMem;
  o.gpuReserve = gpuReserve;
  o.hostMemory = hostMem;
  o.osAllowance = osAllowance;
  o.hardwarePath = tools::hardwareFile;
  o.activationPolicy = activationPolicy;
  o.hostStatePolicy = hostStatePolicy;
  o.attention = attention;
  o.precision = precision;
  o.buffers = buffers;
  o.dsaWindow.assign(dsaWindow.begin(), dsaWindow.end());
  o.dsaTile.assign(dsaTile.begin(), dsaTile.end());
  o.dsaRadius = dsaRadius;
  o.prefetchDistance = prefetch;
  return f;
}
