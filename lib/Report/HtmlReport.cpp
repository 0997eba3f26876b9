//===- HtmlReport.cpp - A plan as one self-contained HTML page ------------===//
//
// Renders the plan JSON of `megaslide-plan --format json` as a single HTML
// page: inline CSS and inline SVG plots, no script and no URL, so the file
// can be attached to a ticket and opened offline. Every field is read
// defensively because the page is also wanted for partial plans: a missing
// figure prints "n/a" and a plot without data says so.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Report/HtmlReport.h"

#include "megaslide/Support/Units.h"
#include "megaslide/runtime/support/Html.h"
#include "megaslide/runtime/support/Svg.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>

using namespace megaslide;
using llvm::raw_ostream;
using llvm::StringRef;
using megaslide::html::escape;
using megaslide::html::renderRow;
using namespace megaslide::svg;
namespace json = llvm::json;

namespace {

constexpr double kBytesPerGB = 1e9;

/// Lanes of the stream plot, in the order of `step.busy_seconds`; the
/// last, `comm`, only for a job of several ranks (its collectives).
constexpr std::array<StringRef, 5> kStreams = {"compute", "h2d", "d2h", "host",
                                               "comm"};
/// Fills of the stream lanes; no red, which marks budgets.
constexpr std::array<StringRef, 5> kStreamFills = {
    kPalette[0], kPalette[1], kPalette[2], kPalette[6], kPalette[4]};

//===----------------------------------------------------------------------===//
// Reading the plan
//===----------------------------------------------------------------------===//

// Each accessor takes a possibly null object, so that a chain of lookups
// into a partial plan ends in "absent" instead of a crash.

const json::Object *objectAt(const json::Object *o, StringRef key) {
  return o ? o->getObject(key) : nullptr;
}

const json::Array *arrayAt(const json::Object *o, StringRef key) {
  return o ? o->getArray(key) : nullptr;
}

std::optional<double> numberAt(const json::Object *o, StringRef key) {
  return o ? o->getNumber(key) : std::nullopt;
}

std::optional<StringRef> stringAt(const json::Object *o, StringRef key) {
  return o ? o->getString(key) : std::nullopt;
}

/// The entries of a `{name: number}` object, largest first. JSON objects
/// have no order, and largest first is what a reader looks for.
std::vector<std::pair<std::string, double>>
sortedEntries(const json::Object *o) {
  std::vector<std::pair<std::string, double>> entries;
  if (!o)
    return entries;
  for (const auto &entry : *o)
    if (std::optional<double> value = entry.second.getAsNumber())
      entries.emplace_back(StringRef(entry.first).str(), *value);
  llvm::sort(entries, [](const auto &a, const auto &b) {
    return a.second != b.second ? a.second > b.second : a.first < b.first;
  });
  return entries;
}

//===----------------------------------------------------------------------===//
// Formatting
//===----------------------------------------------------------------------===//

std::string escapedOr(std::optional<StringRef> text) {
  return text ? escape(*text) : "n/a";
}

/// Bytes as decimal gigabytes with two decimals.
std::string formatGB(std::optional<double> bytes) {
  if (!bytes)
    return "n/a";
  return llvm::formatv("{0:F2} GB", *bytes / kBytesPerGB).str();
}

std::string formatSeconds(std::optional<double> seconds) {
  return seconds ? megaslide::formatSeconds(*seconds) : "n/a";
}

/// An exact count with digit grouping (1,234,567).
std::string formatCount(const json::Object *o, StringRef key) {
  if (!o)
    return "n/a";
  if (std::optional<int64_t> count = o->getInteger(key))
    return llvm::formatv("{0:N}", *count).str();
  if (std::optional<double> count = o->getNumber(key))
    return llvm::formatv("{0:F0}", *count).str();
  return "n/a";
}

/// `used` as GB next to its budget and the share of the budget it takes;
/// flagged when over budget.
std::string formatUsage(std::optional<double> used,
                        std::optional<double> budget) {
  std::string text = formatGB(used) + " of " + formatGB(budget) + " budget";
  if (!used || !budget || *budget <= 0)
    return text;
  text += llvm::formatv(" ({0:F0}%)", 100 * *used / *budget).str();
  if (*used > *budget)
    return "<span class=\"bad\">" + text + "</span>";
  return text;
}

//===----------------------------------------------------------------------===//
// Plot pieces of this page
//===----------------------------------------------------------------------===//

/// A legend of coloured squares and their names (drawLegendEntry) from
/// `left`, in one row.
LegendLayout squareLegend(double left) {
  return {left, /*nameOffset=*/17, /*pad=*/30, /*charWidth=*/7.5};
}

/// A legend entry at (x, y): a square of `fill` and the (escaped) name.
void drawLegendEntry(raw_ostream &os, const LegendLayout &legend, double x,
                     double y, StringRef fill, StringRef name) {
  drawRect(os, x, y - 10, 12, 12, fill, name);
  legend.drawName(os, x, y, name);
}

/// The caption of a dashed budget line: `what` and the budget in GB.
void drawBudgetLabel(raw_ostream &os, double x, double y, StringRef anchor,
                     StringRef what, double bytes) {
  os << llvm::format("<text x=\"%.1f\" y=\"%.1f\" ", x, y) << "text-anchor=\""
     << anchor << "\" class=\"budget-label\">" << what << " " << formatGB(bytes)
     << "</text>\n";
}

//===----------------------------------------------------------------------===//
// Plots
//===----------------------------------------------------------------------===//

/// Live device bytes over the predicted step, with the GPU budget.
void renderDeviceMemoryPlot(raw_ostream &os, const json::Object *plan) {
  StringRef title = "Device memory over the step";
  std::vector<std::pair<double, double>> points; // (seconds, GB)
  if (const json::Array *memory = arrayAt(objectAt(plan, "timeline"), "memory"))
    for (const json::Value &value : *memory) {
      const json::Array *point = value.getAsArray();
      if (!point || point->size() < 2)
        continue;
      std::optional<double> seconds = (*point)[0].getAsNumber();
      std::optional<double> bytes = (*point)[1].getAsNumber();
      if (seconds && bytes)
        points.emplace_back(*seconds, *bytes / kBytesPerGB);
    }
  if (points.empty())
    return emptySvg(os, title, "n/a: the plan has no memory timeline");

  std::optional<double> budget =
      numberAt(objectAt(plan, "budgets"), "gpu_bytes");
  double yMax = budget ? *budget / kBytesPerGB : 0;
  double tMin = points.front().first, tMax = tMin;
  for (auto [seconds, gb] : points) {
    tMin = std::min(tMin, seconds);
    tMax = std::max(tMax, seconds);
    yMax = std::max(yMax, gb);
  }

  double height = 340;
  Frame f{80, 25, kWidth - 110, height - 85, {tMin, tMax}, {0, yMax * 1.1}};
  openSvg(os, height, title);
  drawYAxis(os, f, "device memory (GB)");
  drawXAxis(os, f, "time in the step (s)");

  std::string line;
  llvm::raw_string_ostream lineOs(line);
  for (auto [seconds, gb] : points)
    lineOs << llvm::format("%.1f,%.1f ", f.px(seconds), f.py(gb));
  os << llvm::format("<path class=\"area\" d=\"M%.1f,%.1f L", f.px(tMin),
                     f.bottom())
     << line
     << llvm::format("L%.1f,%.1f Z\"/>\n", f.px(points.back().first),
                     f.bottom())
     << "<polyline class=\"series\" points=\"" << line << "\"/>\n";

  if (budget) {
    double y = f.py(*budget / kBytesPerGB);
    drawLine(os, f.left, y, f.right(), y, "budget");
    drawBudgetLabel(os, f.right(), y - 5, "end", "GPU budget", *budget);
  }
  os << "</svg>\n";
}

/// Host bytes as one bar stacked by category, with the host budget.
void renderHostMemoryPlot(raw_ostream &os, const json::Object *plan) {
  StringRef title = "Host memory by category";
  const json::Object *host = objectAt(plan, "host");
  std::vector<std::pair<std::string, double>> categories =
      sortedEntries(objectAt(host, "by_category"));
  if (categories.empty())
    return emptySvg(os, title, "n/a: the plan has no host categories");

  double total = 0;
  for (const auto &category : categories)
    total += category.second;
  total = numberAt(host, "total_bytes").value_or(total);
  std::optional<double> budget =
      numberAt(objectAt(plan, "budgets"), "host_bytes");
  double xMax = std::max(total, budget.value_or(0)) / kBytesPerGB;

  std::vector<std::string> names;
  for (const auto &[name, bytes] : categories)
    names.push_back(escape(name) + " " + formatGB(bytes));
  LegendLayout legend = squareLegend(20);
  legend.right = kWidth - 20;
  std::vector<std::pair<double, int>> places = legend.place(names);
  constexpr double legendRowHeight = 22;
  double height = 150 + (places.back().second + 1) * legendRowHeight;
  Frame f{20, 30, kWidth - 50, 44, {0, xMax * 1.05}, {0, 1}};
  openSvg(os, height, title);
  drawXAxis(os, f, "host memory (GB)");

  double start = 0;
  for (auto [i, category] : llvm::enumerate(categories)) {
    double gb = category.second / kBytesPerGB;
    drawRect(os, f.px(start), f.top, f.px(start + gb) - f.px(start), f.height,
             kPalette[i % kPalette.size()], names[i]);
    start += gb;
  }
  if (budget) {
    double x = f.px(*budget / kBytesPerGB);
    drawLine(os, x, f.top - 10, x, f.bottom() + 5, "budget");
    drawBudgetLabel(os, x, f.top - 14, "end", "host budget", *budget);
  }

  for (auto [i, name] : llvm::enumerate(names)) {
    auto [x, row] = places[i];
    drawLegendEntry(os, legend, x, f.bottom() + 66 + row * legendRowHeight,
                    kPalette[i % kPalette.size()], name);
  }
  os << "</svg>\n";
}

/// The fill of a block's bars, by its activation policy.
StringRef policyFill(StringRef policy) {
  if (policy == "keep")
    return "#59a14f";
  if (policy == "recompute")
    return "#f28e2b";
  if (policy == "offload")
    return "#4e79a7";
  return "#9d9d9d";
}

/// One row of `per_layer`, read defensively.
struct LayerBars {
  int64_t index;
  std::optional<double> devicePeak, hostBytes;
  std::string policy;
};

/// One bar per layer of `value(layer)` in GB, coloured by policy.
template <typename Fn>
void drawLayerPanel(raw_ostream &os, const std::vector<LayerBars> &layers,
                    double top, StringRef yLabel, StringRef what, Fn value) {
  double yMax = 0;
  int64_t xMax = 0;
  for (const LayerBars &layer : layers) {
    yMax = std::max(yMax, value(layer).value_or(0) / kBytesPerGB);
    xMax = std::max(xMax, layer.index);
  }
  Frame f{80, top, kWidth - 110, 170, {-0.5, xMax + 0.5}, {0, yMax * 1.1}};
  drawYAxis(os, f, yLabel);
  drawXAxis(os, f, "layer", 1);
  double barWidth = 0.8 * (f.px(1) - f.px(0));
  for (const LayerBars &layer : layers) {
    std::optional<double> bytes = value(layer);
    if (!bytes)
      continue;
    double y = f.py(*bytes / kBytesPerGB);
    std::string tooltip =
        llvm::formatv("layer {0}: {1} {2} ({3})", layer.index, formatGB(bytes),
                      what, escape(layer.policy))
            .str();
    drawRect(os, f.px(layer.index) - barWidth / 2, y, barWidth, f.bottom() - y,
             policyFill(layer.policy), tooltip);
  }
}

/// Device peak and host bytes of every block, coloured by the activation
/// policy that produced them.
void renderPerLayerPlot(raw_ostream &os, const json::Object *plan) {
  StringRef title = "Per-layer device peak and host bytes";
  std::vector<LayerBars> layers;
  if (const json::Array *perLayer = arrayAt(plan, "per_layer"))
    for (auto [i, value] : llvm::enumerate(*perLayer)) {
      const json::Object *layer = value.getAsObject();
      if (!layer)
        continue;
      layers.push_back(
          {layer->getInteger("layer").value_or(static_cast<int64_t>(i)),
           numberAt(layer, "device_peak_bytes"), numberAt(layer, "host_bytes"),
           stringAt(layer, "activation_policy").value_or("n/a").str()});
    }
  if (layers.empty())
    return emptySvg(os, title, "n/a: the plan has no per-layer figures");

  std::vector<std::string> policies;
  for (StringRef known : {"keep", "recompute", "offload"})
    policies.push_back(known.str());
  for (const LayerBars &layer : layers)
    if (!llvm::is_contained(policies, layer.policy))
      policies.push_back(layer.policy);

  std::vector<std::string> names;
  for (const std::string &policy : policies)
    names.push_back(escape(policy));
  LegendLayout legend = squareLegend(80 + 135); // after its caption
  openSvg(os, 530, title);
  drawText(os, 80, 18, "start", "activation policy:");
  for (auto [i, place] : llvm::enumerate(legend.place(names)))
    drawLegendEntry(os, legend, place.first, 18, policyFill(policies[i]),
                    names[i]);
  drawLayerPanel(os, layers, 40, "device peak (GB)", "device peak",
                 [](const LayerBars &l) { return l.devicePeak; });
  drawLayerPanel(os, layers, 300, "host bytes (GB)", "host",
                 [](const LayerBars &l) { return l.hostBytes; });
  os << "</svg>\n";
}

/// Busy intervals of the four streams over the predicted step.
void renderStreamPlot(raw_ostream &os, const json::Object *plan) {
  StringRef title = "Stream timeline";
  const json::Array *streams = arrayAt(objectAt(plan, "timeline"), "streams");
  if (!streams || streams->empty())
    return emptySvg(os, title, "n/a: the plan has no stream timeline");

  double tMax =
      numberAt(objectAt(plan, "step"), "predicted_seconds").value_or(0);
  for (const json::Value &value : *streams)
    tMax = std::max(tMax, numberAt(value.getAsObject(), "end").value_or(0));

  constexpr double laneHeight = 26, laneGap = 10;
  bool job = objectAt(plan, "job") != nullptr;
  llvm::ArrayRef<StringRef> lanes =
      llvm::ArrayRef(kStreams).drop_back(job ? 0 : 1);
  double lanesHeight = lanes.size() * (laneHeight + laneGap);
  Frame f{80, 15, kWidth - 110, lanesHeight, {0, tMax}, {0, 1}};
  openSvg(os, lanesHeight + 70, title);
  drawXAxis(os, f, "time in the step (s)");
  auto laneTop = [&](size_t lane) {
    return f.top + laneGap / 2 + lane * (laneHeight + laneGap);
  };
  for (auto [lane, name] : llvm::enumerate(lanes)) {
    os << llvm::format("<rect class=\"lane\" x=\"%.1f\" y=\"%.1f\" "
                       "width=\"%.1f\" height=\"%.1f\"/>\n",
                       f.left, laneTop(lane), f.width, laneHeight);
    drawText(os, f.left - 8, laneTop(lane) + laneHeight / 2 + 4, "end", name);
  }

  for (const json::Value &value : *streams) {
    const json::Object *interval = value.getAsObject();
    std::optional<StringRef> stream = stringAt(interval, "stream");
    std::optional<double> start = numberAt(interval, "start");
    std::optional<double> end = numberAt(interval, "end");
    const auto *lane = stream ? llvm::find(lanes, *stream) : lanes.end();
    if (lane == lanes.end() || !start || !end)
      continue;
    size_t index = lane - lanes.begin();
    std::string tooltip =
        llvm::formatv("{0}: {1} to {2}", escapedOr(stringAt(interval, "label")),
                      formatSeconds(start), formatSeconds(end))
            .str();
    drawRect(os, f.px(*start), laneTop(index), f.px(*end) - f.px(*start),
             laneHeight, kStreamFills[index], tooltip);
  }
  os << "</svg>\n";
}

//===----------------------------------------------------------------------===//
// Page sections
//===----------------------------------------------------------------------===//

/// This page's rules after the shared ones (html::openPage).
constexpr StringRef kStyle = R"css(
.fits { font-weight: bold; padding: 0.1em 0.5em; border-radius: 4px;
        color: #fff; }
.fits.yes { background: #2e7d32; }
.fits.no { background: #c62828; }
.fits.unknown { background: #777; }
.violations { color: #c62828; }
.tables { display: flex; gap: 2em; flex-wrap: wrap; align-items: flex-start; }
svg .budget { stroke: #c62828; stroke-width: 1.5; stroke-dasharray: 6 4; }
svg text.budget-label { fill: #c62828; }
svg .area { fill: #4e79a7; fill-opacity: 0.25; stroke: none; }
svg .series { fill: none; stroke: #4e79a7; stroke-width: 1.5; }
svg .lane { fill: #f6f6f6; }
)css";

void renderHeader(raw_ostream &os, const json::Object *plan) {
  const json::Object *model = objectAt(plan, "model");
  const json::Object *video = objectAt(plan, "video");
  os << "<header>\n<h1>MegaSlide plan: " << escapedOr(stringAt(model, "name"))
     << "</h1>\n";
  os << "<p class=\"meta\">Model: "
     << escapedOr(stringAt(model, "architecture")) << ", "
     << formatCount(model, "num_layers") << " layers, dim "
     << formatCount(model, "dim") << " (" << formatCount(model, "num_heads")
     << " heads &times; " << formatCount(model, "head_dim") << "), ffn "
     << formatCount(model, "ffn_dim") << "</p>\n";
  os << "<p class=\"meta\">Video: " << formatCount(video, "frames")
     << " &times; " << formatCount(video, "height") << " &times; "
     << formatCount(video, "width") << " "
     << escapedOr(stringAt(video, "units")) << ", batch "
     << formatCount(video, "batch") << ", text length "
     << formatCount(video, "text_len") << " tokens</p>\n";

  std::optional<bool> fits = plan ? plan->getBoolean("fits") : std::nullopt;
  os << "<p>Fits the budgets: ";
  if (!fits)
    os << "<span class=\"fits unknown\">n/a</span>";
  else if (*fits)
    os << "<span class=\"fits yes\">yes</span>";
  else
    os << "<span class=\"fits no\">no</span>";
  os << "</p>\n";
  if (const json::Array *violations = arrayAt(plan, "violations");
      violations && !violations->empty()) {
    os << "<ul class=\"violations\">\n";
    for (const json::Value &violation : *violations)
      os << "<li>" << escapedOr(violation.getAsString()) << "</li>\n";
    os << "</ul>\n";
  }
  // Each change planned again (docs/PlanSchema.md, fit_options).
  if (const json::Array *options = arrayAt(plan, "fit_options");
      options && !options->empty()) {
    os << "<p>To fit (each change planned again; smallest change "
          "first):</p>\n<ul>\n";
    for (const json::Value &value : *options) {
      const json::Object *option = value.getAsObject();
      bool fits = option && option->getBoolean("fits").value_or(false);
      os << "<li><code>" << escapedOr(stringAt(option, "change"))
         << "</code>: " << escapedOr(stringAt(option, "what")) << "; "
         << (fits ? "fits" : "not enough") << ": needs "
         << formatGB(numberAt(option, "host_bytes")) << " of "
         << formatGB(numberAt(option, "host_budget_bytes")) << "; "
         << escapedOr(stringAt(option, "note")) << "</li>\n";
    }
    os << "</ul>\n";
  }
  os << "<p class=\"meta\">GB = 10^9 bytes.</p>\n</header>\n";
}

void renderSummary(raw_ostream &os, const json::Object *plan) {
  const json::Object *params = objectAt(plan, "params");
  const json::Object *budgets = objectAt(plan, "budgets");
  const json::Object *step = objectAt(plan, "step");
  const json::Object *transfers = objectAt(plan, "transfers");
  const json::Object *busy = objectAt(step, "busy_seconds");

  std::string grid = "n/a";
  if (const json::Array *extents = arrayAt(plan, "grid")) {
    grid.clear();
    for (const json::Value &extent : *extents) {
      std::optional<int64_t> n = extent.getAsInteger();
      grid += (grid.empty() ? "" : " &times; ") +
              (n ? std::to_string(*n) : std::string("n/a"));
    }
  }
  auto flopsAt = [](const json::Object *o, StringRef key) {
    std::optional<double> v = numberAt(o, key);
    return v ? llvm::formatv("{0:E3}", *v).str() : std::string("n/a");
  };
  std::string executed = flopsAt(step, "device_flops");
  std::optional<double> deviceFlops = numberAt(step, "device_flops"),
                        recompute = numberAt(step, "recompute_flops");
  if (deviceFlops && recompute && *deviceFlops > 0)
    executed += llvm::formatv(" ({0:F1}% recomputation)",
                              100.0 * *recompute / *deviceFlops)
                    .str();
  std::string mfu = "n/a";
  if (std::optional<double> m = numberAt(step, "mfu"))
    mfu = llvm::formatv("{0:F1}% of {1:F0} TFLOP/s", 100.0 * *m,
                        numberAt(step, "peak_flops").value_or(0) / 1e12)
              .str();
  std::string busyText;
  for (StringRef stream : kStreams)
    busyText += (busyText.empty() ? "" : ", ") + stream.str() + " " +
                formatSeconds(numberAt(busy, stream));

  os << "<h2>Summary</h2>\n<table>\n";
  renderRow(os, "Parameters",
            formatCount(params, "total") + " (" +
                formatCount(params, "trainable") + " trainable, " +
                formatCount(params, "frozen") + " frozen)");
  renderRow(os, "Tokens per sample",
            formatCount(plan, "tokens") + " (grid " + grid + ")");
  renderRow(os, "Model FLOPs per step, as built (global attention)",
            flopsAt(objectAt(plan, "flops"), "total"));
  renderRow(os, "Model FLOPs per step, as planned (no recomputation)",
            flopsAt(step, "model_flops"));
  renderRow(os, "Device FLOPs executed per step", executed);
  renderRow(os, "Predicted model-FLOP utilisation", mfu);
  renderRow(os, "Hardware",
            escapedOr(stringAt(objectAt(plan, "hardware"), "name")));
  renderRow(os, "Host memory",
            formatUsage(numberAt(objectAt(plan, "host"), "total_bytes"),
                        numberAt(budgets, "host_bytes")));
  renderRow(os, "Device peak",
            formatUsage(numberAt(objectAt(plan, "device"), "peak_bytes"),
                        numberAt(budgets, "gpu_bytes")));
  renderRow(os, "Step time",
            "predicted " + formatSeconds(numberAt(step, "predicted_seconds")) +
                ", lower bound " +
                formatSeconds(numberAt(step, "lower_bound_seconds")) +
                " (bound by " + escapedOr(stringAt(step, "bound_by")) + ")");
  renderRow(os, "Busy time per stream", busyText);
  if (const json::Object *tier = objectAt(plan, "nvme_tier"))
    renderRow(os, "NVMe tier (estimate)",
              formatGB(numberAt(tier, "bytes_read_per_step")) +
                  " read and written per step on " +
                  formatCount(tier, "drives") + " drive(s), I/O busy " +
                  formatSeconds(numberAt(tier, "io_busy_seconds")) +
                  ", adding " +
                  formatSeconds(numberAt(tier, "step_growth_seconds")) +
                  " to the step");
  renderRow(os, "Transfers",
            "host to device " + formatGB(numberAt(transfers, "h2d_bytes")) +
                ", device to host " +
                formatGB(numberAt(transfers, "d2h_bytes")));
  renderRow(os, "Host-state policy",
            escapedOr(stringAt(objectAt(plan, "policies"), "host_state")));
  os << "</table>\n";
}

/// A two-column table of a `{name: bytes}` object, largest first.
void renderBytesTable(raw_ostream &os, StringRef keyHeader,
                      const json::Object *byName) {
  os << "<table>\n<tr><th>" << keyHeader << "</th><th>GB</th></tr>\n";
  std::vector<std::pair<std::string, double>> entries = sortedEntries(byName);
  if (entries.empty())
    os << "<tr><td colspan=\"2\">n/a</td></tr>\n";
  for (const auto &[name, bytes] : entries)
    os << "<tr><td>" << escape(name) << "</td><td class=\"num\">"
       << formatGB(bytes) << "</td></tr>\n";
  os << "</table>\n";
}

void renderTopConsumers(raw_ostream &os, const json::Array *consumers) {
  os << "<table>\n<tr><th>live at the peak</th><th>GB</th></tr>\n";
  if (!consumers || consumers->empty())
    os << "<tr><td colspan=\"2\">n/a</td></tr>\n";
  else
    for (const json::Value &value : *consumers) {
      const json::Object *consumer = value.getAsObject();
      os << "<tr><td>" << escapedOr(stringAt(consumer, "what"))
         << "</td><td class=\"num\">" << formatGB(numberAt(consumer, "bytes"))
         << "</td></tr>\n";
    }
  os << "</table>\n";
}

/// The "Training recipe" section: the update mode and why, each mode's
/// host bytes and step, the recipe's features and what would make it fit.
void renderRecipe(raw_ostream &os, const json::Object *recipe) {
  os << "<h2>Training recipe</h2>\n";
  if (!recipe) {
    os << "<p>n/a</p>\n";
    return;
  }
  const json::Object *bytes = objectAt(recipe, "bytes");
  const json::Object *updates = objectAt(recipe, "deferred_updates");
  os << "<p>Update: <b>" << escapedOr(stringAt(recipe, "update")) << "</b> ("
     << escapedOr(stringAt(recipe, "reason")) << "); grad-accum "
     << formatCount(recipe, "grad_accum") << "; EMA "
     << escapedOr(stringAt(recipe, "ema")) << ". Host left for the recipe: "
     << formatGB(numberAt(recipe, "host_free_bytes")) << ".</p>\n";
  os << "<table>\n<tr><th>update mode</th><th>host memory</th><th>fits</th>"
        "<th>step</th><th>host optimizer</th><th>note</th></tr>\n";
  for (StringRef name : {"deferred", "streaming"}) {
    const json::Object *mode = objectAt(objectAt(recipe, "modes"), name);
    std::optional<bool> available =
        mode ? mode->getBoolean("available") : std::nullopt;
    std::optional<bool> fits =
        mode ? mode->getBoolean("host_fits") : std::nullopt;
    os << "<tr><td>" << name << "</td><td class=\"num\">"
       << (available.value_or(false) ? formatGB(numberAt(mode, "host_bytes"))
                                     : std::string("n/a"))
       << "</td><td>"
       << (!available.value_or(false) ? "n/a"
           : fits.value_or(false)     ? "yes"
                                      : "<span class=\"bad\">no</span>")
       << "</td><td class=\"num\">"
       << formatSeconds(numberAt(mode, "step_seconds"))
       << "</td><td class=\"num\">"
       << formatSeconds(numberAt(mode, "host_optimizer_seconds")) << "</td><td>"
       << escapedOr(stringAt(mode, "note")) << "</td></tr>\n";
  }
  os << "</table>\n<table>\n";
  renderRow(os, "Retained gradients (deferred update)",
            formatGB(numberAt(bytes, "retained_gradients")));
  renderRow(os, "Gradient accumulator (fp32)",
            formatGB(numberAt(bytes, "gradient_accumulator")) + ", " +
                formatSeconds(numberAt(recipe, "accumulate_seconds")) +
                " of adds per optimizer step (estimate)");
  renderRow(os, "EMA weights",
            formatGB(numberAt(bytes, "ema")) + ", " +
                formatSeconds(numberAt(recipe, "ema_seconds")) +
                " per optimizer step (estimate)");
  renderRow(os, "Deferred updates (replay)",
            formatSeconds(numberAt(updates, "update_seconds")) +
                " of AdamW before the fetches; the last ends at " +
                formatSeconds(numberAt(updates, "updates_end_seconds")) +
                ", the forward at " +
                formatSeconds(numberAt(updates, "forward_end_seconds")));
  renderRow(os, "Largest block update against its forward",
            "block " + formatCount(updates, "block") + ": " +
                formatSeconds(numberAt(updates, "block_update_seconds")) +
                " against " +
                formatSeconds(numberAt(updates, "block_forward_seconds")));
  std::optional<bool> deviceFits =
      recipe->getBoolean("device_accumulation_fits");
  renderRow(os, "Accumulating every gradient on the device",
            formatGB(numberAt(recipe, "device_accumulation_bytes")) +
                " (fp32): " +
                (deviceFits ? (*deviceFits ? "fits" : "does not fit") : "n/a"));
  renderRow(os, "Optimizer step",
            formatSeconds(numberAt(recipe, "optimizer_step_seconds")));
  os << "</table>\n";
  if (const json::Array *advice = arrayAt(recipe, "advice");
      advice && !advice->empty()) {
    os << "<ul class=\"violations\">\n";
    for (const json::Value &a : *advice)
      os << "<li>to fit: " << escapedOr(a.getAsString()) << "</li>\n";
    os << "</ul>\n";
  }
}

/// The "Job" section of a job of several ranks: a rank's step and
/// collectives, the job's throughput against one GPU, host memory per rank
/// and per node, and what would make it fit.
void renderJob(raw_ostream &os, const json::Object *job) {
  os << "<h2>Job: " << formatCount(job, "ranks") << " ranks, "
     << formatCount(job, "nodes") << " node(s) of "
     << formatCount(job, "gpus_per_node") << " GPUs</h2>\n<table>\n";
  renderRow(os, "Step per rank",
            formatSeconds(numberAt(job, "step_seconds_per_rank")) +
                " (norm all-reduce " +
                formatSeconds(numberAt(job, "norm_allreduce_seconds")) + ")");
  renderRow(os, "Collectives per rank (comm stream)",
            formatSeconds(numberAt(job, "collective_seconds")) + ", " +
                formatGB(numberAt(job, "collective_bytes_per_rank")) + " sent");
  renderRow(
      os, "Job samples/s",
      llvm::formatv("{0:F4}", numberAt(job, "samples_per_second").value_or(0))
          .str());
  renderRow(
      os, "One GPU (same model and options, replayed)",
      formatSeconds(numberAt(job, "one_gpu_step_seconds")) + ", " +
          llvm::formatv("{0:F4} samples/s",
                        numberAt(job, "one_gpu_samples_per_second").value_or(0))
              .str());
  renderRow(
      os, "Scaling efficiency",
      llvm::formatv("{0:P1}", numberAt(job, "scaling_efficiency").value_or(0))
          .str());
  renderRow(os, "Host memory per rank",
            formatGB(numberAt(job, "host_bytes_per_rank")));
  renderRow(os, "Host memory per node",
            formatGB(numberAt(job, "host_bytes_per_node")) + "; fits from " +
                formatCount(job, "nodes_to_fit_host") + " node(s)");
  os << "</table>\n";
  if (const json::Array *advice = arrayAt(job, "advice");
      advice && !advice->empty()) {
    os << "<ul class=\"violations\">\n";
    for (const json::Value &a : *advice)
      os << "<li>to fit: " << escapedOr(a.getAsString()) << "</li>\n";
    os << "</ul>\n";
  }
}

} // namespace

std::string megaslide::renderHtmlReport(const json::Value &plan) {
  const json::Object *root = plan.getAsObject();
  const json::Object *device = objectAt(root, "device");
  const json::Object *transfers = objectAt(root, "transfers");

  std::string page;
  llvm::raw_string_ostream os(page);
  html::openPage(os,
                 "MegaSlide plan: " +
                     escapedOr(stringAt(objectAt(root, "model"), "name")),
                 kStyle);
  renderHeader(os, root);
  renderSummary(os, root);

  os << "<h2>Device memory over the step</h2>\n";
  renderDeviceMemoryPlot(os, root);
  os << "<div class=\"tables\">\n";
  renderBytesTable(os, "device category at the peak",
                   objectAt(device, "by_category"));
  renderTopConsumers(os, arrayAt(device, "top_consumers"));
  os << "</div>\n";

  os << "<h2>Host memory by category</h2>\n";
  renderHostMemoryPlot(os, root);

  renderRecipe(os, objectAt(root, "recipe"));
  if (const json::Object *job = objectAt(root, "job"))
    renderJob(os, job);

  os << "<h2>Per layer</h2>\n";
  renderPerLayerPlot(os, root);

  os << "<h2>Streams</h2>\n";
  renderStreamPlot(os, root);
  os << "<div class=\"tables\">\n";
  renderBytesTable(os, "host to device", objectAt(transfers, "h2d_by_kind"));
  renderBytesTable(os, "device to host", objectAt(transfers, "d2h_by_kind"));
  os << "</div>\n";
  html::closePage(os);
  return page;
}
