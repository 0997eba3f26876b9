//===- RunDriver.cpp - Train with an execution plan -----------------------===//
//
// The one implementation of megaslide-run and megaslide-exec
// (RunDriver.h): runs a plan on a backend, cpu (reference numerics), cuda
// (the GPU) or sim (predicted timing), with a progress bar, optional
// weights, data, checkpoints, metrics and a Chrome trace. A long run loses
// nothing it need not (docs/Runtime.md, "Long runs"): every output is
// proven writable before the plan is compiled, the checkpoint folder is
// locked, a resumed run keeps the checkpoint's settings, non-finite losses
// skip their step, and SIGINT or SIGTERM end the run at a step boundary
// with a checkpoint. Exit codes: docs/ExitCodes.md.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Tools/RunDriver.h"

#include "megaslide/Tools/EcosystemFlags.h"
#include "megaslide/Tools/HardwareFlag.h"
#include "megaslide/Tools/RecipeFlags.h"

#include "megaslide/Version.h"
#include "megaslide/runtime/cuda/CudaBackend.h"
#include "megaslide/runtime/cuda/Nvrtc.h"
#include "megaslide/runtime/dist/Collectives.h"
#include "megaslide/runtime/host/Checkpoint.h"
#include "megaslide/runtime/host/Safetensors.h"
#include "megaslide/runtime/host/Weights.h"
#include "megaslide/runtime/plan/ExecPlanJson.h"
#include "megaslide/runtime/support/AtomicFile.h"
#include "megaslide/runtime/train/Session.h"
#include "megaslide/runtime/train/TrainingRun.h"

#include "llvm/ADT/ScopeExit.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/Process.h"
#include "llvm/Support/WithColor.h"
#include "llvm/Support/raw_ostream.h"

#include <chrono>
#include <cmath>
#include <csignal>
#include <fcntl.h>
#include <filesystem>
#include <unistd.h>

using namespace llvm;
using namespace megaslide;

namespace {

cl::OptionCategory runCategory("Run options");

cl::opt<std::string>
    backendName("backend", cl::init("auto"), cl::cat(runCategory),
                cl::desc("auto (cuda where a GPU is, else cpu) | cpu | cuda | "
                         "sim"));
cl::opt<int64_t> steps("steps", cl::init(10), cl::cat(runCategory),
                       cl::desc("Training steps to run (more steps, with "
                                "--resume)"));
cl::opt<int64_t>
    maxSteps("max-steps", cl::init(0), cl::cat(runCategory),
             cl::desc("Train until the run has taken N optimizer steps, "
                      "counted across resumes (diffusers' "
                      "--max_train_steps); instead of --steps"),
             cl::value_desc("N"));
cl::opt<uint64_t> seed("seed", cl::init(0), cl::cat(runCategory),
                       cl::desc("Seed of initial weights and synthetic data"));
cl::opt<std::string> planFile("plan", cl::cat(runCategory),
                              cl::desc("Run this saved execution plan (written "
                                       "by megaslide-run --save-plan)"),
                              cl::value_desc("FILE"));
cl::opt<std::string> savePlan("save-plan", cl::cat(runCategory),
                              cl::desc("Also write the execution plan"),
                              cl::value_desc("FILE"));
cl::opt<std::string> traceFile("trace", cl::cat(runCategory),
                               cl::desc("Write a Chrome trace (Perfetto) of "
                                        "the steps"),
                               cl::value_desc("FILE"));
cl::opt<std::string> metricsFile(
    "metrics", cl::cat(runCategory),
    cl::desc("Write one JSON line per optimizer step (loss, lr, grad_norm, "
             "clipped, skipped, seconds, throughput, memory, val_loss; "
             "docs/Training.md)"),
    cl::value_desc("FILE"));
cl::opt<std::string> weightsPath(
    "weights", cl::cat(runCategory),
    cl::desc("Load diffusers-format transformer weights (a directory with "
             "config.json and safetensors shards, or one .safetensors file; "
             "with --boundary a pipeline folder's transformer and "
             "transformer_2)"),
    cl::value_desc("PATH"));
cl::opt<std::string>
    initWeights("init", cl::cat(runCategory),
                cl::desc("random: start from random weights (drawn from "
                         "--seed), which training on --data without "
                         "--weights asks for explicitly"),
                cl::value_desc("random"));
cl::opt<std::string> saveWeights(
    "save-weights", cl::cat(runCategory),
    cl::desc("Write the trained weights in diffusers format at the end "
             "(with --boundary: DIR/transformer and DIR/transformer_2)"),
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
cl::opt<int64_t>
    checkpointEvery("checkpoint-every", cl::init(0), cl::cat(runCategory),
                    cl::desc("Steps between checkpoints (0: only at the end)"));
cl::opt<bool> resume("resume", cl::cat(runCategory),
                     cl::desc("Continue from the latest checkpoint in "
                              "--checkpoint-dir; --steps more steps"));
cl::opt<bool> overwriteCheckpoints(
    "overwrite-checkpoints", cl::cat(runCategory),
    cl::desc("Start a fresh run in a --checkpoint-dir that holds "
             "checkpoints; they are deleted once this run's first "
             "checkpoint is complete"));
cl::opt<int64_t> maxNonFiniteSteps(
    "max-nonfinite-steps", cl::init(3), cl::cat(runCategory),
    cl::desc("Consecutive steps with a non-finite loss that are skipped "
             "(no update) before the run stops"));
cl::opt<std::string> saveGradients(
    "save-gradients", cl::cat(runCategory),
    cl::desc("Write the fp32 gradients of the last step run (safetensors, "
             "one tensor per parameter; with --steps 1 those of the "
             "starting weights)"),
    cl::value_desc("FILE"));
cl::opt<std::string> precompileKernels(
    "precompile-kernels", cl::cat(runCategory),
    cl::desc("Compile the plan's CUDA kernels for ARCH (e.g. sm_90a) into "
             "the kernel cache ($MEGASLIDE_KERNEL_CACHE) and exit: needs "
             "NVRTC, not a GPU, so a GPU job starts with a warm cache"),
    cl::value_desc("ARCH"));
cl::opt<std::string> valData(
    "val-data", cl::cat(runCategory),
    cl::desc("Validation samples (the --data format): each has its noise "
             "and timestep drawn once, the loss over all of them goes into "
             "the metrics every --val-every steps and at the end"),
    cl::value_desc("DIR"));
cl::list<std::string> nvmeDirs(
    "nvme", cl::CommaSeparated, cl::cat(runCategory),
    cl::desc("Directories, one per NVMe drive, for the host state the plan "
             "keeps out of RAM (its host_tier: AdamW moments when --host-mem "
             "cannot hold them); megaslide-run plans with that many drives "
             "(docs/Runtime.md, \"NVMe tier\")"),
    cl::value_desc("DIR[,DIR...]"));
cl::opt<bool> nvmeForce(
    "nvme-force", cl::cat(runCategory),
    cl::desc("Use --nvme directories on tmpfs or a file system without "
             "O_DIRECT (refused otherwise: the tier would take RAM or the "
             "page cache); for tests"));
cl::opt<int64_t> valEvery("val-every", cl::init(0), cl::cat(runCategory),
                          cl::desc("Optimizer steps between validations (0: "
                                   "only at the end)"));
cl::opt<std::string> reportFile(
    "report", cl::cat(runCategory),
    cl::desc("Write the training report (loss, validation, lr, gradient "
             "norm, step time as one offline HTML page) at every checkpoint "
             "and at the end; megaslide-report draws it from a --metrics "
             "file"),
    cl::value_desc("FILE"));
cl::opt<double> collectiveTimeout(
    "collective-timeout", cl::init(1800), cl::cat(runCategory),
    cl::desc("In a job of several ranks: seconds a rank waits in a "
             "collective for the others before it ends the job (a rank "
             "hung); docs/Distributed.md"),
    cl::value_desc("SECONDS"));
cl::opt<bool> saveEma(
    "save-ema", cl::cat(runCategory),
    cl::desc("--save-weights writes the EMA of the weights (--ema-decay) "
             "instead of the trained weights themselves"));
cl::opt<bool> printEcosystemTable(
    "print-ecosystem-flags", cl::Hidden, cl::cat(runCategory),
    cl::desc("Print the table of other trainers' flags (docs/Training.md) "
             "and exit"));
cl::opt<bool> noProgress("no-progress", cl::cat(runCategory),
                         cl::desc("Print one line per step instead of a "
                                  "progress bar"));

const char *toolName = "megaslide";
/// "rank 3 on node7: " in a job of several ranks: whose message it is.
std::string rankPrefix;
/// How the job was launched ("mpirun -np 8 "), for the command that
/// continues a stopped run.
std::string launchPrefix;

/// The job this process is a rank of, once open.
dist::Collectives *job = nullptr;
/// Whether this process speaks for the run: rank 0 of a job (the others'
/// warnings and notes would repeat its own).
bool speaks = true;

int fail(const Twine &message, int code = 1) {
  WithColor::error(errs(), toolName) << rankPrefix << message << "\n";
  // One rank's failure ends the job: the others would wait for it in their
  // next collective, and its MPI_Finalize for them.
  if (job && job->size() > 1) {
    errs().flush();
    job->abort(code);
  }
  return code;
}

/// "mm:ss", or "h:mm:ss" from an hour on: elapsed time and ETA of a run.
std::string formatClock(double s) {
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
  /// Steps first + 1 .. total of the run (global: a resumed run continues
  /// the count).
  Progress(int64_t first, int64_t total, bool bar)
      : first(first), total(total), bar(bar) {}
  void update(int64_t step, float loss, std::optional<float> unweighted,
              double elapsed, double samplesPerSec, bool computesLoss) {
    int64_t ran = step - first;
    double eta = ran ? elapsed / ran * (total - step) : 0;
    std::string lossText =
        computesLoss ? formatv("loss {0:F5}", loss).str() : "loss n/a (sim)";
    if (computesLoss && unweighted)
      lossText += formatv(" (unweighted {0:F5})", *unweighted).str();
    std::string stats = formatv(
        "step {0}/{1}  {2}  {3:F2} samples/s  elapsed {4}  eta {5}", step,
        total, lossText, samplesPerSec, formatClock(elapsed), formatClock(eta));
    if (bar) {
      constexpr int width = 24;
      int filled = total > first
                       ? static_cast<int>(width * (step - first) / (total - first))
                       : width;
      errs() << "\r[" << std::string(filled, '#')
             << std::string(width - filled, '.') << "] " << stats << "\x1b[K";
      if (step == total)
        errs() << "\n";
    } else {
      errs() << stats << "\n";
    }
  }

private:
  int64_t first, total;
  bool bar;
};

//===----------------------------------------------------------------------===//
// Signals: the first SIGINT/SIGTERM ends the run at the next step boundary,
// a second one ends the process at once.
//===----------------------------------------------------------------------===//

volatile std::sig_atomic_t stopSignal = 0;

extern "C" void onStopSignal(int sig) {
  if (stopSignal) {
    std::signal(sig, SIG_DFL);
    std::raise(sig); // delivered when this handler returns
    return;
  }
  stopSignal = sig;
}

void installStopHandlers() {
  struct sigaction action = {};
  action.sa_handler = onStopSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART; // blocking I/O of a step carries on
  for (int sig : {SIGINT, SIGTERM})
    sigaction(sig, &action, nullptr);
}

/// Quoted for a POSIX shell where needed.
std::string shellQuote(StringRef arg) {
  if (!arg.empty() && llvm::all_of(arg, [](char c) {
        return isAlnum(c) || StringRef("-_./=:,+@%").contains(c);
      }))
    return arg.str();
  std::string quoted = "'";
  for (char c : arg)
    quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

/// The command line that continues this run for `remaining` steps: the
/// same arguments with --steps replaced, --resume added and
/// --overwrite-checkpoints dropped. A fresh run stopped before its first
/// step saved nothing to resume (and --resume would continue the checkpoints
/// --overwrite-checkpoints was to replace): the command as given.
std::string resumeCommand(int argc, char **argv, int64_t remaining,
                          bool saved) {
  if (!saved) {
    std::string cmd = launchPrefix + shellQuote(argv[0]);
    for (int i = 1; i < argc; ++i)
      cmd += " " + shellQuote(argv[i]);
    return cmd;
  }
  if (maxSteps.getNumOccurrences()) {
    // A total: the same command, resumed, takes the rest.
    std::string cmd = launchPrefix + shellQuote(argv[0]);
    for (int i = 1; i < argc; ++i) {
      StringRef arg = argv[i];
      if (arg.ltrim('-') != "resume" && arg.ltrim('-') != "overwrite-checkpoints")
        cmd += " " + shellQuote(arg);
    }
    return cmd + " --resume";
  }
  std::string cmd = launchPrefix + shellQuote(argv[0]);
  auto named = [](StringRef arg, StringRef name) {
    arg = arg.ltrim('-');
    return arg == name || arg.starts_with((name + "=").str());
  };
  for (int i = 1; i < argc; ++i) {
    StringRef arg = argv[i];
    if (named(arg, "resume") || named(arg, "overwrite-checkpoints"))
      continue;
    if (named(arg, "steps")) {
      if (!arg.contains('=') && i + 1 < argc)
        ++i;
      continue;
    }
    cmd += " " + shellQuote(arg);
  }
  return cmd + " --steps " + std::to_string(remaining) + " --resume";
}

//===----------------------------------------------------------------------===//
// Outputs
//===----------------------------------------------------------------------===//

/// Folders this run created for its outputs: at exit, those still empty
/// are removed, so a failed run leaves no trace of them.
struct CreatedFolders {
  std::vector<std::string> dirs;
  ~CreatedFolders() { removeCreatedDirectories(dirs); }
};

/// Refuses two outputs on one file or folder (`--metrics x --report x`
/// would have the page overwrite the log), an output on an input
/// (`--save-weights W --weights W` would replace the base model), and an
/// input inside an output that is replaced whole (`--save-weights P
/// --weights P/transformer`): paths are compared after resolving symlinks,
/// `..` and the working directory, and existing ones by inode too (hard
/// links).
Error checkDistinctOutputs() {
  struct Path {
    StringRef flag;
    std::string path;
    std::filesystem::path resolved;
  };
  auto &options = cl::getRegisteredOptions();
  auto collect = [&](ArrayRef<StringRef> flags) {
    std::vector<Path> paths;
    for (StringRef flag : flags) {
      auto it = options.find(flag);
      if (it == options.end())
        continue;
      const std::string &path =
          static_cast<cl::opt<std::string> *>(it->second)->getValue();
      if (path.empty() || path == "-")
        continue;
      std::error_code ec;
      std::filesystem::path resolved = std::filesystem::weakly_canonical(
          std::filesystem::absolute(std::filesystem::path(path), ec), ec);
      if (ec)
        resolved = path;
      resolved = resolved.lexically_normal();
      if (!resolved.has_filename()) // "dir/"
        resolved = resolved.parent_path();
      paths.push_back({flag, path, resolved});
    }
    return paths;
  };
  auto same = [](const Path &a, const Path &b) {
    std::error_code ec;
    return a.resolved == b.resolved ||
           (std::filesystem::equivalent(a.path, b.path, ec) && !ec);
  };
  std::vector<Path> outputs =
      collect({"checkpoint-dir", "save-weights", "save-plan", "trace",
               "metrics", "report", "save-gradients", "plan-cache"});
  for (size_t i = 0; i < outputs.size(); ++i)
    for (size_t j = i + 1; j < outputs.size(); ++j)
      if (same(outputs[i], outputs[j]))
        return createStringError(
            "--" + outputs[i].flag + " '" + outputs[i].path + "' and --" +
            outputs[j].flag + " '" + outputs[j].path +
            "' are the same file; one would overwrite the other: give each "
            "output its own path");
  for (const Path &in : collect({"weights", "data", "val-data", "plan"}))
    for (const Path &out : outputs) {
      // Written in place of what was there: the input would be lost.
      bool replacedWhole =
          out.flag == "save-weights" || out.flag == "save-gradients";
      auto rel = in.resolved.lexically_relative(out.resolved);
      bool inside = replacedWhole && !rel.empty() && *rel.begin() != "..";
      if (same(in, out) || inside)
        return createStringError(
            "--" + out.flag + " '" + out.path + "' would overwrite the --" +
            in.flag + " input '" + in.path + "'" +
            (inside && !same(in, out) ? " (it is inside)" : "") +
            ": write the output somewhere else");
    }
  return Error::success();
}

/// --precompile-kernels: what the cuda backend compiles when it opens the
/// plan, through the same cache.
int precompile(const exec::ExecPlan &plan, StringRef arch) {
  std::string why;
  if (!cuda::nvrtcAvailable(&why))
    return fail("--precompile-kernels: " + why);
  Expected<cuda::PreparedPlan> prep = cuda::prepareCudaPlan(plan);
  if (!prep)
    return fail(toString(prep.takeError()));
  std::vector<std::pair<std::string, std::string>> units;
  if (!prep->kernels.empty())
    units.push_back({"megaslide_dense.cu", prep->elementwiseSource});
  for (const exec::KernelModule &m : plan.kernelModules)
    units.push_back({m.name + ".cu", m.source});
  std::string cache = cuda::kernelCacheDir();
  if (cache.empty())
    return fail("--precompile-kernels: no kernel cache (MEGASLIDE_KERNEL_CACHE "
                "is 'off' or no home directory)");
  for (auto &[name, source] : units) {
    auto start = std::chrono::steady_clock::now();
    cuda::CompileResult r = cuda::compileCuda(source, name, arch.str());
    if (!r.ok() || r.cubin.empty())
      return fail("NVRTC cannot compile " + name + " for " + arch + ":\n" +
                  r.error);
    outs() << formatv(
        "{0}: {1} B cubin in {2:F2} s{3}\n", name, r.cubin.size(),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count(),
        r.fromCache ? " (cached)" : "");
  }
  outs() << formatv("{0} modules for {1} in {2} (NVRTC {3})\n", units.size(),
                    arch, cache, cuda::nvrtcVersionString());
  return 0;
}

/// --save-gradients: one fp32 tensor per parameter, in the plan's order and
/// with its shape.
Error writeGradients(const exec::ExecPlan &plan,
                     const StringMap<std::vector<float>> &gradients,
                     StringRef path) {
  std::vector<host::StTensorToWrite> tensors;
  for (const exec::Param &param : plan.params) {
    auto it = gradients.find(param.name);
    if (param.role != "master" || it == gradients.end())
      continue;
    if (static_cast<int64_t>(it->second.size()) != param.type.numElements())
      return createStringError(formatv("the gradient of '{0}' has {1} "
                                       "values, the parameter {2}",
                                       param.name, it->second.size(),
                                       param.type.numElements())
                                   .str());
    tensors.push_back(
        {param.name, param.type.shape, it->second.data(), host::StDType::F32});
  }
  int64_t trained = llvm::count_if(
      plan.params, [](const exec::Param &q) { return q.role == "master"; });
  if (static_cast<int64_t>(tensors.size()) != trained ||
      tensors.size() != gradients.size())
    return createStringError(formatv("--save-gradients: {0} gradients "
                                     "reached the host, but the plan has {1} "
                                     "trained parameters",
                                     gradients.size(), trained)
                                 .str());
  return host::writeSafetensors(path, tensors);
}

/// A resumed run takes the checkpoint's seed and data unless the command
/// line gives them (the tool's compile() adopts the plan's settings); what
/// it gives is compared with the checkpoint once the plan is built
/// (train::checkResumeSettings).
Error adoptRunSettings(const train::Settings &stored) {
  if (std::optional<std::string> v = train::findSetting(stored, "seed");
      v && !tools::flagGiven("seed") &&
      StringRef(*v).getAsInteger(10, seed.getValue()))
    return createStringError("the checkpoint's seed '" + *v +
                             "' is not a number");
  if (std::optional<std::string> v = train::findSetting(stored, "data");
      v && !tools::flagGiven("data"))
    dataDir = *v == "(synthetic)" ? std::string() : *v;
  return Error::success();
}

/// How the run attends, from host::runConfigOf's record: 3D-DSA changes
/// the model, so sampling it faithfully needs enable_dsa (docs/Data.md).
std::string attentionText(const json::Object &record) {
  auto list = [](const json::Array *a) {
    std::string text;
    if (a)
      for (const json::Value &v : *a)
        text += (text.empty() ? "" : ",") +
                std::to_string(v.getAsInteger().value_or(0));
    return text;
  };
  const json::Object *dsa = record.getObject("dsa3d");
  const json::Array *global = record.getArray("global_layers");
  if (!dsa)
    return "global self-attention in every block";
  std::string text =
      formatv("3D-DSA (window {0}, tile {1}, radius {2}) in blocks {3}",
              list(dsa->getArray("window")), list(dsa->getArray("tile")),
              dsa->getInteger("radius").value_or(0),
              list(dsa->getArray("layers")))
          .str();
  if (global && !global->empty())
    text += ", global in blocks " + list(global);
  return text + "; sample with megaslide.diffusers.enable_dsa";
}

/// The planning option `name` where the tool has it (megaslide-exec, which
/// compiles nothing, has none): an integer, or an enum read as text.
template <typename T> std::optional<T> planningOption(StringRef name) {
  auto &options = cl::getRegisteredOptions();
  auto it = options.find(name);
  if (it == options.end())
    return std::nullopt;
  return static_cast<cl::opt<T> *>(it->second)->getValue();
}

/// What the run trains, once, before its first step: the plan, the backend,
/// the weights and data it starts from and every recipe value (nothing
/// silent).
void printBanner(train::Session &s, StringRef tool, StringRef backendWhy,
                 double compileSeconds) {
  const exec::ExecPlan &p = s.plan();
  if (s.bucketed()) {
    std::string counts;
    std::vector<size_t> samples = s.bucketSamples();
    for (size_t b = 0; b < s.numBuckets(); ++b)
      counts += formatv("{0}{1} {2}", b ? ", " : "", s.bucketName(b),
                        b < samples.size() ? samples[b] : 0)
                    .str();
    outs() << formatv("{0}: {1} on the {2} backend, {3} buckets, batch {4}; "
                      "plans ready in {5:F2} s; samples per bucket: {6}\n",
                      tool, p.model, s.backend().name(), s.numBuckets(),
                      p.batch, compileSeconds, counts);
  } else {
    outs() << formatv(
        "{8}: {0} on the {1} backend, {2} instructions, "
        "grid {3}x{4}x{5}, batch {6}; plan ready in {7:F2} s\n",
        p.model, s.backend().name(), p.instructions.size(),
        p.grid.size() == 3 ? p.grid[0] : 0, p.grid.size() == 3 ? p.grid[1] : 0,
        p.grid.size() == 3 ? p.grid[2] : 0, p.batch, compileSeconds, tool);
  }
  if (!backendWhy.empty())
    outs() << "backend: " << s.backend().name() << backendWhy << "\n";
  if (s.backend().computesLoss()) {
    outs() << (s.deferredUpdates()
                   ? "update: deferred (clipping and non-finite skips exact)\n"
                   : "update: streaming (clipping by the previous step's "
                     "norm; a non-finite gradient stops the run)\n");
    // Where the weights and the samples come from, and every recipe value
    // the run trains with, once: nothing silent.
    outs() << "initial weights: "
           << (resume ? "checkpoint step " + std::to_string(s.step())
               : !weightsPath.empty()
                   ? weightsPath.getValue()
                   : "random (seed " + std::to_string(seed) + ")")
           << "\n";
    std::string data = "synthetic task (seed " + std::to_string(seed) + ")";
    if (!dataDir.empty()) {
      size_t samples = 0;
      for (size_t n : s.bucketSamples())
        samples += n;
      data = formatv("{0} ({1} samples, {2} bucket{3})", dataDir.getValue(),
                     samples, s.numBuckets(), s.numBuckets() == 1 ? "" : "s")
                 .str();
    }
    outs() << "data: " << data << "\n";
    std::string recipeText;
    for (const auto &[name, value] : s.settings())
      if (!llvm::is_contained(
              {"seed", "data", "data_samples", "model", "plan_hash", "update"},
              name)) {
        // Numbers as a person writes them (the settings keep every digit).
        double number;
        std::string shown = value;
        if (!StringRef(value).getAsDouble(number))
          shown = formatv("{0}", format("%g", number)).str();
        recipeText += (recipeText.empty() ? "" : ", ") + name + " " + shown;
      }
    outs() << "recipe: " << recipeText << "\n";
    std::vector<const exec::ExecPlan *> plansOfRun;
    for (size_t b = 0; b < s.numBuckets(); ++b)
      plansOfRun.push_back(&s.plan(b));
    Expected<json::Object> attends = host::runConfigOf(plansOfRun);
    if (attends)
      outs() << "attention: " << attentionText(*attends) << "\n";
    else
      consumeError(attends.takeError());
  }
  outs().flush(); // before the progress lines on stderr
}

/// The run flags' own checks, before anything is read or written;
/// --max-steps becomes the steps of a fresh run here.
Error checkRunFlags(const tools::RunTool &tool) {
  if (tool.checkFlags)
    if (Error e = tool.checkFlags(!planFile.empty()))
      return e;
  if (planFile.empty() && !tool.compile)
    return createStringError(
        Twine(tool.name) +
        " runs a saved execution plan: give --plan FILE (written by "
        "megaslide-run --save-plan on a machine with the compiler)");
  if (!precompileKernels.empty())
    for (StringRef flag :
         {"steps", "resume", "checkpoint-dir", "checkpoint-every", "weights",
          "save-weights", "data", "save-plan", "trace", "metrics", "report",
          "save-gradients", "backend"})
      if (tools::flagGiven(flag))
        return createStringError(
            "--precompile-kernels compiles the plan's kernels and "
            "exits; it runs no step, so --" +
            flag + " does not apply");
  if (steps < 0)
    return createStringError("--steps must be non-negative");
  if (maxSteps.getNumOccurrences() && steps.getNumOccurrences())
    return createStringError(
        "give --steps (steps to run) or --max-steps (the run's "
        "total, across resumes), not both");
  if (maxSteps.getNumOccurrences() && maxSteps < 1)
    return createStringError("--max-steps must be at least 1");
  if (maxSteps.getNumOccurrences())
    steps = maxSteps; // a fresh run; a resume takes what is left (below)
  if (checkpointEvery < 0)
    return createStringError("--checkpoint-every must be non-negative");
  if (maxNonFiniteSteps < 1)
    return createStringError("--max-nonfinite-steps must be at least 1");
  if (valEvery < 0)
    return createStringError("--val-every must be non-negative");
  if (valEvery.getNumOccurrences() && valData.empty())
    return createStringError("--val-every needs --val-data");
  if ((resume || checkpointEvery.getNumOccurrences() || overwriteCheckpoints) &&
      checkpointDir.empty())
    return createStringError(
        "--resume, --checkpoint-every and --overwrite-checkpoints "
        "need --checkpoint-dir");
  if (!initWeights.empty() && initWeights != "random")
    return createStringError(
        "--init takes 'random' (random weights from --seed), not '" +
        initWeights + "'; --weights DIR loads weights");
  if (!initWeights.empty() && !weightsPath.empty())
    return createStringError(
        "give --weights (start from those weights) or --init random "
        "(start from random ones), not both");
  // Training on real samples from random weights is a choice to make, not
  // a default to fall into (the base model's --weights were forgotten).
  if (!dataDir.empty() && weightsPath.empty() && initWeights.empty() &&
      !resume && steps > 0)
    return createStringError(
        "--data trains on real samples, but no --weights were given: "
        "the model would start from random weights. Give the base "
        "model's transformer (--weights BASE/transformer), or --init "
        "random to train from scratch");
  if (backendName == "sim" &&
      (!weightsPath.empty() || !saveWeights.empty() || !checkpointDir.empty() ||
       !saveGradients.empty()))
    return createStringError(
        "the sim backend holds no model state: --weights, "
        "--save-weights, --save-gradients and --checkpoint-dir "
        "need cpu or cuda");

  return Error::success();
}

/// Resolves --backend auto: the GPU where there is one; the reason, for
/// the banner.
std::string resolveBackend() {
  if (backendName != "auto")
    return "";
  std::string why;
  bool gpu = cuda::cudaDeviceAvailable(&why);
  backendName = gpu ? "cuda" : "cpu";
  return gpu ? " (--backend auto: a GPU is here)"
             : " (--backend auto: no GPU: " +
                   StringRef(why).split("; tried").first.str() + ")";
}

/// The session of the run: the flags' recipe with what the plan was
/// compiled for, and the learning-rate horizon a fresh run derives from
/// its steps (a resumed one keeps its checkpoint's, `stored`).
} // namespace

std::vector<std::string> tools::nvmeDirectories() {
  return {nvmeDirs.begin(), nvmeDirs.end()};
}

namespace {

Expected<train::SessionOptions>
sessionOptionsOf(train::Recipe recipe, const exec::ExecPlan &compiled,
                 const train::Settings *stored) {
  train::SessionOptions sessionOptions;
  sessionOptions.backend = backendName;
  sessionOptions.seed = seed;
  sessionOptions.hardwarePath = tools::hardwareFile;
  sessionOptions.dataDir = dataDir;
  sessionOptions.valDataDir = valData;
  sessionOptions.recipe = recipe;
  sessionOptions.nvmeDirs.assign(nvmeDirs.begin(), nvmeDirs.end());
  sessionOptions.nvmeForce = nvmeForce;
  train::Recipe &r = sessionOptions.recipe;
  // What the plan was compiled for, from its header: a saved plan runs
  // in megaslide-exec exactly as in the megaslide-run that compiled it.
  r.gradAccum = compiled.gradAccum;
  r.emaBf16 = compiled.emaDtype == "bf16";
  if (r.hasEma() && compiled.emaDtype == "none")
    return createStringError(
        "--ema-decay keeps an EMA, but the plan was compiled "
        "without one (its host memory is not counted): compile it "
        "with --ema-decay (megaslide-run --save-plan)");
  // Decay runs over a fresh run's steps; a resumed run keeps the horizon
  // it started with (steps past it run at the floor, with a warning).
  // (warmup-constant has none: a default would only refuse a resume with
  // fewer steps left than its warmup.)
  if (r.decaySteps == 0 && (r.lrSchedule == train::LrSchedule::WarmupCosine ||
                            r.lrSchedule == train::LrSchedule::WarmupLinear)) {
    std::optional<std::string> horizon =
        stored ? train::findSetting(*stored, "lr_decay_steps") : std::nullopt;
    if (!horizon || StringRef(*horizon).getAsInteger(10, r.decaySteps))
      r.decaySteps = steps;
  }
  return sessionOptions;
}

/// The end of a run: skipped steps, the loss or predicted step time, and
/// device memory measured against the plan (exit 4 where they differ).
int summarize(const train::RunTotals &totals, int64_t done, bool computesLoss,
              const char *tool) {
  if (totals.skipped && speaks)
    WithColor::warning(errs(), tool)
        << formatv("{0} of {1} steps were skipped for a non-finite loss\n",
                   totals.skipped, done);
  if (done > 0) {
    if (!computesLoss)
      outs() << formatv("predicted step: {0:F3} s on the sim hardware "
                        "model\n",
                        totals.seconds / done);
    if (computesLoss && totals.firstLoss)
      outs() << formatv("loss: first {0:F5}, last {1:F5} ({2:P0} of the "
                        "first)\n",
                        *totals.firstLoss, *totals.lastLoss,
                        *totals.lastLoss / *totals.firstLoss);
  }
  if (const std::optional<exec::MemoryStats> &memory = totals.memory) {
    outs() << formatv("device memory: planned peak {0} B, measured {1} B; "
                      "planned live {2} B, measured {3} B\n",
                      memory->plannedArenaBytes, memory->measuredArenaBytes,
                      memory->plannedLiveBytes, memory->measuredLiveBytes);
    if (memory->plannedArenaBytes != memory->measuredArenaBytes ||
        memory->plannedLiveBytes != memory->measuredLiveBytes)
      return fail("measured device memory differs from the plan", 4);
  }
  return 0;
}

/// A rank of a data-parallel job (docs/Distributed.md): messages say which
/// rank, ranks other than 0 print nothing but errors, and every rank must
/// have been given the same command.
Error joinJob(dist::Collectives &comm, int argc, char **argv) {
  rankPrefix = formatv("rank {0} on {1}: ", comm.rank(), comm.host()).str();
  speaks = comm.rank() == 0;
  if (!(collectiveTimeout > 0))
    return createStringError("--collective-timeout must be a positive number "
                             "of seconds");
  comm.setTimeout(collectiveTimeout);
  const dist::World &w = comm.world();
  launchPrefix = formatv("{0} {1} {2} ", w.launcher,
                         w.launcher == "mpirun" ? "-np" : "-n", w.size)
                     .str();
  if (comm.rank() != 0) {
    noProgress = true;
    outs().flush();
    int null = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (null >= 0) {
      ::dup2(null, STDOUT_FILENO);
      ::close(null);
    }
  }
  std::string command;
  for (int i = 1; i < argc; ++i)
    command += std::string(argv[i]) + '\0';
  if (Error e = comm.checkSame("the command line", command))
    return e;
  // The same flags may resolve differently per node (--backend auto).
  if (Error e = comm.checkSame("the backend", backendName))
    return e;
  if (!saveGradients.empty())
    return createStringError("--save-gradients writes one process's "
                             "gradients; in a job of several ranks they are "
                             "not the step's: run it in one process");
  return Error::success();
}

/// The job the plans are for: on the cuda backend, the launcher's, whose
/// collectives run on the devices (NCCL), as many ranks on every node, and
/// so on the sim backend, which predicts the cuda backend's step; the cpu
/// backend plans one rank's step and does a job's collectives on the host.
Expected<tools::JobShape> jobShapeOf(dist::Collectives &comm) {
  tools::JobShape shape;
  if (backendName == "cpu" || comm.size() == 1)
    return shape;
  const dist::World &w = comm.world();
  if (Error e =
          comm.checkSame("the ranks per node", std::to_string(w.localSize)))
    return std::move(e);
  if (w.localSize < 1 || comm.size() % w.localSize != 0)
    return createStringError(formatv(
        "{0} ranks with {1} on this node: the {2} backend plans a job of "
        "as many ranks (GPUs) on every node",
        comm.size(), w.localSize, backendName));
  shape.gpusPerNode = w.localSize;
  shape.nodes = comm.size() / w.localSize;
  return shape;
}

/// What the run flags ask of the training loop (train::TrainingRun).
/// In a job of several ranks only rank 0 writes: the state is the same on
/// every rank (docs/Distributed.md).
train::RunOptions runOptionsOf(const char *tool, int rank) {
  train::RunOptions runOptions;
  runOptions.checkpointDir = checkpointDir;
  // With --steps 0 a checkpoint folder is only read (e.g. to export
  // weights from a read-only archive): no lock, nothing written.
  runOptions.writesCheckpoints = steps > 0;
  runOptions.ownsCheckpoints = rank == 0; // the others write their shards
  runOptions.checkpointEvery = checkpointEvery;
  runOptions.resume = resume;
  runOptions.overwriteCheckpoints = overwriteCheckpoints;
  if (tools::flagGiven("lr-decay-steps"))
    runOptions.lrDecaySteps =
        planningOption<int64_t>("lr-decay-steps").value_or(0);
  if (rank == 0) {
    runOptions.metricsPath = metricsFile;
    runOptions.reportPath = reportFile;
    runOptions.tracePath = traceFile;
  }
  runOptions.valEvery = valEvery;
  runOptions.maxNonFiniteSteps = maxNonFiniteSteps;
  runOptions.toolName = tool;
  runOptions.note = [](StringRef line) {
    outs() << line << "\n";
    outs().flush();
  };
  return runOptions;
}

/// A run stopped by SIGINT or SIGTERM after `done` steps: a checkpoint
/// where there is a folder for it, the command that continues the run,
/// exit 128 + the signal.
int stopped(train::TrainingRun &run, train::Session &s, int64_t done, int argc,
            char **argv, const char *tool) {
  int sig = stopSignal;
  // Every rank of a job writes its shards of the checkpoint.
  if (run.writesCheckpoints())
    if (Error err = done ? run.checkpoint() : Error::success())
      return fail(formatv("stopped by {0} after step {1}, but the "
                          "checkpoint failed: {2}",
                          sig == SIGINT ? "SIGINT" : "SIGTERM", s.step(),
                          toString(std::move(err)))
                      .str());
  if (!speaks) { // rank 0 says how to continue
    if (Error e = run.finish(/*whole=*/false))
      return fail(toString(std::move(e)));
    return 128 + sig;
  }
  errs() << "\n";
  std::string note;
  if (run.writesCheckpoints()) {
    note = (job && job->size() > 1
                ? "to continue (with the launcher's own options too): "
                : "to continue: ") +
           resumeCommand(argc, argv, steps - done, done > 0 || resume);
  } else {
    note = "no --checkpoint-dir was given, so the state is not saved";
  }
  if (Error err = run.finish(/*whole=*/false))
    return fail(toString(std::move(err)));
  WithColor::warning(errs(), tool) << formatv(
      "stopped by {0} after {1} of {2} steps{3}; {4}\n",
      sig == SIGINT ? "SIGINT" : "SIGTERM", done, steps.getValue(),
      saveWeights.empty() ? "" : " (--save-weights not written)", note);
  outs() << note << "\n";
  return 128 + sig;
}

/// A resume takes the checkpoint's seed and data, and --max-steps what is
/// left of the run.
Error continueRun(const train::TrainingRun &run) {
  if (Error e = adoptRunSettings(*run.storedSettings()))
    return e;
  if (maxSteps.getNumOccurrences()) {
    Expected<int64_t> done = run.storedStep();
    if (!done)
      return done.takeError();
    steps = std::max<int64_t>(maxSteps - *done, 0);
    if (steps == 0)
      outs() << formatv("the run has taken {0} steps, --max-steps {1}: "
                        "nothing left to run\n",
                        *done, maxSteps.getValue());
  }
  return Error::success();
}

/// The run's plans: the --plan file, or the tool's compiled plan (one per
/// bucket); `exitCode` for a plan over its budgets.
Expected<std::vector<train::BucketPlan>>
loadPlans(const tools::RunTool &tool, const train::Settings *stored,
          const tools::JobShape &jobShape, int &exitCode) {
  if (planFile.empty())
    return tool.compile(stored, dataDir, jobShape, exitCode);
  Expected<exec::ExecPlan> loaded = exec::loadExecPlan(planFile);
  if (!loaded)
    return loaded.takeError();
  std::vector<train::BucketPlan> plans;
  plans.push_back({"", std::move(*loaded), 0});
  return plans;
}

/// Steps past the schedule's horizon run at its floor: say so rather than
/// train at --min-lr unnoticed (a resume beyond the first run's --steps).
void warnPastHorizon(train::Session &s) {
  const train::Recipe &r = s.recipe();
  int64_t first = s.step(), last = first + steps;
  bool decays = r.lrSchedule == train::LrSchedule::WarmupCosine ||
                r.lrSchedule == train::LrSchedule::WarmupLinear;
  if (speaks && s.backend().computesLoss() && decays && last > r.decaySteps)
    errs() << formatv(
        "warning: steps {0}..{1} run at the schedule's floor (lr {2}): its "
        "horizon is step {3}; give --lr-decay-steps N (N >= {1}) to decay "
        "over them\n",
        std::max(first, r.decaySteps) + 1, last, format("%g", r.minLr),
        r.decaySteps);
}

/// The steps, then what is saved at the end, and the summary; a stop at a
/// step boundary where a signal asks.
int trainAndSave(train::TrainingRun &run, train::Session &s,
                 dist::Collectives &comm, int argc, char **argv,
                 const char *tool) {
  const exec::ExecPlan &p = s.plan();
  bool computesLoss = s.backend().computesLoss();
  Progress progress(s.step(), s.step() + steps,
                    !noProgress && sys::Process::StandardErrIsDisplayed());
  StringMap<std::vector<float>> gradients; // of the last step
  auto onStep = [&](const train::RunStep &step) {
    if (comm.rank() != 0)
      return; // rank 0 speaks for the job: the ranks' steps are the same
    const exec::StepResult &result = step.report.result;
    if (result.skipped)
      errs() << formatv("\nstep {0}: {1} is not finite; the step is skipped "
                        "(no update; {2} in a row, the run stops at {3})\n",
                        step.step,
                        std::isfinite(result.loss)
                            ? std::string("the gradient norm")
                            : formatv("the loss ({0})", result.loss).str(),
                        step.skippedInARow, maxNonFiniteSteps.getValue());
    if (step.valLoss && metricsFile.empty())
      errs() << formatv("\nstep {0}: validation loss {1:F5}\n", step.step,
                        *step.valLoss);
    double elapsed = run.totals().seconds;
    progress.update(run.firstStep() + step.ran, result.loss,
                    result.unweightedLoss, elapsed,
                    step.ran * p.batch / std::max(elapsed, 1e-9), computesLoss);
  };
  train::TrainingRun::Hooks hooks;
  // Every rank stops at the same step: where any was signalled.
  auto stopRequested = [&] {
    if (comm.size() == 1)
      return stopSignal != 0;
    double stops[2] = {stopSignal == SIGINT ? 1.0 : 0.0,
                       stopSignal == SIGTERM ? 1.0 : 0.0};
    if (Error e = comm.allReduceSum(MutableArrayRef<double>(stops)))
      consumeError(std::move(e)); // the next step's collective says why
    if (!stopSignal && (stops[0] > 0 || stops[1] > 0))
      stopSignal = stops[0] > 0 ? SIGINT : SIGTERM;
    return stopSignal != 0;
  };
  auto beforeStep = [&](exec::StepOptions &options, bool last) {
    if (!saveGradients.empty() && last) {
      gradients.clear();
      options.onGradient = [&](StringRef name, ArrayRef<float> g) {
        gradients[name] = g.vec();
      };
    }
  };
  hooks.stopRequested = stopRequested;
  hooks.beforeStep = beforeStep;
  hooks.afterStep = onStep;
  Expected<int64_t> ran = run.train(steps, hooks);
  if (!ran)
    return fail(toString(ran.takeError()));
  int64_t done = *ran;
  const train::RunTotals &totals = run.totals();

  if (done < steps)
    return stopped(run, s, done, argc, argv, tool);

  if (!saveWeights.empty())
    if (Error err = train::saveSessionWeights(s, saveWeights, {}, saveEma))
      return fail(toString(std::move(err)));
  if (!saveGradients.empty() && totals.lastSkipped)
    return fail("--save-gradients: the last step was skipped for a "
                "non-finite loss, so it has no gradients to write");
  if (!saveGradients.empty() && done > 0)
    if (Error err = writeGradients(p, gradients, saveGradients))
      return fail(toString(std::move(err)));
  if (Error err = run.finish(/*whole=*/true))
    return fail(toString(std::move(err)));

  return summarize(totals, done, computesLoss, tool);
}

} // namespace

bool tools::flagGiven(StringRef name) {
  auto &options = cl::getRegisteredOptions();
  auto it = options.find(name);
  return it != options.end() && it->second->getNumOccurrences();
}

int tools::runMain(int argc, char **argv, const RunTool &tool) {
  toolName = tool.name;
  addVersionPrinter(tool.name);
  std::vector<const cl::OptionCategory *> categories = tool.categories;
  categories.push_back(&runCategory);
  categories.push_back(&recipeCategory);
  categories.push_back(&hardwareCategory);
  cl::HideUnrelatedOptions(categories);
  if (!tools::checkEcosystemFlags(argc, argv, tool.name,
                                  {"overwrite-checkpoints"}))
    return 1;
  cl::ParseCommandLineOptions(
      argc, argv,
      (Twine(tool.overview) +
       "\n\nExit status: 0 done, 1 bad input or a failed step, 3 the plan "
       "does not fit its budgets, 4 measured device memory differs from the "
       "plan, 5 a collective of a job of several ranks timed out, 130/143 "
       "stopped by SIGINT/SIGTERM after saving a checkpoint.\n")
          .str());

  if (printEcosystemTable) {
    tools::printEcosystemFlags(outs());
    return 0;
  }
  // From the start: a signal while compiling ends the run before its
  // first step, not with the default action.
  installStopHandlers();
  if (Error e = checkRunFlags(tool))
    return fail(toString(std::move(e)));
  Expected<std::unique_ptr<dist::Collectives>> jobOpened =
      dist::openCollectives();
  if (!jobOpened)
    return fail(toString(jobOpened.takeError()));
  dist::Collectives &comm = **jobOpened;
  job = &comm;
  Expected<train::Recipe> recipe = readRecipeFlags(INFINITY);
  if (!recipe)
    return fail(toString(recipe.takeError()));
  if (saveEma && (saveWeights.empty() || !recipe->hasEma()))
    return fail("--save-ema writes the EMA with --save-weights: give both "
                "and --ema-decay");
  std::string backendWhy = resolveBackend();
  if (comm.size() > 1)
    if (Error e = joinJob(comm, argc, argv))
      return fail(toString(std::move(e)));
  if (Error e = checkDistinctOutputs())
    return fail(toString(std::move(e)));
  // Every output is created or proven writable now, not after hours of
  // training; folders made here go again if the run fails.
  Expected<std::unique_ptr<train::TrainingRun>> opened =
      train::TrainingRun::open(runOptionsOf(tool.name, comm.rank()));
  if (!opened)
    return fail(toString(opened.takeError()));
  train::TrainingRun &run = **opened;
  const train::Settings *storedSettings = run.storedSettings();
  if (resume)
    if (Error e = continueRun(run))
      return fail(toString(std::move(e)));
  CreatedFolders created;
  if (comm.rank() != 0)
    savePlan = ""; // rank 0's; every rank sends its shards to --save-weights
  if (!saveWeights.empty() && comm.rank() == 0)
    if (Error e = prepareOutputDirectory(saveWeights, &created.dirs))
      return fail("--save-weights: " + toString(std::move(e)));
  for (auto [flag, file] :
       {std::pair<StringRef, StringRef>{"--save-plan", savePlan},
        {"--save-gradients", saveGradients}})
    if (!file.empty())
      if (Error e = checkOutputFile(file))
        return fail(flag + ": " + toString(std::move(e)));

  Expected<tools::JobShape> jobShape = jobShapeOf(comm);
  if (!jobShape)
    return fail(toString(jobShape.takeError()));
  int exitCode = 1;
  auto compileStart = std::chrono::steady_clock::now();
  Expected<std::vector<train::BucketPlan>> plans =
      loadPlans(tool, storedSettings, *jobShape, exitCode);
  if (!plans)
    return fail(toString(plans.takeError()), exitCode);
  bool bucketed = !plans->front().name.empty();
  if (bucketed && !savePlan.empty())
    return fail("--save-plan writes one plan; a run over buckets keeps each "
                "bucket's in the plan cache (--plan-cache)");
  if (!precompileKernels.empty()) {
    for (const train::BucketPlan &b : *plans)
      if (int code = precompile(b.plan, precompileKernels))
        return code;
    return 0;
  }
  double compileSeconds = std::chrono::duration<double>(
                              std::chrono::steady_clock::now() - compileStart)
                              .count();

  Expected<train::SessionOptions> sessionOptions =
      sessionOptionsOf(*recipe, plans->front().plan, storedSettings);
  if (!sessionOptions)
    return fail(toString(sessionOptions.takeError()));
  sessionOptions->collectives = &comm;
  Expected<std::unique_ptr<train::Session>> session =
      train::Session::create(std::move(*plans), *sessionOptions);
  if (!session)
    return fail(toString(session.takeError()));
  train::Session &s = **session;
  if (comm.size() > 1) {
    std::string settings;
    for (const auto &[name, value] : s.settings())
      settings += name + "=" + value + "\n";
    if (Error e = comm.checkSame("the run's settings (the plan, data and "
                                 "recipe)",
                                 settings))
      return fail(toString(std::move(e)));
  }
  run.attach(s);
  const exec::ExecPlan &p = s.plan();
  if (!weightsPath.empty())
    if (Error err = train::loadSessionWeights(s, weightsPath))
      return fail(toString(std::move(err)));
  if (resume)
    if (Error err = run.resume())
      return fail(toString(std::move(err)));
  warnPastHorizon(s);
  if (Error err = run.start())
    return fail(toString(std::move(err)));
  // --save-plan is written once every input has loaded: a run that fails
  // on its weights or checkpoint leaves the user's files as they were.
  if (!savePlan.empty())
    if (Error err = exec::saveExecPlan(p, savePlan))
      return fail(toString(std::move(err)));
  printBanner(s, tool.name, backendWhy, compileSeconds);

  return trainAndSave(run, s, comm, argc, argv, tool.name);
}
