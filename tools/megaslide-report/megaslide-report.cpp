//===- megaslide-report.cpp - A run's metrics as one HTML page ------------===//
//
// The metrics log of `megaslide-run --metrics FILE` -> one offline HTML
// page with the run's curves (train/TrainingReport.h; docs/Training.md,
// "Training report"). No MLIR: built by the runtime-only build too, so
// the page can be made where the run ran. Exit status: 0 written, 1 bad
// input or failure (docs/ExitCodes.md).
//
//===----------------------------------------------------------------------===//

#include "megaslide/Version.h"
#include "megaslide/runtime/support/AtomicFile.h"
#include "megaslide/runtime/support/ReadFile.h"
#include "megaslide/runtime/train/TrainingReport.h"

#include "llvm/Support/CommandLine.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/WithColor.h"

using namespace llvm;
using namespace megaslide;

namespace {

cl::OptionCategory category("megaslide-report options");
cl::opt<std::string> metricsFile(cl::Positional, cl::Required,
                                 cl::cat(category),
                                 cl::desc("<metrics.jsonl>"));
cl::opt<std::string> output("o", cl::Required, cl::cat(category),
                            cl::desc("HTML page to write"),
                            cl::value_desc("FILE"));
cl::opt<std::string>
    title("title", cl::cat(category),
          cl::desc("Heading of the page (default: 'MegaSlide training run: "
                   "<metrics file name>')"),
          cl::value_desc("TEXT"));
cl::opt<train::LossScale> lossScale(
    "loss-scale", cl::cat(category), cl::desc("Y scale of the loss plot"),
    cl::init(train::LossScale::Auto),
    cl::values(clEnumValN(train::LossScale::Auto, "auto",
                          "logarithmic when the loss spans 20x or more "
                          "(default)"),
               clEnumValN(train::LossScale::Linear, "linear", "linear"),
               clEnumValN(train::LossScale::Log, "log", "logarithmic")));
cl::list<std::string>
    settings("setting", cl::cat(category),
             cl::desc("A setting of the run for the page's table (repeatable); "
                      "max_grad_norm=X also draws the clipping threshold"),
             cl::value_desc("NAME=VALUE"));

int fail(const Twine &message) {
  WithColor::error(errs(), "megaslide-report") << message << "\n";
  return 1;
}

} // namespace

int main(int argc, char **argv) {
  addVersionPrinter("megaslide-report");
  cl::HideUnrelatedOptions(category);
  cl::ParseCommandLineOptions(
      argc, argv,
      "megaslide-report: a training run's metrics as one HTML page\n\n"
      "Example:\n  megaslide-run --model tiny --backend cpu --steps 50 "
      "--metrics run.jsonl\n  megaslide-report run.jsonl -o run.html "
      "--setting max_grad_norm=1.0\n\n"
      "Exit status: 0 written, 1 bad input or failure.\n");

  train::TrainingReportInfo info;
  info.title =
      title.getNumOccurrences()
          ? title.getValue()
          : "MegaSlide training run: " + sys::path::filename(metricsFile).str();
  info.lossScale = lossScale;
  for (StringRef setting : settings) {
    auto [name, value] = setting.split('=');
    if (name.trim().empty() || !setting.contains('='))
      return fail("--setting '" + setting + "' is not NAME=VALUE");
    info.settings.emplace_back(name.trim().str(), value.str());
  }

  // The output first: no work for a destination that cannot be written.
  Expected<std::unique_ptr<AtomicFile>> out = AtomicFile::create(output);
  if (!out)
    return fail(toString(out.takeError()));

  Expected<std::string> text =
      readBoundedFile(metricsFile, train::kMaxMetricsBytes, "metrics file");
  if (!text)
    return fail(toString(text.takeError()));
  Expected<std::string> page = train::trainingReportHtml(*text, info);
  if (!page)
    return fail(metricsFile + ": " + toString(page.takeError()));

  (*out)->os() << *page;
  if (Error err = (*out)->commit())
    return fail(toString(std::move(err)));
  return 0;
}
