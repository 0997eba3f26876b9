//===- Svg.h - Inline SVG plots of the HTML pages ---------------*- C++ -*-===//
//
// The drawing both reports use, the plan report (lib/Report/HtmlReport.cpp)
// and the training report (runtime/train/TrainingReport.cpp): a plot frame
// mapping data to pixels, axes with round ticks and grid lines, the plot
// that says it has no data, legend layout and the primitives. Each report
// keeps only its own plots. The CSS classes drawn here (axis, grid) are
// styled by the page shell (support/Html.h). No MLIR: the training report
// is built in the runtime-only build too, which has no lib/Report.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_SUPPORT_SVG_H
#define MEGASLIDE_RUNTIME_SUPPORT_SVG_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/raw_ostream.h"

#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace megaslide::svg {

/// The width of every plot in SVG pixels; the page's CSS scales plots
/// down to narrower windows.
inline constexpr double kWidth = 900;

/// Fills and strokes of series and categories (Tableau 10). Red
/// (kPalette[3], and #c62828 in the page's CSS) marks problems and
/// budgets, nothing else.
inline constexpr std::array<llvm::StringLiteral, 8> kPalette = {
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759",
    "#76b7b2", "#edc948", "#b07aa1", "#9c755f"};

/// A data interval; an empty or inverted one widens to one unit so that
/// mapping into it never divides by zero.
struct Range {
  double min, max;
  Range(double min, double max) : min(min), max(max > min ? max : min + 1) {}
  double span() const { return max - min; }
};

/// A plot area in SVG pixels and the data window it shows. With `logY`
/// the y range is in log10 units and py takes data values.
struct Frame {
  double left, top, width, height;
  Range x, y;
  bool logY = false;

  double px(double value) const {
    return left + (value - x.min) / x.span() * width;
  }
  double py(double value) const {
    double at = logY ? std::log10(value) : value;
    return top + height - (at - y.min) / y.span() * height;
  }
  double right() const { return left + width; }
  double bottom() const { return top + height; }
};

/// Round tick spacing (1, 2 or 5 times a power of ten) giving about
/// `count` ticks over `span`, but never closer than `minStep`.
double tickStep(double span, int count, double minStep);

/// The label of a tick at `value`, with as many decimals as `step` needs
/// ("0.25" for steps of 0.05), never "-0".
std::string tickLabel(double value, double step);

/// Calls `draw(value)` for each multiple of `step` in [min, max].
template <typename Fn>
void forEachTick(double min, double max, double step, Fn draw) {
  for (double i = std::ceil(min / step - 1e-9); i * step <= max + step * 1e-9;
       ++i)
    draw(i * step);
}

/// An SVG <line> of CSS class `cssClass`.
void drawLine(llvm::raw_ostream &os, double x1, double y1, double x2, double y2,
              llvm::StringRef cssClass);

/// An SVG <text> anchored at (x, y) (`anchor`: start, middle, end);
/// `text` must already be escaped.
void drawText(llvm::raw_ostream &os, double x, double y, llvm::StringRef anchor,
              llvm::StringRef text, llvm::StringRef cssClass = "");

/// A filled rectangle with a hover tooltip (`tooltip` already escaped);
/// at least half a pixel wide, so that a short interval stays visible.
void drawRect(llvm::raw_ostream &os, double x, double y, double width,
              double height, llvm::StringRef fill, llvm::StringRef tooltip);

/// Opens an <svg> of width kWidth and `height`, labelled `title` for
/// screen readers and tagged `data-plot="id"` when `id` is given (what
/// tests find a plot by).
void openSvg(llvm::raw_ostream &os, double height, llvm::StringRef title,
             llvm::StringRef id = "");

/// A whole (short) SVG that says why there is nothing to plot; `message`
/// must already be escaped.
void emptySvg(llvm::raw_ostream &os, llvm::StringRef title,
              llvm::StringRef message, llvm::StringRef id = "");

/// The x axis along the bottom of `f`: ticks, vertical grid lines and
/// `label` centred below. `minStep` keeps integer axes on integers.
void drawXAxis(llvm::raw_ostream &os, const Frame &f, llvm::StringRef label,
               double minStep = 0);

/// One y tick at `value`: a horizontal grid line and `label` left of it.
void drawYTick(llvm::raw_ostream &os, const Frame &f, double value,
               llvm::StringRef label);

/// The line of the y axis and `label` written upwards, `labelGap` px left
/// of it (room for the widest tick label).
void drawYAxisLine(llvm::raw_ostream &os, const Frame &f, llvm::StringRef label,
                   double labelGap);

/// A linear y axis along the left of `f`: ticks at round values, labelled
/// by `tickText(value, step)`, then drawYAxisLine.
void drawYAxis(
    llvm::raw_ostream &os, const Frame &f, llvm::StringRef label,
    double labelGap = 52,
    llvm::function_ref<std::string(double, double)> tickText = tickLabel);

/// Where the entries of a legend go: left to right from `left`, each a
/// swatch at its x and its name `nameOffset` px right of that. An entry
/// takes `pad` plus `charWidth` per character of its name (estimated for
/// the 12px font); one that would cross `right` starts the next row,
/// unless it is the first of its row.
struct LegendLayout {
  double left, nameOffset, pad, charWidth;
  double right = std::numeric_limits<double>::infinity();

  double entryWidth(llvm::StringRef name) const {
    return pad + charWidth * name.size();
  }
  /// (x, row) of each of `names`.
  std::vector<std::pair<double, int>>
  place(llvm::ArrayRef<std::string> names) const;
  /// The name of an entry placed at (x, y); `name` must already be escaped.
  void drawName(llvm::raw_ostream &os, double x, double y,
                llvm::StringRef name) const {
    drawText(os, x + nameOffset, y, "start", name);
  }
};

} // namespace megaslide::svg

#endif // MEGASLIDE_RUNTIME_SUPPORT_SVG_H
