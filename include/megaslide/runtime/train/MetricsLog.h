//===- MetricsLog.h - One JSON line per optimizer step ----------*- C++ -*-===//
//
// The metrics log of a training run (docs/Training.md, "Metrics"): JSON
// Lines, one object per optimizer step, flushed as written, kept exact
// across kills and resumes. What megaslide-run --metrics and
// megaslide.Trainer(metrics=...) write, through train::TrainingRun.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_TRAIN_METRICSLOG_H
#define MEGASLIDE_RUNTIME_TRAIN_METRICSLOG_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace megaslide::train {

/// How messages name a run option given as `name` ("metrics",
/// "checkpoint-dir"): megaslide-run's "--metrics", Python's "metrics=".
using OptionSpelling = std::string (*)(llvm::StringRef name);
std::string cliSpelling(llvm::StringRef name);
std::string pythonSpelling(llvm::StringRef name);

/// What one optimizer step puts in the log. Numbers that are not finite
/// (or not there) are written as null.
struct MetricsRecord {
  int64_t step = 0;
  std::optional<double> loss, lr, gradNorm;
  /// A weighted loss's unweighted one (--weighting-scheme); written only
  /// then.
  std::optional<double> unweightedLoss;
  bool clipped = false, skipped = false;
  int64_t microBatches = 1;
  double seconds = 0;
  double samplesPerSecond = 0, tokensPerSecond = 0;
  uint64_t hostRssBytes = 0;
  int64_t devicePeakBytes = 0;
  std::optional<double> valLoss;
  /// A resume's new learning-rate horizon, on its first line.
  std::optional<int64_t> lrDecaySteps;
  /// The bucket of each micro-batch (a bucketed run): one name, or a list.
  std::vector<std::string> buckets;
  /// The expert that stepped (Wan 2.2's two experts): "high" or "low".
  std::string expert;
};

/// The record as one line of JSON (no newline).
std::string metricsLine(const MetricsRecord &record);

/// What a run may do with an existing log at `path`, checked before long
/// work starts: a fresh run replaces only a metrics log (its first line a
/// step's), never a file of another kind; a resumed run keeps the log's
/// lines, so every line but a last one cut by a kill must be a step's (a
/// corrupt one is named, not dropped). `keepText`: the log is also held in
/// memory (for the report), so its lines must be within kMaxMetricsBytes.
llvm::Error checkMetricsLog(llvm::StringRef path, bool resuming, bool keepText,
                            OptionSpelling spell);

/// The open log. A fresh run replaces the file at its first line (so a run
/// that fails before any step leaves it as it was); a resumed run keeps the
/// lines of the steps the checkpoint holds and appends, so an interrupted
/// and resumed run has one line per step. With `keepText` the lines are
/// also kept for the report; with an empty path they are only kept (a
/// report without a log: this run's steps).
class MetricsLog {
public:
  /// `resumedStep`: the step the run resumes from (checked by
  /// checkMetricsLog first); none for a fresh run.
  static llvm::Expected<std::unique_ptr<MetricsLog>>
  open(llvm::StringRef path, std::optional<int64_t> resumedStep, bool keepText);
  ~MetricsLog();

  llvm::Error write(const MetricsRecord &record);
  /// Every line of the log so far (with keepText).
  llvm::StringRef text() const { return lines; }

private:
  MetricsLog(std::string path, bool keepText)
      : path(std::move(path)), keepText(keepText) {}
  std::string lines;
  std::string path;
  bool keepText;
  int fd = -1;
  bool append = false;
};

} // namespace megaslide::train

#endif // MEGASLIDE_RUNTIME_TRAIN_METRICSLOG_H
