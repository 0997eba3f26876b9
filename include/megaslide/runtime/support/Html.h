//===- Html.h - Pieces of the self-contained HTML pages ---------*- C++ -*-===//
//
// What the plan report (lib/Report/HtmlReport.cpp) and the training report
// (runtime/train/TrainingReport.cpp) both need to write an offline HTML
// page with inline SVG plots: escaping text, and round axis ticks with
// labels. One home for both, without MLIR: the training report is built
// in the runtime-only build too, which has no lib/Report.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_SUPPORT_HTML_H
#define MEGASLIDE_RUNTIME_SUPPORT_HTML_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/raw_ostream.h"

#include <cmath>
#include <string>

namespace megaslide::html {

/// Escapes text for HTML element content and double-quoted attributes.
std::string escape(llvm::StringRef text);

/// Round tick spacing (1, 2 or 5 times a power of ten) giving about
/// `count` ticks over `span`, but never closer than `minStep`.
double tickStep(double span, int count, double minStep);

/// The label of a tick at `value`, with as many decimals as `step` needs
/// ("0.25" for steps of 0.05), never "-0".
std::string tickLabel(double value, double step);

/// An SVG <line> of CSS class `cssClass`.
void drawLine(llvm::raw_ostream &os, double x1, double y1, double x2,
              double y2, llvm::StringRef cssClass);

/// An SVG <text> anchored at (x, y) (`anchor`: start, middle, end);
/// `text` must already be escaped.
void drawText(llvm::raw_ostream &os, double x, double y,
              llvm::StringRef anchor, llvm::StringRef text,
              llvm::StringRef cssClass = "");

/// Calls `draw(value)` for each multiple of `step` in [min, max].
template <typename Fn>
void forEachTick(double min, double max, double step, Fn draw) {
  for (double i = std::ceil(min / step - 1e-9); i * step <= max + step * 1e-9;
       ++i)
    draw(i * step);
}

} // namespace megaslide::html

#endif // MEGASLIDE_RUNTIME_SUPPORT_HTML_H
