//===- TextReport.h - A plan report as text ---------------------*- C++ -*-===//
//
// The rendering of a PlanReport (lib/Analysis computes it) that
// `megaslide-plan` prints by default.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_REPORT_TEXTREPORT_H
#define MEGASLIDE_REPORT_TEXTREPORT_H

#include "megaslide/Analysis/PlanReport.h"

#include "llvm/Support/raw_ostream.h"

namespace megaslide {

/// Prints the report for a reader: memory by category, transfers, the
/// predicted step, the training recipe and what does not fit.
void printText(const PlanReport &report, llvm::raw_ostream &os);

} // namespace megaslide

#endif // MEGASLIDE_REPORT_TEXTREPORT_H
