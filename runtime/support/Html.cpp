//===- Html.cpp - Pieces of the self-contained HTML pages -----------------===//

#include "megaslide/runtime/support/Html.h"

#include "llvm/Support/Format.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>

using llvm::StringRef;

std::string megaslide::html::escape(StringRef text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
    case '&':
      out += "&amp;";
      break;
    case '<':
      out += "&lt;";
      break;
    case '>':
      out += "&gt;";
      break;
    case '"':
      out += "&quot;";
      break;
    default:
      out += c;
    }
  }
  return out;
}

double megaslide::html::tickStep(double span, int count, double minStep) {
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

std::string megaslide::html::tickLabel(double value, double step) {
  int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step))));
  if (std::abs(value) < step * 1e-6)
    value = 0; // no "-0.0"
  std::string label;
  llvm::raw_string_ostream(label) << llvm::format("%.*f", decimals, value);
  return label;
}

void megaslide::html::drawLine(llvm::raw_ostream &os, double x1, double y1,
                               double x2, double y2, llvm::StringRef cssClass) {
  os << llvm::format("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" ",
                     x1, y1, x2, y2)
     << "class=\"" << cssClass << "\"/>\n";
}

void megaslide::html::drawText(llvm::raw_ostream &os, double x, double y,
                               llvm::StringRef anchor, llvm::StringRef text,
                               llvm::StringRef cssClass) {
  os << llvm::format("<text x=\"%.1f\" y=\"%.1f\" ", x, y) << "text-anchor=\""
     << anchor << "\"";
  if (!cssClass.empty())
    os << " class=\"" << cssClass << "\"";
  os << ">" << text << "</text>\n";
}
