//===- Html.cpp - The shell of the self-contained HTML pages --------------===//

#include "megaslide/runtime/support/Html.h"

using llvm::StringRef;

namespace {

/// The rules both pages use. Red (#c62828) marks what is wrong or over
/// budget; the axis and grid classes are those support/Svg.h draws with.
/// No newline at the end: a page's own rules start with one.
constexpr StringRef kSharedCss = R"css(
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif;
       margin: 2em auto; max-width: 960px; color: #222; padding: 0 1em; }
h1 { margin-bottom: 0.2em; }
h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.meta { color: #555; margin: 0.2em 0; }
.bad { color: #c62828; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f4f4f4; }
svg { max-width: 100%; height: auto; display: block; }
svg text { font-size: 12px; fill: #333; }
svg .axis { stroke: #333; }
svg .grid { stroke: #e6e6e6; })css";

} // namespace

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

void megaslide::html::openPage(llvm::raw_ostream &os, StringRef title,
                               StringRef css) {
  os << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta "
        "charset=\"utf-8\">\n"
     << "<title>" << title << "</title>\n"
     << "<style>" << kSharedCss << css << "</style>\n</head>\n<body>\n";
}

void megaslide::html::closePage(llvm::raw_ostream &os) {
  os << "</body>\n</html>\n";
}

void megaslide::html::renderRow(llvm::raw_ostream &os, StringRef name,
                                StringRef value) {
  os << "<tr><th>" << name << "</th><td>" << value << "</td></tr>\n";
}
