//===- Html.h - The shell of the self-contained HTML pages ------*- C++ -*-===//
//
// What the plan report (lib/Report/HtmlReport.cpp) and the training report
// (runtime/train/TrainingReport.cpp) both write around their plots: one
// offline page, inline CSS, no script and no URL, so that it opens from a
// ticket or a mail. Their plots are drawn with support/Svg.h. No MLIR: the
// training report is built in the runtime-only build too, which has no
// lib/Report.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_SUPPORT_HTML_H
#define MEGASLIDE_RUNTIME_SUPPORT_HTML_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/raw_ostream.h"

#include <string>

namespace megaslide::html {

/// Escapes text for HTML element content and double-quoted attributes.
std::string escape(llvm::StringRef text);

/// Opens a page up to its <body>: `title` (HTML, already escaped) as its
/// <title>, and the CSS both reports share (text, tables, the axes and
/// grid of support/Svg.h) followed by `css`, the report's own rules.
void openPage(llvm::raw_ostream &os, llvm::StringRef title,
              llvm::StringRef css);

/// Closes what openPage opened.
void closePage(llvm::raw_ostream &os);

/// A table row of a name and a value; both are HTML (already escaped).
void renderRow(llvm::raw_ostream &os, llvm::StringRef name,
               llvm::StringRef value);

} // namespace megaslide::html

#endif // MEGASLIDE_RUNTIME_SUPPORT_HTML_H
