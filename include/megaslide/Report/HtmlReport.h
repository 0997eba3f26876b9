//===- HtmlReport.h - A plan as one self-contained HTML page ----*- C++ -*-===//
//
// Reads only the plan JSON, never IR: LLVM Support is all it needs.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_REPORT_HTMLREPORT_H
#define MEGASLIDE_REPORT_HTMLREPORT_H

#include "llvm/Support/JSON.h"

#include <string>

namespace megaslide {

/// One self-contained HTML page (inline SVG plots, no network) of a plan
/// JSON as `megaslide-plan --format json` prints it.
std::string renderHtmlReport(const llvm::json::Value &plan);

} // namespace megaslide

#endif // MEGASLIDE_REPORT_HTMLREPORT_H
