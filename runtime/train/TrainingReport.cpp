//===- TrainingReport.cpp - A run's metrics as one HTML page --------------===//
//
// Reads the metrics log line by line, keeps the last line of each step,
// and draws every curve over the same step axis, so that a spike in the
// gradient norm lines up with the loss and step time it came with. The
// page's shell and plot frames are the plan report's (support/Html.h,
// support/Svg.h): inline CSS and SVG, no script and no URL, "n/a" and a
// sentence for what the file does not hold.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/train/TrainingReport.h"

#include "megaslide/Support/Units.h"
#include "megaslide/runtime/support/Html.h"
#include "megaslide/runtime/support/Json.h"
#include "megaslide/runtime/support/Svg.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>

using namespace megaslide;
using namespace megaslide::train;
using llvm::raw_ostream;
using llvm::StringRef;
using megaslide::html::renderRow;
using namespace megaslide::svg;
namespace json = llvm::json;

namespace {

constexpr double kBytesPerGB = 1e9;
constexpr double kBytesPerMB = 1e6;
/// Columns a plot is drawn in: a log of up to this many steps is drawn
/// point by point, a longer one column by column (drawnPoints), so a run of
/// a million steps gives a page of a few MB rather than of 90 that a
/// browser needs minutes to lay out. About twice the frame's 780 px, for
/// displays of two pixels per px.
constexpr size_t kPlotColumns = 2000;

// Series colours; red (kPalette[3], in the page's CSS) marks problems
// (skipped steps, non-finite values, clipping) and nothing else.
constexpr StringRef kLossColor = kPalette[0];
constexpr StringRef kValColor = kPalette[1];
constexpr StringRef kUnweightedColor = kPalette[2];
constexpr StringRef kLrColor = kPalette[2];
constexpr StringRef kGradColor = kPalette[6];
constexpr StringRef kTimeColor = kPalette[4];
constexpr StringRef kThroughputColor = kPalette[7];
constexpr StringRef kHostColor = kPalette[5];
constexpr StringRef kDeviceColor = kPalette[0];

//===----------------------------------------------------------------------===//
// Reading the metrics log
//===----------------------------------------------------------------------===//

/// One optimizer step as its (last) line gives it. Absent and null fields
/// are empty; non-finite numbers are kept as NaN or infinity.
struct StepRecord {
  int64_t step = 0;
  unsigned line = 0;
  std::optional<double> loss, valLoss, lr, gradNorm, seconds;
  std::optional<double> unweightedLoss; ///< a weighted loss's, if any
  std::optional<double> samplesPerSecond, tokensPerSecond;
  std::optional<double> hostRssBytes, devicePeakBytes;
  std::optional<int64_t> microBatches;
  bool clipped = false, skipped = false;
};

/// The numeric fields a line may have, as the page names them.
constexpr StringRef kNumberFields[] = {"loss",
                                       "val_loss",
                                       "lr",
                                       "grad_norm",
                                       "seconds",
                                       "samples_per_second",
                                       "tokens_per_second",
                                       "host_rss_bytes",
                                       "device_peak_bytes"};

struct Metrics {
  /// By step: the x axis, in order.
  std::map<int64_t, StepRecord> steps;
  /// Fields some line has with a value (not null), and fields some line
  /// has at all, null included.
  std::set<std::string, std::less<>> valued, present;
  /// Steps that more than one line gave (the later line kept).
  std::vector<int64_t> repeated;
  /// A last line that did not parse and had no newline: cut by a kill.
  std::optional<unsigned> cutLine;
};

llvm::Error lineError(unsigned line, const llvm::Twine &message) {
  return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                 "line " + llvm::Twine(line) + ": " + message);
}

/// `line` with the bare NaN, Infinity and -Infinity that Python's json
/// writes (JSON has no such tokens) quoted, so llvm::json reads them as
/// strings, which numberField takes as non-finite numbers.
std::string quoteNonFinite(StringRef line) {
  std::string out;
  bool inString = false;
  for (size_t i = 0; i < line.size(); ++i) {
    char c = line[i];
    if (inString) {
      out += c;
      if (c == '\\' && i + 1 < line.size())
        out += line[++i];
      else if (c == '"')
        inString = false;
      continue;
    }
    if (c == '"')
      inString = true;
    bool quoted = false;
    for (StringRef token : {"NaN", "Infinity", "-Infinity"})
      if (line.substr(i).starts_with(token)) {
        out += "\"" + token.str() + "\"";
        i += token.size() - 1;
        quoted = true;
        break;
      }
    if (!quoted)
      out += c;
  }
  return out;
}

/// The text of a parse error of one line, without llvm::json's
/// "[1:col, byte=N]: " prefix (its line is always 1 here): "column 7: ...".
std::string parseErrorText(llvm::Error error) {
  std::string text = llvm::toString(std::move(error));
  StringRef rest(text);
  if (rest.consume_front("[1:")) {
    StringRef column = rest.take_while(llvm::isDigit);
    size_t end = rest.find("]: ");
    if (!column.empty() && end != StringRef::npos)
      return "column " + column.str() + ": " + rest.substr(end + 3).str();
  }
  return text;
}

StringRef kindOf(const json::Value &value) {
  switch (value.kind()) {
  case json::Value::Null:
    return "null";
  case json::Value::Boolean:
    return "a boolean";
  case json::Value::Number:
    return "a number";
  case json::Value::String:
    return "a string";
  case json::Value::Array:
    return "an array";
  case json::Value::Object:
    return "an object";
  }
  return "a value";
}

/// Field `key` of `o` as a number: empty when absent or null; NaN and
/// infinities from the strings "NaN", "nan", "Infinity", "inf" (either
/// sign). Anything else is an error naming the line.
llvm::Expected<std::optional<double>>
numberField(const json::Object &o, StringRef key, unsigned line) {
  const json::Value *value = o.get(key);
  if (!value || value->kind() == json::Value::Null)
    return std::nullopt;
  if (std::optional<double> number = value->getAsNumber())
    return number;
  if (std::optional<StringRef> text = value->getAsString()) {
    StringRef word = *text;
    bool negative = word.consume_front("-");
    if (!negative)
      word.consume_front("+");
    if (word.equals_insensitive("nan"))
      return std::numeric_limits<double>::quiet_NaN();
    if (word.equals_insensitive("inf") || word.equals_insensitive("infinity"))
      return negative ? -std::numeric_limits<double>::infinity()
                      : std::numeric_limits<double>::infinity();
  }
  return lineError(line, "\"" + key + "\" must be a number or null, got " +
                             kindOf(*value));
}

llvm::Expected<bool> boolField(const json::Object &o, StringRef key,
                               unsigned line) {
  const json::Value *value = o.get(key);
  if (!value || value->kind() == json::Value::Null)
    return false;
  if (std::optional<bool> flag = value->getAsBoolean())
    return *flag;
  return lineError(line, "\"" + key + "\" must be true, false or null, got " +
                             kindOf(*value));
}

/// One line's object as a step record.
llvm::Expected<StepRecord> readStep(const json::Object &o, unsigned line,
                                    Metrics &m) {
  StepRecord r;
  r.line = line;
  const json::Value *step = o.get("step");
  if (!step)
    return lineError(line, "no \"step\" (every line of a metrics file has "
                           "the step it is of)");
  std::optional<int64_t> number = step->getAsInteger();
  if (!number || *number < 0)
    return lineError(line, "\"step\" must be a non-negative integer");
  r.step = *number;

  std::optional<double> *numbers[] = {&r.loss,
                                      &r.valLoss,
                                      &r.lr,
                                      &r.gradNorm,
                                      &r.seconds,
                                      &r.samplesPerSecond,
                                      &r.tokensPerSecond,
                                      &r.hostRssBytes,
                                      &r.devicePeakBytes};
  for (auto [key, slot] : llvm::zip(kNumberFields, numbers)) {
    llvm::Expected<std::optional<double>> value = numberField(o, key, line);
    if (!value)
      return value.takeError();
    *slot = *value;
  }
  // Only a weighted run's lines have it: not missing from the others.
  llvm::Expected<std::optional<double>> unweighted =
      numberField(o, "unweighted_loss", line);
  if (!unweighted)
    return unweighted.takeError();
  r.unweightedLoss = *unweighted;
  if (const json::Value *micro = o.get("micro_batches");
      micro && micro->kind() != json::Value::Null) {
    r.microBatches = micro->getAsInteger();
    if (!r.microBatches)
      return lineError(line, "\"micro_batches\" must be an integer or null");
  }
  llvm::Expected<bool> clipped = boolField(o, "clipped", line);
  if (!clipped)
    return clipped.takeError();
  llvm::Expected<bool> skipped = boolField(o, "skipped", line);
  if (!skipped)
    return skipped.takeError();
  r.clipped = *clipped;
  r.skipped = *skipped;

  for (const auto &entry : o) {
    m.present.insert(StringRef(entry.first).str());
    if (entry.second.kind() != json::Value::Null)
      m.valued.insert(StringRef(entry.first).str());
  }
  return r;
}

llvm::Expected<Metrics> readMetrics(StringRef text) {
  Metrics m;
  llvm::SmallVector<StringRef> lines;
  text.split(lines, '\n');
  bool endsWithNewline = text.ends_with("\n");
  for (auto [index, raw] : llvm::enumerate(lines)) {
    unsigned line = index + 1;
    StringRef trimmed = raw.trim();
    if (trimmed.empty())
      continue;
    bool last = index + 1 == lines.size() && !endsWithNewline;
    llvm::Expected<json::Value> parsed = parseJson(trimmed);
    if (!parsed) {
      llvm::Expected<json::Value> quoted = parseJson(quoteNonFinite(trimmed));
      if (quoted) {
        llvm::consumeError(parsed.takeError());
        parsed = std::move(quoted);
      } else {
        llvm::consumeError(quoted.takeError());
        if (last) {
          // A run killed while it wrote the line; megaslide-run drops it
          // too when it resumes (docs/Runtime.md, "Metrics are a log").
          llvm::consumeError(parsed.takeError());
          m.cutLine = line;
          continue;
        }
        return lineError(line,
                         "invalid JSON: " + parseErrorText(parsed.takeError()));
      }
    }
    const json::Object *o = parsed->getAsObject();
    if (!o)
      return lineError(line, "not a JSON object but " + kindOf(*parsed) +
                                 " (a metrics file has one object per step)");
    llvm::Expected<StepRecord> record = readStep(*o, line, m);
    if (!record)
      return record.takeError();
    auto [it, inserted] = m.steps.try_emplace(record->step, *record);
    if (!inserted) {
      m.repeated.push_back(record->step);
      it->second = *record;
    }
  }
  if (m.steps.empty())
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        m.cutLine ? "the metrics file holds no whole line (line " +
                        std::to_string(*m.cutLine) + " is cut short)"
                  : std::string("the metrics file is empty: no step"));
  llvm::sort(m.repeated);
  m.repeated.erase(std::unique(m.repeated.begin(), m.repeated.end()),
                   m.repeated.end());
  return m;
}

//===----------------------------------------------------------------------===//
// Formatting
//===----------------------------------------------------------------------===//

bool isFinite(const std::optional<double> &v) { return v && std::isfinite(*v); }

/// A figure with four significant digits ("0.5312", "1.2e-05").
std::string formatNumber(double value) {
  std::string text;
  llvm::raw_string_ostream(text) << llvm::format("%.4g", value);
  return text;
}

/// Bytes as decimal gigabytes, or megabytes under one gigabyte (the
/// small models of tests and examples).
std::string formatBytes(double bytes) {
  if (bytes < kBytesPerGB)
    return llvm::formatv("{0:F1} MB", bytes / kBytesPerMB).str();
  return llvm::formatv("{0:F2} GB", bytes / kBytesPerGB).str();
}

/// A list of steps, the first `max` of them: "3, 17 and 40".
std::string formatSteps(llvm::ArrayRef<int64_t> steps, size_t max = 12) {
  std::string text;
  for (auto [i, step] : llvm::enumerate(steps)) {
    if (i == max) {
      text += llvm::formatv(" and {0} more", steps.size() - max).str();
      break;
    }
    if (i > 0)
      text += i + 1 == steps.size() ? " and " : ", ";
    text += std::to_string(step);
  }
  return text;
}

/// A tick label: the shared fixed-point label, or four significant digits
/// where that would need more than four decimals (learning rates).
std::string axisLabel(double value, double step) {
  if (step < 1e-3)
    return formatNumber(std::abs(value) < step * 1e-6 ? 0 : value);
  return tickLabel(value, step);
}

//===----------------------------------------------------------------------===//
// Plots
//===----------------------------------------------------------------------===//

/// A (step, value) point.
using Point = std::pair<double, double>;

/// One line of a plot: (step, value) points, finite values only.
struct Series {
  std::string name; ///< legend text, escaped
  StringRef id;     ///< data-series: the metrics field it draws
  StringRef color;
  std::vector<Point> points;
  bool dots = false; ///< a circle at each point (sparse validation points)
};

/// Steps marked on the x axis rather than plotted (their value would
/// break the y scale or does not exist).
struct AxisMarks {
  std::string name; ///< legend text, escaped
  StringRef shape;  ///< "triangle" or "cross"
  std::vector<int64_t> steps;
  std::string why; ///< tooltip after "step N: ", escaped
};

struct Plot {
  Plot(StringRef id, StringRef title, std::string yLabel)
      : id(id), title(title), yLabel(std::move(yLabel)) {}
  StringRef id; ///< data-plot
  StringRef title;
  std::string yLabel;
  std::vector<Series> series;
  std::vector<AxisMarks> marks;
  /// Points drawn over the curve (clipped steps) and their legend text.
  std::vector<Point> highlights;
  std::string highlightName;
  /// A dashed horizontal line (the clipping threshold) and its caption.
  std::optional<double> threshold;
  std::string thresholdName;
  bool fromZero = true;
  bool logY = false;
  /// Said under the plot (the scale chosen and why).
  std::string caption;
};

/// The y axis of `f`: linear, or logarithmic with ticks at decades (and 2
/// and 5 times them where it spans few decades).
void drawMetricYAxis(raw_ostream &os, const Frame &f, StringRef label) {
  // Room for tick labels of four significant digits ("1.2e-05").
  constexpr double labelGap = 62;
  if (!f.logY)
    return svg::drawYAxis(os, f, label, labelGap, axisLabel);
  int first = static_cast<int>(std::floor(f.y.min + 1e-9));
  int last = static_cast<int>(std::ceil(f.y.max - 1e-9));
  bool fine = last - first <= 2;
  for (int decade = first; decade <= last; ++decade)
    for (double multiple : {1.0, 2.0, 5.0}) {
      if (multiple != 1 && !fine)
        continue;
      double value = multiple * std::pow(10.0, decade);
      double at = std::log10(value);
      if (at < f.y.min - 1e-9 || at > f.y.max + 1e-9)
        continue;
      drawYTick(os, f, value, formatNumber(value));
    }
  drawYAxisLine(os, f, label, labelGap);
}

/// A mark on the x axis at `x`: a triangle (skipped step) or a cross
/// (non-finite value), with a tooltip.
void drawAxisMark(raw_ostream &os, double x, double y, StringRef shape,
                  StringRef tooltip) {
  if (shape == "triangle")
    os << llvm::format("<path class=\"mark\" d=\"M%.1f,%.1f l5,9 l-10,0 Z\">",
                       x, y - 9);
  else
    os << llvm::format("<path class=\"mark cross\" d=\"M%.1f,%.1f l8,8 "
                       "m0,-8 l-8,8\">",
                       x - 4, y - 9);
  os << "<title>" << tooltip << "</title></path>\n";
}

/// Legend entries in one row above the frame, not wrapped (a plot has at
/// most five): each a swatch as the plot draws it, and its name.
void drawLegend(raw_ostream &os, const Plot &plot, double left, double y) {
  LegendLayout legend{left, /*nameOffset=*/23, /*pad=*/40, /*charWidth=*/7};
  double x = left;
  auto name = [&](StringRef text) {
    legend.drawName(os, x, y, text);
    x += legend.entryWidth(text);
  };
  for (const Series &s : plot.series) {
    os << llvm::format("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" "
                       "y2=\"%.1f\" stroke=\"",
                       x, y - 4, x + 18, y - 4)
       << s.color << "\" stroke-width=\"2\"/>\n";
    name(s.name);
  }
  if (!plot.highlights.empty()) {
    os << llvm::format("<circle class=\"highlight\" cx=\"%.1f\" cy=\"%.1f\" "
                       "r=\"3.5\"/>\n",
                       x + 9, y - 4);
    name(plot.highlightName);
  }
  if (plot.threshold) {
    drawLine(os, x, y - 4, x + 18, y - 4, "threshold");
    name(plot.thresholdName);
  }
  for (const AxisMarks &marks : plot.marks) {
    if (marks.steps.empty())
      continue;
    drawAxisMark(os, x + 9, y + 1, marks.shape, marks.name);
    name(marks.name);
  }
}

/// The column of the plot that `step` is drawn in.
size_t columnOf(double step, double xMin, double xMax) {
  if (xMax <= xMin)
    return 0;
  double at = (step - xMin) / (xMax - xMin) * kPlotColumns;
  return std::min(static_cast<size_t>(std::max(at, 0.0)), kPlotColumns - 1);
}

/// Calls `body(begin, end)` for each run of `points` (in step order) that
/// falls in one column.
template <typename Body>
void forEachColumn(llvm::ArrayRef<Point> points, double xMin, double xMax,
                   Body body) {
  for (size_t begin = 0; begin < points.size();) {
    size_t column = columnOf(points[begin].first, xMin, xMax);
    size_t end = begin + 1;
    while (end < points.size() &&
           columnOf(points[end].first, xMin, xMax) == column)
      ++end;
    body(begin, end);
    begin = end;
  }
}

/// The points of a curve as drawn: all of them when there are no more than
/// columns, else per column its first, smallest, largest and last point,
/// in step order. The extremes keep a one-step spike on the curve; first
/// and last join the columns as the full curve would.
std::vector<Point> drawnPoints(llvm::ArrayRef<Point> points, double xMin,
                               double xMax) {
  if (points.size() <= kPlotColumns)
    return points.vec();
  std::vector<Point> drawn;
  forEachColumn(points, xMin, xMax, [&](size_t begin, size_t end) {
    size_t lo = begin, hi = begin;
    for (size_t i = begin; i < end; ++i) {
      if (points[i].second < points[lo].second)
        lo = i;
      if (points[i].second > points[hi].second)
        hi = i;
    }
    size_t keep[] = {begin, std::min(lo, hi), std::max(lo, hi), end - 1};
    for (auto [i, index] : llvm::enumerate(keep))
      if (i == 0 || index != keep[i - 1])
        drawn.push_back(points[index]);
  });
  return drawn;
}

/// A tooltip's steps: "step 7", or "3 steps from 7 to 9".
std::string stepsText(double first, double last, size_t count) {
  if (count == 1)
    return "step " + std::to_string(static_cast<int64_t>(first));
  return llvm::formatv("{0} steps from {1} to {2}", count,
                       static_cast<int64_t>(first), static_cast<int64_t>(last))
      .str();
}

void renderPlot(raw_ostream &os, const Plot &plot, double xMin, double xMax,
                StringRef emptyMessage) {
  double yMin = std::numeric_limits<double>::infinity(), yMax = -yMin;
  size_t count = 0;
  for (const Series &s : plot.series)
    for (auto [step, value] : s.points) {
      yMin = std::min(yMin, value);
      yMax = std::max(yMax, value);
      ++count;
    }
  bool anyMarks = llvm::any_of(
      plot.marks, [](const AxisMarks &m) { return !m.steps.empty(); });
  if (count == 0 && !anyMarks)
    return emptySvg(os, plot.title, html::escape(emptyMessage), plot.id);

  Range y{0, 1}; // log10 units with plot.logY
  if (count > 0) {
    if (plot.threshold) {
      yMin = std::min(yMin, *plot.threshold);
      yMax = std::max(yMax, *plot.threshold);
    }
    if (plot.logY) {
      y.min = std::log10(yMin);
      y.max = std::log10(yMax);
      double pad = std::max(0.05 * (y.max - y.min), 0.02);
      y.min -= pad;
      y.max += pad;
    } else {
      if (plot.fromZero)
        yMin = std::min(0.0, yMin);
      double pad = 0.05 * (yMax - yMin);
      if (pad <= 0)
        pad = yMax != 0 ? std::abs(yMax) * 0.1 : 1;
      y.min = plot.fromZero && yMin >= 0 ? yMin : yMin - pad;
      y.max = yMax + pad;
    }
  }

  double height = 300;
  Frame f{90, 34, kWidth - 120, height - 34 - 52, {xMin, xMax}, y, plot.logY};
  openSvg(os, height, plot.title, plot.id);
  drawLegend(os, plot, f.left, 16);
  if (count > 0)
    drawMetricYAxis(os, f, plot.yLabel);
  else
    drawText(os, f.left + f.width / 2, f.top + f.height / 2, "middle",
             html::escape(emptyMessage));
  drawXAxis(os, f, "step", /*minStep=*/1);

  if (plot.threshold && count > 0) {
    double ty = f.py(*plot.threshold);
    drawLine(os, f.left, ty, f.right(), ty, "threshold");
  }
  bool downsampled = false, grouped = false;
  for (const Series &s : plot.series) {
    if (s.points.empty())
      continue;
    std::vector<Point> drawn = drawnPoints(s.points, f.x.min, f.x.max);
    downsampled |= drawn.size() < s.points.size();
    os << "<polyline class=\"series\" data-series=\"" << s.id << "\" stroke=\""
       << s.color << "\" points=\"";
    for (auto [i, point] : llvm::enumerate(drawn))
      os << (i ? " " : "")
         << llvm::format("%.1f,%.1f", f.px(point.first), f.py(point.second));
    os << "\"/>\n";
    if (s.dots || drawn.size() < 2)
      for (auto [step, value] : drawn)
        os << llvm::format("<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" ",
                           f.px(step), f.py(value))
           << "fill=\"" << s.color << "\"><title>step "
           << static_cast<int64_t>(step) << ": " << formatNumber(value)
           << "</title></circle>\n";
  }
  // Several clipped steps in one column: one circle, at the largest of
  // them, whose tooltip counts them.
  forEachColumn(
      plot.highlights, f.x.min, f.x.max, [&](size_t begin, size_t end) {
        auto top = std::max_element(
            plot.highlights.begin() + begin, plot.highlights.begin() + end,
            [](const Point &a, const Point &b) { return a.second < b.second; });
        os << llvm::format(
                  "<circle class=\"highlight\" cx=\"%.1f\" cy=\"%.1f\" "
                  "r=\"3.5\">",
                  f.px(top->first), f.py(top->second))
           << "<title>"
           << stepsText(plot.highlights[begin].first,
                        plot.highlights[end - 1].first, end - begin)
           << ": " << plot.highlightName << "</title></circle>\n";
        grouped |= end - begin > 1;
      });
  for (const AxisMarks &marks : plot.marks) {
    std::vector<Point> steps;
    for (int64_t step : marks.steps)
      steps.emplace_back(static_cast<double>(step), 0);
    forEachColumn(steps, f.x.min, f.x.max, [&](size_t begin, size_t end) {
      drawAxisMark(
          os, f.px(steps[begin].first), f.bottom(), marks.shape,
          stepsText(steps[begin].first, steps[end - 1].first, end - begin) +
              ": " + marks.why);
      grouped |= end - begin > 1;
    });
  }
  os << "</svg>\n";
  std::string caption = plot.caption;
  if (downsampled || grouped) {
    size_t total = 0;
    for (const Series &s : plot.series)
      total += s.points.size();
    caption +=
        llvm::formatv("{0}Downsampled for drawing: {1} points in {2} columns, "
                      "each column drawn by its first, last, smallest and "
                      "largest value, so a spike of one step stays; several "
                      "marked steps in one column are one mark that counts "
                      "them.",
                      caption.empty() ? "" : " ", total, kPlotColumns)
            .str();
  }
  if (!caption.empty())
    os << "<p class=\"meta\">" << caption << "</p>\n";
}

/// Why a field has nothing to plot: never in the file, or only null.
/// `brief` for the summary table, whose notes list the absent fields.
std::string missingText(const Metrics &m, StringRef field, StringRef nullWhy,
                        bool brief = false) {
  if (!m.present.count(field)) {
    if (brief)
      return "n/a: not in the file";
    bool old = field == "loss" || field == "seconds";
    return "n/a: no line has \"" + field.str() + "\"" +
           (old ? ""
                : " (files of older runs have only step, loss and "
                  "seconds)");
  }
  if (!m.valued.count(field))
    return "n/a: \"" + field.str() + "\" is null on every line" +
           (nullWhy.empty() ? "" : " (" + nullWhy.str() + ")");
  return "n/a: \"" + field.str() + "\" is not finite on any line";
}

/// The points of a field over the steps; the steps where it is not finite
/// go to `nonFinite` (when given).
template <typename Get>
std::vector<Point> pointsOf(const Metrics &m, Get get,
                            std::vector<int64_t> *nonFinite = nullptr,
                            double scale = 1) {
  std::vector<Point> points;
  for (const auto &[step, r] : m.steps) {
    std::optional<double> value = get(r);
    if (isFinite(value))
      points.emplace_back(static_cast<double>(step), *value * scale);
    else if (value && nonFinite)
      nonFinite->push_back(step);
  }
  return points;
}

std::vector<int64_t> skippedSteps(const Metrics &m) {
  std::vector<int64_t> steps;
  for (const auto &[step, r] : m.steps)
    if (r.skipped)
      steps.push_back(step);
  return steps;
}

std::optional<double> maxGradNormSetting(const TrainingReportInfo &info) {
  for (const auto &[name, value] : info.settings) {
    double threshold;
    if (name == "max_grad_norm" &&
        llvm::to_float(StringRef(value).trim(), threshold) &&
        std::isfinite(threshold) && threshold > 0)
      return threshold;
  }
  return std::nullopt;
}

void renderLossPlot(raw_ostream &os, const Metrics &m,
                    const TrainingReportInfo &info, double xMin, double xMax) {
  Plot plot{"loss", "Loss", "loss"};
  std::vector<int64_t> nonFinite;
  plot.series.push_back(
      {"train loss", "loss", kLossColor,
       pointsOf(
           m, [](const StepRecord &r) { return r.loss; }, &nonFinite)});
  std::vector<int64_t> valNonFinite;
  plot.series.push_back(
      {"validation loss", "val_loss", kValColor,
       pointsOf(
           m, [](const StepRecord &r) { return r.valLoss; }, &valNonFinite),
       /*dots=*/true});
  std::vector<int64_t> skipped = skippedSteps(m);
  // A skipped step's loss is the reason it was skipped: one mark, not two.
  llvm::erase_if(nonFinite, [&](int64_t step) {
    return std::binary_search(skipped.begin(), skipped.end(), step);
  });
  llvm::append_range(nonFinite, valNonFinite);
  llvm::sort(nonFinite);
  nonFinite.erase(std::unique(nonFinite.begin(), nonFinite.end()),
                  nonFinite.end());
  if (plot.series[1].points.empty())
    plot.series.pop_back();
  // A weighted run's (--weighting-scheme): what the weights leave out.
  std::vector<Point> unweighted =
      pointsOf(m, [](const StepRecord &r) { return r.unweightedLoss; });
  if (!unweighted.empty())
    plot.series.push_back({"unweighted train loss", "unweighted_loss",
                           kUnweightedColor, std::move(unweighted)});
  plot.marks.push_back({"skipped step", "triangle", skipped,
                        "skipped (no update: its loss or gradients were not "
                        "finite)"});
  plot.marks.push_back(
      {"non-finite loss", "cross", nonFinite, "the loss is not finite"});
  plot.fromZero = false;

  double lo = std::numeric_limits<double>::infinity(), hi = 0;
  for (const Series &s : plot.series)
    for (auto [step, value] : s.points) {
      lo = std::min(lo, value);
      hi = std::max(hi, value);
    }
  bool positive = lo > 0 && std::isfinite(lo);
  double ratio = positive ? hi / lo : 0;
  switch (info.lossScale) {
  case LossScale::Linear:
    plot.caption = "Linear loss axis, as asked.";
    break;
  case LossScale::Log:
    plot.logY = positive;
    plot.caption = positive ? "Logarithmic loss axis, as asked."
                            : "Linear loss axis: a loss is zero or negative, "
                              "which a logarithmic axis cannot show.";
    break;
  case LossScale::Auto:
    plot.logY = positive && ratio >= kLogLossRatio;
    if (plot.logY)
      plot.caption = llvm::formatv("Logarithmic loss axis: the largest loss "
                                   "is {0:F0} times the smallest.",
                                   ratio)
                         .str();
    break;
  }
  std::string empty =
      missingText(m, "loss", "the sim backend measures time, not loss");
  renderPlot(os, plot, xMin, xMax, empty);
}

void renderLrPlot(raw_ostream &os, const Metrics &m, double xMin, double xMax) {
  Plot plot{"lr", "Learning rate", "learning rate"};
  plot.series.push_back(
      {"learning rate", "lr", kLrColor,
       pointsOf(m, [](const StepRecord &r) { return r.lr; })});
  renderPlot(os, plot, xMin, xMax, missingText(m, "lr", ""));
}

void renderGradNormPlot(raw_ostream &os, const Metrics &m,
                        const TrainingReportInfo &info, double xMin,
                        double xMax) {
  Plot plot{"grad_norm", "Gradient norm", "global gradient norm"};
  std::vector<int64_t> nonFinite;
  plot.series.push_back(
      {"gradient norm (before clipping)", "grad_norm", kGradColor,
       pointsOf(
           m, [](const StepRecord &r) { return r.gradNorm; }, &nonFinite)});
  for (const auto &[step, r] : m.steps)
    if (r.clipped && isFinite(r.gradNorm))
      plot.highlights.emplace_back(static_cast<double>(step), *r.gradNorm);
  plot.highlightName = "clipped";
  if (std::optional<double> threshold = maxGradNormSetting(info)) {
    plot.threshold = threshold;
    plot.thresholdName = "max_grad_norm " + formatNumber(*threshold);
  }
  std::vector<int64_t> skipped = skippedSteps(m);
  llvm::erase_if(nonFinite, [&](int64_t step) {
    return std::binary_search(skipped.begin(), skipped.end(), step);
  });
  plot.marks.push_back({"skipped step", "triangle", skipped, "skipped"});
  plot.marks.push_back({"non-finite gradient norm", "cross", nonFinite,
                        "the gradient norm is not finite"});
  std::string empty =
      missingText(m, "grad_norm", "the sim backend computes no gradients");
  renderPlot(os, plot, xMin, xMax, empty);
}

void renderTimePlot(raw_ostream &os, const Metrics &m, double xMin,
                    double xMax) {
  Plot plot{"seconds", "Step time", "seconds per step"};
  plot.series.push_back(
      {"step time", "seconds", kTimeColor,
       pointsOf(m, [](const StepRecord &r) { return r.seconds; })});
  renderPlot(os, plot, xMin, xMax, missingText(m, "seconds", ""));
}

void renderThroughputPlot(raw_ostream &os, const Metrics &m, double xMin,
                          double xMax) {
  // Samples per second where the file has them; tokens per second is the
  // same curve scaled by the tokens of a sample.
  bool samples = m.valued.count("samples_per_second");
  bool tokens = !samples && m.valued.count("tokens_per_second");
  Plot plot{"throughput", "Throughput",
            tokens ? "tokens per second" : "samples per second"};
  plot.series.push_back(
      {tokens ? "tokens per second" : "samples per second",
       tokens ? "tokens_per_second" : "samples_per_second", kThroughputColor,
       pointsOf(m, [&](const StepRecord &r) {
         return tokens ? r.tokensPerSecond : r.samplesPerSecond;
       })});
  renderPlot(os, plot, xMin, xMax, missingText(m, "samples_per_second", ""));
}

void renderMemoryPlot(raw_ostream &os, const Metrics &m, double xMin,
                      double xMax) {
  // Gigabytes, or megabytes when the peak is under one gigabyte.
  double peak = 0;
  for (const auto &[step, r] : m.steps)
    for (const std::optional<double> &bytes :
         {r.hostRssBytes, r.devicePeakBytes})
      if (isFinite(bytes))
        peak = std::max(peak, *bytes);
  bool gb = peak >= kBytesPerGB;
  double scale = 1 / (gb ? kBytesPerGB : kBytesPerMB);
  Plot plot{"memory", "Memory", gb ? "GB" : "MB"};
  plot.series.push_back(
      {"host peak RSS", "host_rss_bytes", kHostColor,
       pointsOf(
           m, [](const StepRecord &r) { return r.hostRssBytes; }, nullptr,
           scale)});
  plot.series.push_back(
      {"device peak", "device_peak_bytes", kDeviceColor,
       pointsOf(
           m, [](const StepRecord &r) { return r.devicePeakBytes; }, nullptr,
           scale)});
  llvm::erase_if(plot.series, [](const Series &s) { return s.points.empty(); });
  renderPlot(os, plot, xMin, xMax, missingText(m, "host_rss_bytes", ""));
}

//===----------------------------------------------------------------------===//
// Page sections
//===----------------------------------------------------------------------===//

/// This page's rules after the shared ones (html::openPage).
constexpr StringRef kStyle = R"css(
svg .series { fill: none; stroke-width: 2; stroke-linejoin: round; }
svg .threshold { stroke: #c62828; stroke-width: 1.5; stroke-dasharray: 6 4; }
svg .highlight { fill: none; stroke: #e15759; stroke-width: 1.5; }
svg .mark { fill: #e15759; stroke: #e15759; stroke-width: 2; }
svg .mark.cross { fill: none; }
)css";

/// The mean of the finite values of a field, and how many there are.
template <typename Get>
std::pair<double, size_t> meanOf(const Metrics &m, Get get,
                                 bool skipFirst = false) {
  double sum = 0;
  size_t count = 0;
  for (const auto &[step, r] : m.steps) {
    if (skipFirst && step == m.steps.begin()->first)
      continue;
    std::optional<double> value = get(r);
    if (isFinite(value)) {
      sum += *value;
      ++count;
    }
  }
  return {count ? sum / count : 0, count};
}

void renderSummary(raw_ostream &os, const Metrics &m) {
  int64_t first = m.steps.begin()->first, last = m.steps.rbegin()->first;
  auto na = [&](StringRef field, StringRef nullWhy) {
    return html::escape(missingText(m, field, nullWhy, /*brief=*/true));
  };
  os << "<h2>Summary</h2>\n<table>\n";
  std::string steps =
      llvm::formatv("{0} (step {1} to {2})", m.steps.size(), first, last).str();
  if (static_cast<int64_t>(m.steps.size()) != last - first + 1)
    steps += llvm::formatv(", {0} steps of the range have no line",
                           last - first + 1 - m.steps.size())
                 .str();
  renderRow(os, "Steps", steps);

  // The last and smallest finite values of a field.
  auto lastAndMin = [&](auto get, StringRef field, StringRef nullWhy) {
    std::optional<std::pair<int64_t, double>> lastValue, minValue;
    for (const auto &[step, r] : m.steps) {
      std::optional<double> value = get(r);
      if (!isFinite(value))
        continue;
      lastValue = {step, *value};
      if (!minValue || *value < minValue->second)
        minValue = {step, *value};
    }
    if (!lastValue)
      return na(field, nullWhy);
    return llvm::formatv("last {0} (step {1}), smallest {2} (step {3})",
                         formatNumber(lastValue->second), lastValue->first,
                         formatNumber(minValue->second), minValue->first)
        .str();
  };
  renderRow(os, "Train loss",
            lastAndMin([](const StepRecord &r) { return r.loss; }, "loss",
                       "the sim backend measures time, not loss"));
  renderRow(os, "Validation loss",
            m.present.count("val_loss")
                ? lastAndMin([](const StepRecord &r) { return r.valLoss; },
                             "val_loss", "")
                : std::string("n/a: no validation ran"));
  std::optional<double> lastLr;
  for (const auto &[step, r] : m.steps)
    if (isFinite(r.lr))
      lastLr = r.lr;
  renderRow(os, "Learning rate",
            lastLr ? "last " + formatNumber(*lastLr) : na("lr", ""));

  auto [meanTime, timed] =
      meanOf(m, [](const StepRecord &r) { return r.seconds; });
  if (timed) {
    std::string text =
        llvm::formatv("mean {0} over {1} step{2}", formatSeconds(meanTime),
                      timed, timed == 1 ? "" : "s")
            .str();
    auto [meanRest, rest] = meanOf(
        m, [](const StepRecord &r) { return r.seconds; }, true);
    if (rest && rest + 1 == timed)
      text += ", " + formatSeconds(meanRest) +
              " without the first (which includes warming up)";
    renderRow(os, "Step time", text);
  } else {
    renderRow(os, "Step time", na("seconds", ""));
  }
  auto [samples, sampled] =
      meanOf(m, [](const StepRecord &r) { return r.samplesPerSecond; });
  auto [tokens, tokened] =
      meanOf(m, [](const StepRecord &r) { return r.tokensPerSecond; });
  std::string throughput;
  if (sampled)
    throughput = "mean " + formatNumber(samples) + " samples/s";
  if (tokened)
    throughput += (throughput.empty() ? "mean " : ", ") + formatNumber(tokens) +
                  " tokens/s";
  renderRow(os, "Throughput",
            throughput.empty() ? na("samples_per_second", "") : throughput);

  std::vector<int64_t> skipped = skippedSteps(m), clipped, nonFinite;
  std::set<int64_t> micro;
  for (const auto &[step, r] : m.steps) {
    if (r.clipped)
      clipped.push_back(step);
    if ((r.loss && !std::isfinite(*r.loss)) ||
        (r.gradNorm && !std::isfinite(*r.gradNorm)) ||
        (r.valLoss && !std::isfinite(*r.valLoss)))
      nonFinite.push_back(step);
    if (r.microBatches)
      micro.insert(*r.microBatches);
  }
  renderRow(os, "Skipped steps",
            skipped.empty()
                ? std::string(m.present.count("skipped")
                                  ? "none"
                                  : "none "
                                    "marked (the file has no \"skipped\")")
                : "<span class=\"bad\">" + std::to_string(skipped.size()) +
                      ": step " + formatSteps(skipped) + "</span>");
  renderRow(os, "Clipped steps",
            !m.present.count("clipped")
                ? na("clipped", "")
                : llvm::formatv("{0} of {1} ({2:F0}%)", clipped.size(),
                                m.steps.size(),
                                100.0 * clipped.size() / m.steps.size())
                      .str());
  if (!nonFinite.empty())
    renderRow(os, "Non-finite values",
              "<span class=\"bad\">step " + formatSteps(nonFinite) + "</span>");
  if (!micro.empty())
    renderRow(os, "Micro-batches per step",
              micro.size() == 1
                  ? std::to_string(*micro.begin())
                  : llvm::formatv("{0} to {1}", *micro.begin(), *micro.rbegin())
                        .str());
  auto peak = [&](auto get, StringRef field) {
    std::optional<double> best;
    for (const auto &[step, r] : m.steps)
      if (std::optional<double> value = get(r); isFinite(value))
        best = std::max(best.value_or(0), *value);
    return best ? formatBytes(*best) : na(field, "");
  };
  renderRow(os, "Peak host RSS",
            peak([](const StepRecord &r) { return r.hostRssBytes; },
                 "host_rss_bytes"));
  renderRow(os, "Peak device memory",
            peak([](const StepRecord &r) { return r.devicePeakBytes; },
                 "device_peak_bytes"));
  os << "</table>\n";
}

/// What the reader should know about the file itself.
void renderNotes(raw_ostream &os, const Metrics &m) {
  std::vector<std::string> notes;
  std::vector<std::string> absent;
  for (StringRef field : kNumberFields)
    if (!m.present.count(field.str()))
      absent.push_back("\"" + field.str() + "\"");
  for (StringRef field : {"micro_batches", "clipped", "skipped"})
    if (!m.present.count(field))
      absent.push_back("\"" + field.str() + "\"");
  if (!absent.empty())
    notes.push_back("Not in this file: " + llvm::join(absent, ", ") +
                    ". Their plots and figures say n/a.");
  if (!m.repeated.empty())
    notes.push_back(llvm::formatv("Step{0} {1} appear{2} on more than one "
                                  "line (a run appended after a resume, or "
                                  "concatenated files): the later line of "
                                  "each is shown.",
                                  m.repeated.size() == 1 ? "" : "s",
                                  formatSteps(m.repeated),
                                  m.repeated.size() == 1 ? "s" : "")
                        .str());
  if (m.cutLine)
    notes.push_back(llvm::formatv("Line {0} is cut short (no newline at the "
                                  "end: a run killed while writing it) and "
                                  "left out.",
                                  *m.cutLine)
                        .str());
  if (notes.empty())
    return;
  os << "<ul class=\"meta\">\n";
  for (const std::string &note : notes)
    os << "<li>" << html::escape(note) << "</li>\n";
  os << "</ul>\n";
}

void renderSettings(raw_ostream &os, const TrainingReportInfo &info) {
  os << "<h2>Settings</h2>\n<table>\n";
  if (info.settings.empty())
    os << "<tr><td>none given</td></tr>\n";
  for (const auto &[name, value] : info.settings)
    renderRow(os, html::escape(name), html::escape(value));
  os << "</table>\n";
}

void renderBuckets(raw_ostream &os, const TrainingReportInfo &info) {
  if (info.buckets.empty())
    return;
  os << "<h2>Buckets</h2>\n<table>\n<tr><th>bucket</th><th>samples</th>"
        "<th>planned device peak</th><th>predicted step</th></tr>\n";
  for (const TrainingReportInfo::Bucket &b : info.buckets)
    os << "<tr><td>" << html::escape(b.name) << "</td><td>" << b.samples
       << "</td><td>" << formatBytes(double(b.devicePeakBytes)) << "</td><td>"
       << (b.predictedSeconds > 0
               ? llvm::formatv("{0:F3} s", b.predictedSeconds).str()
               : std::string("unknown"))
       << "</td></tr>\n";
  os << "</table>\n";
}

} // namespace

llvm::Expected<std::string>
megaslide::train::trainingReportHtml(StringRef metricsJsonl,
                                     const TrainingReportInfo &info) {
  llvm::Expected<Metrics> metrics = readMetrics(metricsJsonl);
  if (!metrics)
    return metrics.takeError();
  const Metrics &m = *metrics;
  double xMin = static_cast<double>(m.steps.begin()->first);
  double xMax = static_cast<double>(m.steps.rbegin()->first);

  std::string title = html::escape(info.title);
  std::string page;
  llvm::raw_string_ostream os(page);
  html::openPage(os, title, kStyle);
  os << "<header>\n<h1>" << title << "</h1>\n"
     << "<p class=\"meta\">" << m.steps.size() << " optimizer step"
     << (m.steps.size() == 1 ? "" : "s")
     << " from the metrics log; GB = 10^9 bytes, MB = 10^6 bytes.</p>\n"
     << "</header>\n";
  renderSummary(os, m);
  renderNotes(os, m);

  os << "<h2>Loss</h2>\n";
  renderLossPlot(os, m, info, xMin, xMax);
  os << "<h2>Learning rate</h2>\n";
  renderLrPlot(os, m, xMin, xMax);
  os << "<h2>Gradient norm</h2>\n";
  renderGradNormPlot(os, m, info, xMin, xMax);
  os << "<h2>Step time</h2>\n";
  renderTimePlot(os, m, xMin, xMax);
  os << "<h2>Throughput</h2>\n";
  renderThroughputPlot(os, m, xMin, xMax);
  os << "<h2>Memory</h2>\n";
  renderMemoryPlot(os, m, xMin, xMax);
  renderSettings(os, info);
  renderBuckets(os, info);
  html::closePage(os);
  return page;
}
