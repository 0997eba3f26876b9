//===- Buckets.h - Resolution and duration buckets --------------*- C++ -*-===//
//
// A dataset of several video shapes trains on one plan per shape
// (docs/Runtime.md, "Buckets"): the bucket file that lists them, one
// compile per bucket through an on-disk cache of execution plans keyed by
// everything the compile depends on, and the table megaslide-plan and
// megaslide-run print of them, worst first.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TOOLS_COMMON_BUCKETS_H
#define MEGASLIDE_TOOLS_COMMON_BUCKETS_H

#include "megaslide/Pipelines/CompileExecPlan.h"

#include "llvm/Support/JSON.h"
#include "llvm/Support/raw_ostream.h"

#include <optional>

namespace mlir {
class MLIRContext;
} // namespace mlir

namespace megaslide::tools {

struct PlanFlags;

/// One entry of a bucket file: a video shape in pixels.
struct Bucket {
  int64_t frames = 0, height = 0, width = 0;
  std::optional<int64_t> samples; ///< informative only
  /// "FxHxW", what a sample's `megaslide.bucket` metadata holds.
  std::string name() const;
  VideoShape video() const { return {frames, height, width, false}; }
};

/// The buckets of a bucket file (`{"buckets": [{"frames": F, "height": H,
/// "width": W, "samples": N}, ...]}`); errors name the file and the entry.
llvm::Expected<std::vector<Bucket>> readBucketFile(llvm::StringRef path);

/// Where compiled bucket plans are kept without --plan-cache:
/// $MEGASLIDE_CACHE_DIR/plans, else ${XDG_CACHE_HOME:-$HOME/.cache}/
/// megaslide/plans; empty when none of them is set.
std::string defaultPlanCacheDir();

/// A bucket planned: the planner's figures and, where it fits and was
/// asked for, its execution plan.
struct PlannedBucket {
  Bucket bucket;
  PlanFigures figures;
  std::optional<exec::ExecPlan> plan;
  bool fromCache = false;
  double seconds = 0; ///< to compile or load it
  bool fits() const { return figures.violations.empty(); }
};

/// The plan of `bucket` from the model and flags of `flags` (its video
/// replaced by the bucket's), loaded from `cacheDir` when an entry with
/// its key is there and valid, else compiled and stored there (atomically;
/// a cache that cannot be written is a warning). A corrupt entry is
/// compiled again, with a warning on `log`. Empty `cacheDir`: no cache.
/// Errors name the bucket; one over its budgets is no error (fits()).
llvm::Expected<PlannedBucket> compileBucket(mlir::MLIRContext &context,
                                            const PlanFlags &flags,
                                            const Bucket &bucket,
                                            llvm::StringRef cacheDir);

/// The cache key of `bucket`'s plan: an xxh3 of the MegaSlide version,
/// the model config, the video shape, the training flags, the planning
/// options and the hardware file's contents, as hex.
llvm::Expected<std::string> planCacheKey(const PlanFlags &flags,
                                         const Bucket &bucket);

/// Indices of `buckets`, worst first: over budget first, then by device
/// peak, then by predicted step time.
std::vector<size_t> worstFirst(llvm::ArrayRef<PlannedBucket> buckets);
/// The table of `buckets`, worst first; `samples[b]`, where given, the
/// samples of bucket b in the data (else the bucket file's count).
void printBucketTable(llvm::raw_ostream &os,
                      llvm::ArrayRef<PlannedBucket> buckets,
                      llvm::ArrayRef<size_t> samples = {});
/// The same as JSON: an array, worst first.
llvm::json::Array bucketTableJson(llvm::ArrayRef<PlannedBucket> buckets);

} // namespace megaslide::tools

#endif // MEGASLIDE_TOOLS_COMMON_BUCKETS_H
