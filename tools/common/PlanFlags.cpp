//===- PlanFlags.cpp - Command-line flags shared by the tools -------------===//

#include "megaslide/Tools/PlanFlags.h"

#include "megaslide/Tools/HardwareFlag.h"

#include "megaslide/Pipelines/Pipelines.h"

#include "megaslide/runtime/plan/HyperParameters.h"

#include "llvm/Support/StringSaver.h"

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
cl::opt<std::string> bucketFile(
    "buckets", cl::cat(planCategory),
    cl::desc("Plan one step per video shape of this bucket file (JSON: "
             "{\"buckets\": [{\"frames\": F, \"height\": H, \"width\": W}, "
             "...]}; docs/Runtime.md, \"Buckets\") instead of --frames, "
             "--height and --width"),
    cl::value_desc("FILE"));
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
cl::opt<double> adamBeta1("adam-beta1", cl::init(exec::kDefaultBeta1),
                          cl::cat(planCategory),
                          cl::desc("AdamW first-moment decay, in [0, 1)"));
cl::opt<double> adamBeta2("adam-beta2", cl::init(exec::kDefaultBeta2),
                          cl::cat(planCategory),
                          cl::desc("AdamW second-moment decay, in [0, 1)"));
cl::opt<double> adamEps("adam-eps", cl::init(exec::kDefaultEps),
                        cl::cat(planCategory),
                        cl::desc("AdamW epsilon (added to the root of the "
                                 "second moment), > 0"));
cl::opt<std::string>
    precision("precision", cl::init("bf16"), cl::cat(planCategory),
              cl::desc("Compute precision of activations, working weights "
                       "and gradients: bf16 | f32 (masters and moments are "
                       "fp32 either way)"));

/// The flag of every planning option that has one, made from its
/// declaration (PipelineOptions.def): same default and help. Enum and size
/// options are read as text and parsed here, so that a bad value gets the
/// message every entry point gives ("option 'gpu-mem': ...").
class PlanningFlags {
public:
  PlanningFlags() {
    PlanningOptions defaults;
    forEachOption(defaults, [&](const OptionInfo &info, const auto &value) {
      if (!info.flag.empty())
        flags[info.flag] = makeFlag(info, value, saver);
    });
  }

  /// Sets `options` from the flags; errors name the option.
  Error read(PlanningOptions &options) const {
    Error err = Error::success();
    forEachOption(options, [&](const OptionInfo &info, auto &value) {
      if (!err && !info.flag.empty())
        err = readFlag(info, *flags.find(info.flag)->second, value);
    });
    return err;
  }

private:
  template <typename T>
  static std::unique_ptr<cl::Option>
  makeFlag(const OptionInfo &info, const T &value, StringSaver &saver) {
    if constexpr (std::is_enum_v<T>)
      return std::make_unique<cl::opt<std::string>>(
          info.flag, cl::init(OptionEnum<T>::name(value).str()),
          cl::cat(planCategory),
          cl::desc(saver.save(info.help + ": " + optionEnumNames<T>(" | "))));
    else if constexpr (std::is_base_of_v<ByteSize, T>)
      return std::make_unique<cl::opt<std::string>>(
          info.flag, cl::init(value.text()), cl::cat(planCategory),
          cl::desc(info.help));
    else if constexpr (std::is_same_v<T, std::vector<int64_t>>)
      return std::make_unique<cl::list<int64_t>>(info.flag, cl::CommaSeparated,
                                                 cl::cat(planCategory),
                                                 cl::desc(info.help));
    else
      return std::make_unique<cl::opt<T>>(info.flag, cl::init(value),
                                          cl::cat(planCategory),
                                          cl::desc(info.help));
  }

  template <typename T>
  static Error readFlag(const OptionInfo &info, cl::Option &flag, T &value) {
    if constexpr (std::is_enum_v<T>) {
      std::string text = static_cast<cl::opt<std::string> &>(flag);
      std::optional<T> parsed = parseOptionEnum<T>(text);
      if (!parsed)
        return createStringError("option '" + info.name +
                                 "': " + unknownOptionValue<T>(text));
      value = *parsed;
    } else if constexpr (std::is_base_of_v<ByteSize, T>) {
      Expected<T> parsed = T::parse(static_cast<cl::opt<std::string> &>(flag));
      if (!parsed)
        return createStringError("option '" + info.name +
                                 "': " + toString(parsed.takeError()));
      value = std::move(*parsed);
    } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
      auto &list = static_cast<cl::list<int64_t> &>(flag);
      value.assign(list.begin(), list.end());
    } else {
      value = static_cast<cl::opt<T> &>(flag);
    }
    return Error::success();
  }

  BumpPtrAllocator allocator;
  StringSaver saver{allocator}; ///< help texts made here
  StringMap<std::unique_ptr<cl::Option>> flags;
};
const PlanningFlags planningFlags;

// What docs/reference/PipelineOptions.md holds (scripts/update-docs.sh).
cl::opt<bool> printReference(
    "print-option-reference", cl::Hidden, cl::ValueDisallowed,
    cl::desc("Print the reference of the planning options and exit"),
    cl::callback([](const bool &) {
      printOptionReference(outs());
      std::exit(0);
    }));
} // namespace

Expected<tools::PlanFlags> tools::readPlanFlags() {
  PlanFlags f;
  f.model = model;
  f.videoGiven = frames.getNumOccurrences() && height.getNumOccurrences() &&
                 width.getNumOccurrences();
  f.video = {frames, height, width, latent};
  f.anyVideoFlag = frames.getNumOccurrences() || height.getNumOccurrences() ||
                   width.getNumOccurrences() || latent.getNumOccurrences();
  if (bucketFile.getNumOccurrences()) {
    if (f.anyVideoFlag)
      return createStringError(
          "--buckets gives the video shapes (in pixels): leave out "
          "--frames, --height, --width and --latent");
    Expected<std::vector<Bucket>> buckets = readBucketFile(bucketFile);
    if (!buckets)
      return buckets.takeError();
    f.bucketFile = bucketFile;
    f.buckets = std::move(*buckets);
  }
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
  for (auto [flag, name, value] :
       {std::tuple{"--adam-beta1", "beta1", double(adamBeta1)},
        std::tuple{"--adam-beta2", "beta2", double(adamBeta2)},
        std::tuple{"--adam-eps", "eps", double(adamEps)}})
    if (std::optional<std::string> problem =
            exec::checkAdamWHyperParameter(name, value))
      return createStringError(Twine(flag) + " " + *problem);
  f.training.learningRate = learningRate;
  f.training.weightDecay = weightDecay;
  f.training.beta1 = adamBeta1;
  f.training.beta2 = adamBeta2;
  f.training.adamEps = adamEps;
  Expected<ComputeType> computeType = parseComputeType(precision);
  if (!computeType)
    return computeType.takeError();
  f.training.computeType = *computeType;

  PlanOptions &o = f.options;
  if (Error err = planningFlags.read(o))
    return std::move(err);

  // --min-lr against the lr is checked again with the plan's (the config's
  // learning_rate when --lr is not given).
  Expected<train::Recipe> recipe = tools::readRecipeFlags(
      learningRate.getNumOccurrences() ? double(learningRate) : INFINITY);
  if (!recipe)
    return recipe.takeError();
  f.recipe = *recipe;
  // An EMA asked for by its decay alone is kept in fp32; --ema-dtype bf16
  // halves it.
  if (f.recipe.hasEma() && o.ema == schedule::EmaPolicy::none)
    o.ema = schedule::EmaPolicy::f32;
  // Wan 2.2's two experts: the planner counts both host states.
  o.experts = f.recipe.numExperts();
  f.recipe.gradAccum = o.gradAccum;
  f.training.weightedLoss = f.recipe.weightsLoss();
  f.recipe.emaBf16 = o.ema == schedule::EmaPolicy::bf16;
  o.hardwarePath = tools::hardwareFile;
  o.precision = precision;
  return f;
}
