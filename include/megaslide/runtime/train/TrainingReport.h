//===- TrainingReport.h - A run's metrics as one HTML page ------*- C++ -*-===//
//
// Renders the metrics log of `megaslide-run --metrics FILE` (JSON Lines,
// one object per optimizer step; docs/Training.md, "Training report") as a
// single offline HTML page: a summary table, inline-SVG line plots of the
// loss (train and validation), learning rate, gradient norm, step time,
// throughput and memory, and the run's settings. No script, no URL: the
// page opens from a ticket or a mail. What megaslide-report and
// megaslide-run --report write. No MLIR: LLVM Support only.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_TRAIN_TRAININGREPORT_H
#define MEGASLIDE_RUNTIME_TRAIN_TRAININGREPORT_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace megaslide::train {

/// The y scale of the loss plot.
enum class LossScale {
  /// Logarithmic when every loss shown is positive and the largest is at
  /// least kLogLossRatio times the smallest, else linear.
  Auto,
  Linear,
  /// Logarithmic; linear (and said so) when a loss shown is not positive.
  Log,
};

/// Auto picks a log loss axis from this ratio of largest to smallest loss
/// on: the curve then spans more than a decade, and on a linear axis the
/// first steps' drop squeezes the rest of the run into a flat line.
inline constexpr double kLogLossRatio = 20;

/// The largest metrics file read (megaslide-run reads as much to resume):
/// about three million steps at the widest line.
inline constexpr uint64_t kMaxMetricsBytes = 1ull << 30;

/// What the page says about the run beyond its metrics.
struct TrainingReportInfo {
  /// The page's heading and <title>.
  std::string title = "MegaSlide training run";
  /// The run's settings, shown as a table in this order. A setting named
  /// "max_grad_norm" whose value is a positive number is drawn as the
  /// clipping threshold on the gradient-norm plot.
  std::vector<std::pair<std::string, std::string>> settings;
  LossScale lossScale = LossScale::Auto;
  /// A run over buckets (docs/Runtime.md, "Buckets"): one row each.
  struct Bucket {
    std::string name;
    int64_t samples = 0;
    int64_t devicePeakBytes = 0; ///< planned
    double predictedSeconds = 0; ///< the planner's; 0: unknown
  };
  std::vector<Bucket> buckets;
};

/// The HTML page of the metrics log `metricsJsonl`. Every field but "step"
/// may be missing or null (older files have only step, loss and seconds;
/// the sim backend writes no loss): a plot without data says which field
/// is absent. Non-finite numbers (NaN, Infinity as Python writes them, or
/// the strings "nan", "inf") and skipped steps are marked below the x axis
/// instead of being plotted. A step that repeats takes its later line. A
/// last line without a newline that does not parse (cut by a kill) is left
/// out with a note. Errors name the line: "line 3: invalid JSON: ...",
/// "line 5: \"loss\" must be a number or null", and an input without any
/// step is "the metrics file is empty".
llvm::Expected<std::string> trainingReportHtml(llvm::StringRef metricsJsonl,
                                               const TrainingReportInfo &info);

} // namespace megaslide::train

#endif // MEGASLIDE_RUNTIME_TRAIN_TRAININGREPORT_H
