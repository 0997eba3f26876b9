//===- Buckets.cpp - Resolution and duration buckets ----------------------===//

#include "megaslide/Tools/Buckets.h"

#include "megaslide/Tools/PlanFlags.h"

#include "megaslide/Model/ModelConfig.h"
#include "megaslide/Support/Units.h"
#include "megaslide/Version.h"
#include "megaslide/runtime/plan/ExecPlanJson.h"
#include "megaslide/runtime/support/AtomicFile.h"
#include "megaslide/runtime/support/Json.h"
#include "megaslide/runtime/support/ReadFile.h"

#include "mlir/IR/MLIRContext.h"
#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/SmallString.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/WithColor.h"
#include "llvm/Support/xxhash.h"

#include <chrono>
#include <cstdlib>
#include <set>

using namespace llvm;
using namespace megaslide;
using namespace megaslide::tools;

/// A bucket file lists a few shapes; anything near this is not one.
static constexpr uint64_t kMaxBucketFileBytes = 1 << 20;
/// A figures file is a few numbers.
static constexpr uint64_t kMaxFiguresBytes = 1 << 20;

std::string Bucket::name() const {
  return formatv("{0}x{1}x{2}", frames, height, width).str();
}

Expected<std::vector<Bucket>> tools::readBucketFile(StringRef path) {
  auto bad = [&](const Twine &why) {
    return createStringError("bucket file '" + path + "': " + why +
                             " (docs/Runtime.md, \"Buckets\")");
  };
  Expected<std::string> text =
      readBoundedFile(path, kMaxBucketFileBytes, "bucket file");
  if (!text)
    return text.takeError();
  Expected<json::Value> value = parseJson(*text);
  if (!value)
    return bad("not JSON: " + toString(value.takeError()));
  const json::Object *top = value->getAsObject();
  if (!top)
    return bad("not a JSON object");
  for (const auto &kv : *top)
    if (kv.first != "buckets")
      return bad("unknown key '" + kv.first.str() +
                 "' (it holds only "
                 "\"buckets\")");
  const json::Array *list = top->getArray("buckets");
  if (!list)
    return bad("no \"buckets\" array");
  if (list->empty())
    return bad("the \"buckets\" list is empty");
  std::vector<Bucket> buckets;
  std::set<std::string> seen;
  for (size_t i = 0; i < list->size(); ++i) {
    std::string where = formatv("bucket {0}", i).str();
    const json::Object *o = (*list)[i].getAsObject();
    if (!o)
      return bad(where + " is not an object");
    for (const auto &kv : *o)
      if (kv.first != "frames" && kv.first != "height" && kv.first != "width" &&
          kv.first != "samples")
        return bad(where + ": unknown key '" + kv.first.str() +
                   "' (frames, height, width, samples)");
    Bucket b;
    for (auto [key, out] :
         {std::pair<StringRef, int64_t *>{"frames", &b.frames},
          {"height", &b.height},
          {"width", &b.width}}) {
      std::optional<int64_t> v = o->getInteger(key);
      if (!v || *v <= 0)
        return bad(where + ": \"" + key + "\" must be a positive integer");
      *out = *v;
    }
    if (o->get("samples")) {
      std::optional<int64_t> v = o->getInteger("samples");
      if (!v || *v < 0)
        return bad(where + ": \"samples\" must be a non-negative integer");
      b.samples = *v;
    }
    where = "bucket " + b.name();
    if ((b.frames - 1) % 4 != 0)
      return bad(where +
                 ": frames must be 4k+1 (Wan's VAE makes (F-1)/4+1 "
                 "latent frames), e.g. " +
                 Twine((b.frames - 1) / 4 * 4 + 1));
    if (!seen.insert(b.name()).second)
      return bad(where + " is listed twice");
    buckets.push_back(b);
  }
  return buckets;
}

std::string tools::defaultPlanCacheDir() {
  SmallString<256> dir;
  if (const char *own = std::getenv("MEGASLIDE_CACHE_DIR"); own && *own) {
    dir = own;
  } else if (const char *xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) {
    dir = xdg;
    sys::path::append(dir, "megaslide");
  } else if (const char *home = std::getenv("HOME"); home && *home) {
    dir = home;
    sys::path::append(dir, ".cache", "megaslide");
  } else {
    return "";
  }
  sys::path::append(dir, "plans");
  return std::string(dir);
}

static std::string exact(double v) {
  return formatv("{0}", format("%.17g", v)).str();
}

Expected<std::string> tools::planCacheKey(const PlanFlags &flags,
                                          const Bucket &bucket) {
  Expected<ModelConfig> config = loadModelConfig(flags.model);
  if (!config)
    return config.takeError();
  std::string key;
  raw_string_ostream os(key);
  // Sizes are written before texts, so that no two inputs give one key.
  auto text = [&](StringRef name, StringRef value) {
    os << name << " " << value.size() << ":" << value << "\n";
  };
  text("megaslide", MEGASLIDE_VERSION);
  text("model", config->name);
  text("config", config->sourceJson);
  text("video", bucket.name());
  const TrainingOptions &t = flags.training;
  // A weighted loss is named only when there is one: the keys of the
  // other plans stay those entries were stored under.
  text("training",
       formatv("batch={0} compute={1} text_len={2} lr={3} beta1={4} "
               "beta2={5} eps={6} weight_decay={7}{8}",
               t.batch, computeTypeName(t.computeType),
               t.textLen ? std::to_string(*t.textLen) : std::string("config"),
               exact(t.learningRate), exact(t.beta1), exact(t.beta2),
               exact(t.adamEps), exact(t.weightDecay),
               t.weightedLoss ? " weighted_loss" : "")
           .str());
  forEachOption(flags.options, [&](const OptionInfo &info, const auto &value) {
    using T = std::decay_t<decltype(value)>;
    if constexpr (std::is_floating_point_v<T>)
      text(info.name, exact(value));
    else
      text(info.name, printOptionValue(value));
  });
  text("precision", flags.options.precision);
  std::string hardware = "(built-in)";
  if (!flags.options.hardwarePath.empty()) {
    Expected<std::string> contents = readBoundedFile(
        flags.options.hardwarePath, kMaxBucketFileBytes, "hardware file");
    if (!contents)
      return contents.takeError();
    hardware = std::move(*contents);
  }
  text("hardware", hardware);
  os.flush();
  return formatv("{0:x-16}", xxh3_64bits(arrayRefFromStringRef(key))).str();
}

namespace {
struct CacheEntry {
  std::string plan, figures; ///< file paths
};

CacheEntry cacheEntry(StringRef dir, StringRef key) {
  SmallString<256> plan(dir), figures(dir);
  sys::path::append(plan, key + ".plan.json");
  sys::path::append(figures, key + ".figures.json");
  return {std::string(plan), std::string(figures)};
}

/// The xxh3 of a plan's text, as hex: the figures name the plan they go
/// with.
std::string textHash(StringRef text) {
  return formatv("{0:x-16}", xxh3_64bits(arrayRefFromStringRef(text))).str();
}

/// The entry's plan and figures, validated as a --plan file is, and
/// checked against `key`: the figures record the key and bucket they were
/// compiled for and the hash of their plan, so an entry renamed, copied
/// or swapped with another bucket's is no entry of this one.
Expected<std::pair<exec::ExecPlan, PlanFigures>>
loadEntry(const CacheEntry &entry, StringRef key) {
  Expected<std::string> text =
      readBoundedFile(entry.figures, kMaxFiguresBytes, "plan figures");
  if (!text)
    return text.takeError();
  Expected<json::Value> value = parseJson(*text);
  if (!value)
    return createStringError("'" + entry.figures +
                             "' is not JSON: " + toString(value.takeError()));
  const json::Object *o = value->getAsObject();
  std::optional<int64_t> peak =
      o ? o->getInteger("device_peak_bytes") : std::nullopt;
  std::optional<double> seconds =
      o ? o->getNumber("predicted_step_seconds") : std::nullopt;
  if (!peak || !seconds || *peak < 0 || !(*seconds >= 0))
    return createStringError("'" + entry.figures +
                             "' lacks device_peak_bytes or "
                             "predicted_step_seconds");
  std::optional<StringRef> storedKey = o->getString("key");
  std::optional<StringRef> planHash = o->getString("plan_xxh3");
  if (!storedKey || !planHash)
    return createStringError("'" + entry.figures +
                             "' records no key and plan hash (an entry of "
                             "an older MegaSlide)");
  if (*storedKey != key)
    return createStringError(
        "'" + entry.figures + "' was compiled for key " + *storedKey +
        " (bucket " + o->getString("bucket").value_or("?") + "), not " + key);
  Expected<std::string> planText =
      readBoundedFile(entry.plan, kMaxExecPlanBytes, "execution plan");
  if (!planText)
    return planText.takeError();
  if (textHash(*planText) != *planHash)
    return createStringError("'" + entry.plan +
                             "' is not the plan its figures were stored with");
  Expected<exec::ExecPlan> plan = exec::parseExecPlan(*planText, entry.plan);
  if (!plan)
    return plan.takeError();
  return std::make_pair(std::move(*plan), PlanFigures{*peak, *seconds, {}});
}

/// Writes the entry: the figures first, so that a plan file is only ever
/// next to its figures.
Error storeEntry(StringRef dir, const CacheEntry &entry, StringRef key,
                 const Bucket &bucket, const exec::ExecPlan &plan,
                 const PlanFigures &figures) {
  if (std::error_code ec = sys::fs::create_directories(dir))
    return createStringError("cannot create '" + dir + "': " + ec.message());
  std::string planText = exec::serialize(plan);
  std::string text;
  raw_string_ostream(text) << json::Value(
      json::Object{{"key", key},
                   {"bucket", bucket.name()},
                   {"plan_xxh3", textHash(planText)},
                   {"device_peak_bytes", figures.devicePeak},
                   {"predicted_step_seconds", figures.predictedSeconds}});
  if (Error e = writeFileAtomically(entry.figures, text + "\n"))
    return e;
  return writeFileAtomically(entry.plan, planText);
}
} // namespace

Expected<PlannedBucket> tools::compileBucket(mlir::MLIRContext &context,
                                             const PlanFlags &flags,
                                             const Bucket &bucket,
                                             StringRef cacheDir) {
  auto named = [&](Error e) {
    return createStringError("bucket " + bucket.name() + ": " +
                             toString(std::move(e)));
  };
  auto start = std::chrono::steady_clock::now();
  auto since = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                         start)
        .count();
  };
  PlannedBucket out;
  out.bucket = bucket;
  std::optional<CacheEntry> entry;
  std::string key;
  if (!cacheDir.empty()) {
    Expected<std::string> computed = planCacheKey(flags, bucket);
    if (!computed)
      return named(computed.takeError());
    key = std::move(*computed);
    entry = cacheEntry(cacheDir, key);
    if (sys::fs::exists(entry->plan) || sys::fs::exists(entry->figures)) {
      Expected<std::pair<exec::ExecPlan, PlanFigures>> loaded =
          loadEntry(*entry, key);
      if (loaded) {
        out.plan = std::move(loaded->first);
        out.figures = std::move(loaded->second);
        out.fromCache = true;
        out.seconds = since();
        return out;
      }
      WithColor::warning(errs())
          << "bucket " << bucket.name() << ": the plan cache entry is not "
          << "usable, so it is compiled again: " << toString(loaded.takeError())
          << "\n";
    }
  }
  bool overBudget = false;
  Expected<exec::ExecPlan> plan =
      compileExecPlan(context, flags.model, bucket.video(), flags.training,
                      flags.options, &overBudget, &out.figures);
  out.seconds = since();
  if (!plan) {
    if (overBudget) {
      consumeError(plan.takeError()); // figures.violations say why
      return out;
    }
    return named(plan.takeError());
  }
  if (entry)
    if (Error e = storeEntry(cacheDir, *entry, key, bucket, *plan, out.figures))
      WithColor::warning(errs())
          << "bucket " << bucket.name()
          << ": the plan is not cached: " << toString(std::move(e)) << "\n";
  out.plan = std::move(*plan);
  return out;
}

std::vector<size_t> tools::worstFirst(ArrayRef<PlannedBucket> buckets) {
  std::vector<size_t> order(buckets.size());
  for (size_t i = 0; i < order.size(); ++i)
    order[i] = i;
  // Ties keep the file's order.
  llvm::sort(order, [&](size_t a, size_t b) {
    const PlannedBucket &x = buckets[a], &y = buckets[b];
    auto key = [](const PlannedBucket &p) {
      return std::make_tuple(!p.fits(), p.figures.devicePeak,
                             p.figures.predictedSeconds);
    };
    return key(x) != key(y) ? key(x) > key(y) : a < b;
  });
  return order;
}

void tools::printBucketTable(raw_ostream &os, ArrayRef<PlannedBucket> buckets,
                             ArrayRef<size_t> samples) {
  os << formatv("{0} buckets, worst first:\n", buckets.size());
  os << formatv("  {0,-14} {1,8}  {2,-26} {3,16}  {4}\n", "bucket", "samples",
                "device peak", "predicted step", "budgets");
  for (size_t b : worstFirst(buckets)) {
    const PlannedBucket &p = buckets[b];
    std::string count = b < samples.size() ? std::to_string(samples[b])
                        : p.bucket.samples ? std::to_string(*p.bucket.samples)
                                           : std::string("-");
    os << formatv("  {0,-14} {1,8}  {2,-26} {3,14:F3} s  {4}\n",
                  p.bucket.name(), count, formatBytes(p.figures.devicePeak),
                  p.figures.predictedSeconds, p.fits() ? "fit" : "DO NOT FIT");
  }
}

json::Array tools::bucketTableJson(ArrayRef<PlannedBucket> buckets) {
  json::Array out;
  for (size_t b : worstFirst(buckets)) {
    const PlannedBucket &p = buckets[b];
    json::Object o{{"name", p.bucket.name()},
                   {"frames", p.bucket.frames},
                   {"height", p.bucket.height},
                   {"width", p.bucket.width},
                   {"device_peak_bytes", p.figures.devicePeak},
                   {"predicted_step_seconds", p.figures.predictedSeconds},
                   {"fits", p.fits()}};
    if (p.bucket.samples)
      o["samples"] = *p.bucket.samples;
    json::Array violations;
    for (const std::string &v : p.figures.violations)
      violations.push_back(StringRef(v).split('\n').first.str());
    o["violations"] = std::move(violations);
    out.push_back(std::move(o));
  }
  return out;
}
