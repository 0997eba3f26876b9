//===- megaslide-run.cpp - Train with a compiled plan ---------------------===//
//
// Compiles the training step of a model (or loads a saved execution plan)
// and runs it on a backend: cpu (reference numerics), cuda (the GPU) or sim
// (predicted timing), with a progress bar, optional weights, data,
// checkpoints and a Chrome trace. Exit status: 0 done, 1 bad input or a
// failed step, 3 the plan does not fit its budgets, 4 measured device
// memory differs from the plan.
//
//===----------------------------------------------------------------------===//

#include "../common/PlanFlags.h"

#include "megaslide/Target/ExecPlan/ExportExecPlan.h"
#include "megaslide/Version.h"
#include "host/Checkpoint.h"
#include "host/Weights.h"
#include "trace/ChromeTrace.h"
#include "train/Session.h"

#include "mlir/IR/MLIRContext.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/Process.h"
#include "llvm/Support/WithColor.h"
#include "llvm/Support/raw_ostream.h"

#include <chrono>
#include <cmath>

using namespace llvm;
using namespace megaslide;

namespace {

cl::OptionCategory runCategory("Run options");

cl::opt<std::string> backendName("backend", cl::init("cpu"), cl::cat(runCategory),
                                 cl::desc("cpu | cuda | sim"));
cl::opt<int64_t> steps("steps", cl::init(10), cl::cat(runCategory),
                       cl::desc("Training steps to run"));
cl::opt<uint64_t> seed("seed", cl::init(0), cl::cat(runCategory),
                       cl::desc("Seed of initial weights and synthetic data"));
cl::opt<std::string> planFile("plan", cl::cat(runCategory),
                              cl::desc("Run this execution plan instead of "
                                       "compiling --model"),
                              cl::value_desc("FILE"));
cl::opt<std::string> savePlan("save-plan", cl::cat(runCategory),
                              cl::desc("Also write the execution plan"),
                              cl::value_desc("FILE"));
cl::opt<std::string> traceFile("trace", cl::cat(runCategory),
                               cl::desc("Write a Chrome trace (Perfetto) of "
                                        "the steps"),
                               cl::value_desc("FILE"));
cl::opt<std::string> metricsFile("metrics", cl::cat(runCategory),
                                 cl::desc("Write one JSON line per step "
                                          "(step, loss, seconds)"),
                                 cl::value_desc("FILE"));
cl::opt<std::string> weightsPath(
    "weights", cl::cat(runCategory),
    cl::desc("Load diffusers-format transformer weights (a directory with "
             "config.json and safetensors shards, or one .safetensors file)"),
    cl::value_desc("PATH"));
cl::opt<std::string> saveWeights(
    "save-weights", cl::cat(runCategory),
    cl::desc("Write the trained weights in diffusers format at the end"),
    cl::value_desc("DIR"));
cl::opt<std::string> dataDir(
    "data", cl::cat(runCategory),
    cl::desc("Train on the samples in this directory (one .safetensors per "
             "sample: latents [C, T, H, W], condition [L, D]; "
             "docs/Runtime.md) instead of the synthetic task"),
    cl::value_desc("DIR"));
cl::opt<std::string> checkpointDir(
    "checkpoint-dir", cl::cat(runCategory),
    cl::desc("Write checkpoints (masters, moments, step, data and RNG "
             "state) here, atomically"),
    cl::value_desc("DIR"));
cl::opt<int64_t> checkpointEvery(
    "checkpoint-every", cl::init(0), cl::cat(runCategory),
    cl::desc("Steps between checkpoints (0: only at the end)"));
cl::opt<bool> resume("resume", cl::cat(runCategory),
                     cl::desc("Continue from the latest checkpoint in "
                              "--checkpoint-dir; --steps more steps"));
cl::opt<bool> noProgress("no-progress", cl::cat(runCategory),
                         cl::desc("Print one line per step instead of a "
                                  "progress bar"));

int fail(const Twine &message, int code = 1) {
  WithColor::error(errs(), "megaslide-run") << message << "\n";
  return code;
}

/// The execution plan: loaded from --plan or compiled from the flags.
Expected<exec::ExecPlan> obtainPlan(const tools::PlanFlags &flags,
                                    int &exitCode) {
  if (!planFile.empty())
    return exec::loadExecPlan(planFile);
  mlir::MLIRContext context(mlir::MLIRContext::Threading::DISABLED);
  bool overBudget = false;
  Expected<exec::ExecPlan> plan =
      compileExecPlan(context, flags.model, flags.video, flags.training,
                      flags.options, &overBudget);
  if (overBudget)
    exitCode = 3;
  return plan;
}

std::string formatSeconds(double s) {
  if (!std::isfinite(s) || s < 0)
    return "--:--";
  int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600)
    return formatv("{0}:{1:2}:{2:2}", t / 3600, (t / 60) % 60, t % 60);
  return formatv("{0:2}:{1:2}", t / 60, t % 60);
}

/// One line of progress: a bar on a terminal, plain lines otherwise.
class Progress {
public:
  Progress(int64_t total, bool bar) : total(total), bar(bar) {}
  void update(int64_t step, float loss, double elapsed, double samplesPerSec,
              bool computesLoss) {
    double eta = step ? elapsed / step * (total - step) : 0;
    std::string lossText =
        computesLoss ? formatv("loss {0:F5}", loss).str() : "loss n/a (sim)";
    std::string stats =
        formatv("step {0}/{1}  {2}  {3:F2} samples/s  elapsed {4}  eta {5}",
                step, total, lossText, samplesPerSec, formatSeconds(elapsed),
                formatSeconds(eta));
    if (bar) {
      constexpr int width = 24;
      int filled = total ? static_cast<int>(width * step / total) : width;
      errs() << "\r[" << std::string(filled, '#')
             << std::string(width - filled, '.') << "] " << stats << "\x1b[K";
      if (step == total)
        errs() << "\n";
    } else {
      errs() << stats << "\n";
    }
  }

private:
  int64_t total;
  bool bar;
};

} // namespace

int main(int argc, char **argv) {
  addVersionPrinter("megaslide-run");
  cl::HideUnrelatedOptions({&tools::planCategory, &runCategory});
  cl::ParseCommandLineOptions(
      argc, argv,
      "megaslide-run: train a video DiT with a compiled execution plan\n\n"
      "Example:\n  megaslide-run --model tiny --backend cpu --steps 200\n\n"
      "Exit status: 0 done, 1 bad input or a failed step, 3 the plan does "
      "not fit its budgets, 4 measured device memory differs from the "
      "plan.\n");

  Expected<tools::PlanFlags> flags = tools::readPlanFlags();
  if (!flags)
    return fail(toString(flags.takeError()));
  if (flags->model.empty() && planFile.empty())
    return fail("--model is required (a preset name or a .json config), "
                "unless --plan FILE runs a saved execution plan");
  if (!flags->videoGiven) {
    if (flags->video.frames || flags->video.height || flags->video.width)
      return fail("give all of --frames, --height and --width, or none "
                  "(default 17 x 128 x 128)");
    flags->video = {17, 128, 128, false};
  }
  if (steps < 0)
    return fail("--steps must be non-negative");
  if (checkpointEvery < 0)
    return fail("--checkpoint-every must be non-negative");
  if ((resume || checkpointEvery.getNumOccurrences()) && checkpointDir.empty())
    return fail("--resume and --checkpoint-every need --checkpoint-dir");
  // Outputs written after the last step are checked now, not after hours
  // of training.
  for (auto [flag, dir] :
       {std::pair<StringRef, StringRef>{"--checkpoint-dir", checkpointDir},
        {"--save-weights", saveWeights}})
    if (!dir.empty() && sys::fs::exists(dir) && !sys::fs::is_directory(dir))
      return fail(formatv("{0} '{1}' exists and is not a directory; give a "
                          "directory (it is created if missing)",
                          flag, dir)
                      .str());

  int exitCode = 1;
  auto compileStart = std::chrono::steady_clock::now();
  Expected<exec::ExecPlan> plan = obtainPlan(*flags, exitCode);
  if (!plan)
    return fail(toString(plan.takeError()), exitCode);
  double compileSeconds = std::chrono::duration<double>(
                              std::chrono::steady_clock::now() - compileStart)
                              .count();

  train::SessionOptions sessionOptions;
  sessionOptions.backend = backendName;
  sessionOptions.seed = seed;
  sessionOptions.hardwarePath = flags->options.hardwarePath;
  sessionOptions.dataDir = dataDir;
  Expected<std::unique_ptr<train::Session>> session =
      train::Session::create(std::move(*plan), sessionOptions);
  if (!session)
    return fail(toString(session.takeError()));
  train::Session &s = **session;
  const exec::ExecPlan &p = s.plan();
  bool computesLoss = s.backend().computesLoss();
  if (!computesLoss && (!weightsPath.empty() || !saveWeights.empty() ||
                        !checkpointDir.empty()))
    return fail("the sim backend holds no model state: --weights, "
                "--save-weights and --checkpoint-dir need cpu or cuda");
  if (!weightsPath.empty())
    if (Error err = host::loadWeights(weightsPath, s.state()))
      return fail(toString(std::move(err)));
  if (resume) {
    std::string trainerState;
    if (Error err = host::loadLatestCheckpoint(checkpointDir, s.state(),
                                               trainerState))
      return fail(toString(std::move(err)));
    if (Error err = s.restoreTrainerState(trainerState))
      return fail(toString(std::move(err)));
    outs() << formatv("resumed at step {0} from {1}\n", s.state().step,
                      checkpointDir);
  }
  // --save-plan is written once every input has loaded: a run that fails
  // on its weights or checkpoint leaves the user's files as they were.
  if (!savePlan.empty())
    if (Error err = exec::saveExecPlan(p, savePlan))
      return fail(toString(std::move(err)));
  auto checkpoint = [&]() -> Error {
    Expected<std::string> dir =
        host::saveCheckpoint(checkpointDir, s.state(), s.trainerState());
    if (!dir)
      return dir.takeError();
    outs() << formatv("checkpoint: {0}\n", *dir);
    return Error::success();
  };

  outs() << formatv("megaslide-run: {0} on the {1} backend, {2} instructions, "
                    "grid {3}x{4}x{5}, batch {6}; plan ready in {7:F2} s\n",
                    p.model, s.backend().name(), p.instructions.size(),
                    p.grid.size() == 3 ? p.grid[0] : 0,
                    p.grid.size() == 3 ? p.grid[1] : 0,
                    p.grid.size() == 3 ? p.grid[2] : 0, p.batch,
                    compileSeconds);
  outs().flush(); // before the progress lines on stderr

  std::unique_ptr<raw_fd_ostream> metrics;
  if (!metricsFile.empty()) {
    std::error_code ec;
    metrics = std::make_unique<raw_fd_ostream>(metricsFile, ec);
    if (ec)
      return fail("cannot write '" + metricsFile + "': " + ec.message());
  }

  std::unique_ptr<trace::ChromeTrace> trace;
  if (!traceFile.empty()) {
    Expected<std::unique_ptr<trace::ChromeTrace>> created =
        trace::ChromeTrace::create(traceFile,
                                   formatv("megaslide-run {0} ({1})", p.model,
                                           s.backend().name())
                                       .str());
    if (!created)
      return fail(toString(created.takeError()));
    trace = std::move(*created);
  }

  Progress progress(steps, !noProgress && sys::Process::StandardErrIsDisplayed());
  std::vector<float> losses;
  exec::MemoryStats memory;
  double elapsed = 0;
  for (int64_t i = 0; i < steps; ++i) {
    Expected<exec::StepResult> result = s.trainStep(!traceFile.empty());
    if (!result)
      return fail(formatv("step {0}: {1}", s.state().step + 1,
                          toString(result.takeError()))
                      .str());
    if (trace)
      // Steps follow each other on the trace's time axis.
      for (exec::TraceSpan &span : result->spans) {
        span.start += elapsed;
        trace->complete(span);
      }
    elapsed += result->seconds;
    memory = result->memory;
    losses.push_back(result->loss);
    if (computesLoss && !std::isfinite(result->loss))
      return fail(formatv("step {0}: the loss is {1}; lower --lr", i + 1,
                          result->loss)
                      .str());
    if (metrics)
      *metrics << formatv("{{\"step\": {0}, \"loss\": {1}, \"seconds\": {2}}\n",
                          s.state().step, format("%.9g", result->loss),
                          format("%.6f", result->seconds));
    progress.update(i + 1, result->loss, elapsed,
                    (i + 1) * p.batch / std::max(elapsed, 1e-9), computesLoss);
    if (!checkpointDir.empty() &&
        ((checkpointEvery > 0 && (i + 1) % checkpointEvery == 0) ||
         i + 1 == steps))
      if (Error err = checkpoint())
        return fail(toString(std::move(err)));
  }
  if (!saveWeights.empty())
    if (Error err = host::saveWeights(p, s.state(), saveWeights))
      return fail(toString(std::move(err)));

  if (trace)
    if (Error err = trace->finish())
      return fail(toString(std::move(err)));

  if (steps > 0) {
    if (!computesLoss)
      outs() << formatv("predicted step: {0:F3} s on the sim hardware "
                        "model\n",
                        elapsed / steps);
    if (computesLoss)
      outs() << formatv("loss: first {0:F5}, last {1:F5} ({2:P0} of the "
                        "first)\n",
                        losses.front(), losses.back(),
                        losses.back() / losses.front());
    outs() << formatv("device memory: planned peak {0} B, measured {1} B; "
                      "planned live {2} B, measured {3} B\n",
                      memory.plannedArenaBytes, memory.measuredArenaBytes,
                      memory.plannedLiveBytes, memory.measuredLiveBytes);
    if (memory.plannedArenaBytes != memory.measuredArenaBytes ||
        memory.plannedLiveBytes != memory.measuredLiveBytes)
      return fail("measured device memory differs from the plan", 4);
  }
  return 0;
}
