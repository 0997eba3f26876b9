//===- Svg.cpp - Inline SVG plots of the HTML pages -----------------------===//

#include "megaslide/runtime/support/Svg.h"

#include "llvm/Support/Format.h"

#include <algorithm>

using llvm::raw_ostream;
using llvm::StringRef;
using namespace megaslide;

double svg::tickStep(double span, int count, double minStep) {
  double raw = span / count;
  double power = std::pow(10.0, std::floor(std::log10(raw)));
  double step = 10 * power;
  for (double multiple : {1.0, 2.0, 5.0})
    if (multiple * power >= raw) {
      step = multiple * power;
      break;
    }
  return std::max(step, minStep);
}

std::string svg::tickLabel(double value, double step) {
  int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step))));
  if (std::abs(value) < step * 1e-6)
    value = 0; // no "-0.0"
  std::string label;
  llvm::raw_string_ostream(label) << llvm::format("%.*f", decimals, value);
  return label;
}

void svg::drawLine(raw_ostream &os, double x1, double y1, double x2, double y2,
                   StringRef cssClass) {
  os << llvm::format("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" ",
                     x1, y1, x2, y2)
     << "class=\"" << cssClass << "\"/>\n";
}

void svg::drawText(raw_ostream &os, double x, double y, StringRef anchor,
                   StringRef text, StringRef cssClass) {
  os << llvm::format("<text x=\"%.1f\" y=\"%.1f\" ", x, y) << "text-anchor=\""
     << anchor << "\"";
  if (!cssClass.empty())
    os << " class=\"" << cssClass << "\"";
  os << ">" << text << "</text>\n";
}

void svg::drawRect(raw_ostream &os, double x, double y, double width,
                   double height, StringRef fill, StringRef tooltip) {
  os << llvm::format("<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" "
                     "height=\"%.1f\" ",
                     x, y, std::max(width, 0.5), std::max(height, 0.0))
     << "fill=\"" << fill << "\"><title>" << tooltip << "</title></rect>\n";
}

void svg::openSvg(raw_ostream &os, double height, StringRef title,
                  StringRef id) {
  os << llvm::format("<svg viewBox=\"0 0 %.0f %.0f\" width=\"%.0f\" "
                     "height=\"%.0f\" ",
                     kWidth, height, kWidth, height)
     << "role=\"img\" aria-label=\"" << title << "\"";
  if (!id.empty())
    os << " data-plot=\"" << id << "\"";
  os << ">\n";
}

void svg::emptySvg(raw_ostream &os, StringRef title, StringRef message,
                   StringRef id) {
  openSvg(os, 60, title, id);
  drawText(os, kWidth / 2, 35, "middle", message);
  os << "</svg>\n";
}

void svg::drawXAxis(raw_ostream &os, const Frame &f, StringRef label,
                    double minStep) {
  double step = tickStep(f.x.span(), 8, minStep);
  forEachTick(f.x.min, f.x.max, step, [&](double value) {
    double x = f.px(value);
    drawLine(os, x, f.top, x, f.bottom(), "grid");
    drawLine(os, x, f.bottom(), x, f.bottom() + 5, "axis");
    drawText(os, x, f.bottom() + 18, "middle", tickLabel(value, step));
  });
  drawLine(os, f.left, f.bottom(), f.right(), f.bottom(), "axis");
  drawText(os, f.left + f.width / 2, f.bottom() + 36, "middle", label);
}

void svg::drawYTick(raw_ostream &os, const Frame &f, double value,
                    StringRef label) {
  double y = f.py(value);
  drawLine(os, f.left, y, f.right(), y, "grid");
  drawLine(os, f.left - 5, y, f.left, y, "axis");
  drawText(os, f.left - 8, y + 4, "end", label);
}

void svg::drawYAxisLine(raw_ostream &os, const Frame &f, StringRef label,
                        double labelGap) {
  drawLine(os, f.left, f.top, f.left, f.bottom(), "axis");
  os << llvm::format("<text transform=\"translate(%.1f,%.1f) rotate(-90)\" ",
                     f.left - labelGap, f.top + f.height / 2)
     << "text-anchor=\"middle\">" << label << "</text>\n";
}

void svg::drawYAxis(raw_ostream &os, const Frame &f, StringRef label,
                    double labelGap,
                    llvm::function_ref<std::string(double, double)> tickText) {
  double step = tickStep(f.y.span(), 5, 0);
  forEachTick(f.y.min, f.y.max, step, [&](double value) {
    drawYTick(os, f, value, tickText(value, step));
  });
  drawYAxisLine(os, f, label, labelGap);
}

std::vector<std::pair<double, int>>
svg::LegendLayout::place(llvm::ArrayRef<std::string> names) const {
  std::vector<std::pair<double, int>> positions;
  double x = left;
  int row = 0;
  for (const std::string &name : names) {
    if (x > left && x + entryWidth(name) > right) {
      x = left;
      ++row;
    }
    positions.emplace_back(x, row);
    x += entryWidth(name);
  }
  return positions;
}
