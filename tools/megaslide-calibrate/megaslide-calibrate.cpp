//===- megaslide-calibrate.cpp - Fit the hardware description to a trace --===//
//
// A measured trace (megaslide-run --trace, cuda backend) -> a complete
// hardware description whose per-family efficiencies, link bandwidths,
// transfer latency and host AdamW rate reproduce it (sim/Calibrate.h,
// docs/CostModel.md, "Calibration"), and a table of predicted against
// measured time per family. No MLIR: it runs where the GPU is, in the
// runtime-only build too. Exit status: 0 written, 1 bad input or failure.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Tools/HardwareFlag.h"

#include "megaslide/Version.h"
#include "megaslide/runtime/plan/ExecPlanJson.h"
#include "megaslide/runtime/sim/Calibrate.h"
#include "megaslide/runtime/sim/SimBackend.h"
#include "megaslide/runtime/support/AtomicFile.h"
#include "megaslide/runtime/support/ReadFile.h"

#include "llvm/Support/CommandLine.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/WithColor.h"

using namespace llvm;
using namespace megaslide;

namespace {

cl::OptionCategory category("megaslide-calibrate options");
cl::opt<std::string> traceFile(cl::Positional, cl::Required, cl::cat(category),
                               cl::desc("<trace.json>"));
cl::opt<std::string> planFile(
    "plan", cl::cat(category),
    cl::desc("The execution plan the trace ran (exact FLOPs by category, "
             "result types, fetch sources; and the step predicted on the "
             "calibrated description)"),
    cl::value_desc("FILE"));
cl::opt<std::string> output("o", cl::Required, cl::cat(category),
                            cl::desc("Hardware description to write (JSON)"),
                            cl::value_desc("FILE"));

/// Traces of a long run are big; the bound keeps a wrong file from being
/// read into memory whole.
constexpr uint64_t kMaxTraceBytes = 4ull << 30;

int fail(const Twine &message) {
  WithColor::error(errs(), "megaslide-calibrate") << message << "\n";
  return 1;
}

double ratio(double measured, double predicted) {
  return predicted > 0 ? measured / predicted : 0;
}

} // namespace

int main(int argc, char **argv) {
  addVersionPrinter("megaslide-calibrate");
  cl::HideUnrelatedOptions({&tools::hardwareCategory, &category});
  tools::hardwareFile.setDescription(
      "Base hardware description: the fields not fitted, and the "
      "prediction before calibration (default: built-in H200)");
  cl::ParseCommandLineOptions(
      argc, argv,
      "megaslide-calibrate: fit the hardware description to a measured "
      "trace\n\n"
      "Example:\n  megaslide-run --plan tiny.json --backend cuda --steps 3 "
      "--trace t.json\n  megaslide-calibrate t.json --plan tiny.json -o "
      "hw.json\n  megaslide-plan --model tiny --frames 5 --height 32 --width "
      "32 --hw hw.json\n\n"
      "Exit status: 0 written, 1 bad input or failure.\n");

  // The output first: no work for a destination that cannot be written.
  Expected<std::unique_ptr<AtomicFile>> out = AtomicFile::create(output);
  if (!out)
    return fail(toString(out.takeError()));

  sim::HardwareModel base;
  if (!tools::hardwareFile.empty()) {
    Expected<sim::HardwareModel> loaded =
        sim::loadHardwareModel(tools::hardwareFile);
    if (!loaded)
      return fail(toString(loaded.takeError()));
    base = std::move(*loaded);
  }
  std::optional<exec::ExecPlan> plan;
  if (!planFile.empty()) {
    Expected<exec::ExecPlan> loaded = exec::loadExecPlan(planFile);
    if (!loaded)
      return fail(toString(loaded.takeError()));
    plan = std::move(*loaded);
  }
  Expected<std::string> text =
      readBoundedFile(traceFile, kMaxTraceBytes, "trace");
  if (!text)
    return fail(toString(text.takeError()));
  Expected<sim::MeasuredTrace> trace =
      sim::parseMeasuredTrace(*text, traceFile);
  if (!trace)
    return fail(toString(trace.takeError()));
  if (trace->backend != "cuda")
    errs() << "megaslide-calibrate: note: the trace is of the '"
           << (trace->backend.empty() ? "unnamed" : trace->backend)
           << "' backend, not cuda: the fit describes that backend\n";

  Expected<sim::Calibration> c =
      sim::calibrate(*trace, plan ? &*plan : nullptr, base);
  if (!c)
    return fail(traceFile + ": " + toString(c.takeError()));
  c->hw.name = formatv("calibrated from {0} ({1} backend, {2} step{3})",
                       traceFile, trace->backend.empty() ? "?" : trace->backend,
                       trace->steps, trace->steps == 1 ? "" : "s")
                   .str();

  outs() << formatv("Calibration from {0}: {1} spans, {2} step(s), {3:F6} s\n",
                    traceFile, trace->spans.size(), trace->steps,
                    trace->seconds);
  outs() << formatv("{0,-14} {1,7} {2,12} {3,12} {4,7} {5,12} {6,7}  {7}\n",
                    "family", "events", "measured s", "base s", "ratio",
                    "fitted s", "ratio", "fitted");
  for (const sim::CalibrationRow &r : c->rows)
    outs() << formatv(
        "{0,-14} {1,7} {2,12:F6} {3,12:F6} {4,7:F3} {5,12:F6} {6,7:F3}  {7}\n",
        r.what, r.events, r.measured, r.before, ratio(r.measured, r.before),
        r.after, ratio(r.measured, r.after), r.fitted.empty() ? "-" : r.fitted);
  if (plan && trace->steps > 0) {
    Expected<sim::SimResult> before = sim::simulateStep(*plan, base);
    Expected<sim::SimResult> after = sim::simulateStep(*plan, c->hw);
    if (!before)
      return fail(toString(before.takeError()));
    if (!after)
      return fail(toString(after.takeError()));
    double step = trace->seconds / trace->steps;
    outs() << formatv("step: measured {0:F6} s; predicted {1:F6} s on the "
                      "base description (ratio {2:F3}), {3:F6} s calibrated "
                      "(ratio {4:F3})\n",
                      step, before->makespan, ratio(step, before->makespan),
                      after->makespan, ratio(step, after->makespan));
  }
  for (const std::string &note : c->notes)
    outs() << "note: " << note << "\n";

  (*out)->os() << formatv("{0:2}", sim::toJson(c->hw)) << "\n";
  if (Error err = (*out)->commit())
    return fail(toString(std::move(err)));
  return 0;
}
