//===- megaslide-translate.cpp - MLIR -> CUDA C++, execution plans --------===//
//
// Emits the 3D-DSA kernels of a module as CUDA C++, one source per distinct
// configuration plus a manifest, and optionally compiles them with NVRTC
// into cubins with a resource report (registers, shared memory, spills,
// theoretical occupancy on H100/H200); or writes a planned module
// (megaslide-plan --emit-plan-mlir) as an execution plan. Exit status: 0
// success, 1 bad input, unsupported configuration or compilation failure
// (log printed verbatim).
//
//===----------------------------------------------------------------------===//

#include "dialects/Graph/GraphOps.h"
#include "dialects/Schedule/ScheduleOps.h"
#include "megaslide/Support/IrNesting.h"
#include "megaslide/Target/Cuda/DsaKernels.h"
#include "megaslide/Target/ExecPlan/ExportExecPlan.h"
#include "megaslide/Version.h"
#include "megaslide/runtime/cuda/Nvrtc.h"
#include "megaslide/runtime/plan/ExecPlanJson.h"
#include "megaslide/runtime/support/AtomicFile.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Support/FileUtilities.h"
#include "mlir/Support/ToolUtilities.h"

#include "llvm/Support/CommandLine.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/InitLLVM.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/SourceMgr.h"
#include "llvm/Support/WithColor.h"

using namespace llvm;
using namespace megaslide;

namespace {

cl::OptionCategory category("megaslide-translate options");

cl::opt<std::string> inputFile(cl::Positional, cl::init("-"),
                               cl::desc("<input .mlir file>"),
                               cl::cat(category));
cl::opt<bool> emitDsaKernels(
    "emit-dsa-kernels", cl::cat(category),
    cl::desc("Emit one CUDA C++ source per distinct 3D-DSA configuration "
             "(forward, backward, offset estimation) and manifest.json"));
cl::opt<bool> emitExecPlan(
    "emit-exec-plan", cl::cat(category),
    cl::desc("Write the planned module (megaslide-plan --emit-plan-mlir) as "
             "an execution plan (JSON, docs/ExecutionPlan.md)"));
cl::opt<std::string>
    outputPath("o", cl::cat(category), cl::value_desc("DIR|FILE"),
               cl::desc("Output directory of --emit-dsa-kernels, file of "
                        "--emit-exec-plan (default: stdout)"));
cl::opt<bool> splitInputFile(
    "split-input-file", cl::cat(category),
    cl::desc("Process each '// -----' chunk of the input separately "
             "(stdout only)"));
cl::opt<bool> verifyDiagnostics(
    "verify-diagnostics", cl::cat(category),
    cl::desc("Check the diagnostics against expected-* comments instead of "
             "printing output (stdout only)"));
cl::opt<std::string> cubinArch(
    "cubin", cl::cat(category), cl::value_desc("ARCH"),
    cl::desc("Also compile each source with NVRTC for ARCH (e.g. sm_90a) "
             "into <name>.cubin and <name>.resources.txt (needs -o)"));

void writeResources(raw_ostream &os, const cuda::DsaConfig &config,
                    const cuda::DsaKernelPlan &plan,
                    const std::vector<cuda::KernelResources> &resources,
                    int &totalSpillBytes) {
  os << "# " << cuda::configName(config) << "\n# " << config.describe()
     << "\n# compiled by NVRTC " << cuda::nvrtcVersionString() << " for "
     << cubinArch << "; theoretical occupancy per SM of H100/H200 (sm_90)\n";
  for (const cuda::DsaLaunch &launch : plan.launches) {
    os << "\nkernel " << launch.name << " (" << cuda::kindName(launch.kind)
       << ")\n";
    auto it = llvm::find_if(resources, [&](const cuda::KernelResources &r) {
      return r.kernel == launch.name;
    });
    if (it == resources.end()) {
      os << "  not in the ptxas log\n";
      continue;
    }
    cuda::Occupancy occ =
        cuda::occupancySm90(*it, launch.threads, launch.dynamicSharedBytes);
    totalSpillBytes += it->spillStores + it->spillLoads;
    os << formatv("  registers:         {0}\n", it->registers)
       << formatv("  shared memory:     {0} bytes static + {1} bytes dynamic\n",
                  it->sharedBytes, launch.dynamicSharedBytes)
       << formatv("  stack frame:       {0} bytes\n", it->stackBytes)
       << formatv("  spill stores:      {0} bytes\n", it->spillStores)
       << formatv("  spill loads:       {0} bytes\n", it->spillLoads)
       << formatv("  threads per block: {0}\n", launch.threads)
       << formatv("  occupancy:         {0} blocks/SM, {1} warps/SM, "
                  "{2:F1}% (limited by {3})\n",
                  occ.blocksPerSm, occ.warpsPerSm, occ.fraction * 100,
                  occ.limiter);
  }
}

/// Writes `path` atomically; false after the error naming it is printed.
bool writeBinary(StringRef path, StringRef data) {
  if (Error err = writeFileAtomically(path, data)) {
    WithColor::error(errs(), "megaslide-translate")
        << toString(std::move(err)) << "\n";
    return false;
  }
  return true;
}

/// Parses one buffer and emits its kernels (and cubins). Returns 1 on
/// failure, after the diagnostics have been printed.
int processBuffer(std::unique_ptr<MemoryBuffer> buffer, raw_ostream &os) {
  mlir::DialectRegistry registry;
  registry.insert<graph::GraphDialect, schedule::ScheduleDialect,
                  mlir::func::FuncDialect>();
  mlir::MLIRContext context(registry);
  // The location says which op; its full text (video-sized tensor types)
  // would only bury the message.
  context.printOpOnDiagnostic(false);
  SourceMgr sourceMgr;
  sourceMgr.AddNewSourceBuffer(std::move(buffer), SMLoc());

  cuda::EmittedDsaKernels emitted;
  if (verifyDiagnostics) {
    // Expected diagnostics (// expected-error {{...}}) replace the output.
    mlir::SourceMgrDiagnosticVerifierHandler verifier(sourceMgr, &context);
    mlir::OwningOpRef<mlir::ModuleOp> module =
        mlir::parseSourceFile<mlir::ModuleOp>(sourceMgr, &context);
    if (module)
      (void)cuda::emitDsaKernels(*module, "", os, emitted);
    return mlir::failed(verifier.verify()) ? 1 : 0;
  }
  mlir::SourceMgrDiagnosticHandler diagnostics(sourceMgr, &context);
  mlir::OwningOpRef<mlir::ModuleOp> module =
      mlir::parseSourceFile<mlir::ModuleOp>(sourceMgr, &context);
  if (!module)
    return 1;
  if (mlir::failed(cuda::emitDsaKernels(*module, outputPath, os, emitted)))
    return 1;
  if (emitted.configs.empty())
    errs() << "megaslide-translate: note: no 3D-DSA ops in the module\n";
  if (cubinArch.empty())
    return 0;

  auto fail = [](const Twine &message) {
    WithColor::error(errs(), "megaslide-translate") << message << "\n";
    return 1;
  };
  std::string why;
  if (!cuda::nvrtcAvailable(&why))
    return fail("--cubin: " + why);
  int totalSpillBytes = 0;
  for (size_t i = 0; i < emitted.configs.size(); ++i) {
    std::string name = cuda::configName(emitted.configs[i]);
    cuda::CompileResult result =
        cuda::compileCuda(emitted.sources[i], name + ".cu", cubinArch);
    if (!result.ok()) {
      // The NVRTC log, verbatim: it names the line of the generated source.
      errs() << result.error;
      if (!StringRef(result.error).ends_with("\n"))
        errs() << "\n";
      return fail("NVRTC failed to compile " + name + ".cu for " + cubinArch);
    }
    SmallString<256> base(outputPath);
    sys::path::append(base, name);
    std::string report;
    raw_string_ostream rs(report);
    writeResources(rs, emitted.configs[i], emitted.plans[i],
                   cuda::parsePtxasLog(result.log), totalSpillBytes);
    if (!writeBinary((base + ".cubin").str(), result.cubin) ||
        !writeBinary((base + ".resources.txt").str(), report))
      return 1;
    os << formatv("{0}.cubin: {1} bytes{2}\n", name, result.cubin.size(),
                  result.fromCache ? " (kernel cache)" : "");
  }
  os << formatv("total spill bytes: {0}\n", totalSpillBytes);
  return 0;
}

/// Writes the planned module in `buffer` as an execution plan to -o, else
/// to `os`. Returns 1 on failure, after the error has been printed.
int exportPlan(std::unique_ptr<MemoryBuffer> buffer, raw_ostream &os) {
  mlir::DialectRegistry registry;
  registry.insert<graph::GraphDialect, schedule::ScheduleDialect,
                  mlir::func::FuncDialect>();
  mlir::MLIRContext context(registry);
  context.printOpOnDiagnostic(false);
  std::string input = buffer->getBufferIdentifier().str();
  SourceMgr sourceMgr;
  sourceMgr.AddNewSourceBuffer(std::move(buffer), SMLoc());
  mlir::SourceMgrDiagnosticHandler diagnostics(sourceMgr, &context);
  mlir::OwningOpRef<mlir::ModuleOp> module =
      mlir::parseSourceFile<mlir::ModuleOp>(sourceMgr, &context);
  if (!module)
    return 1;
  // The model fields (model, model_config, grid, batch) are not in the
  // module: the plan has the exporter's defaults (docs/ExecutionPlan.md).
  Expected<exec::ExecPlan> plan = exportExecPlan(*module);
  if (!plan) {
    WithColor::error(errs(), "megaslide-translate")
        << input << ": " << toString(plan.takeError()) << "\n";
    return 1;
  }
  // The bytes megaslide-run --save-plan writes, to a file or to stdout.
  if (outputPath.empty()) {
    os << exec::serialize(*plan);
    return 0;
  }
  if (Error err = exec::saveExecPlan(*plan, outputPath)) {
    WithColor::error(errs(), "megaslide-translate")
        << toString(std::move(err)) << "\n";
    return 1;
  }
  return 0;
}

} // namespace

int main(int argc, char **argv) {
  InitLLVM init(argc, argv);
  addVersionPrinter("megaslide-translate");
  cl::HideUnrelatedOptions(category);
  cl::ParseCommandLineOptions(
      argc, argv,
      "MegaSlide translation: 3D-DSA ops -> CUDA C++ kernels (and cubins); "
      "a planned module -> an execution plan\n\n"
      "  megaslide-translate --emit-dsa-kernels IN.mlir -o DIR [--cubin "
      "sm_90a]\n"
      "  megaslide-translate --emit-exec-plan PLANNED.mlir -o PLAN.json\n\n"
      "Exit status: 0 success, 1 bad input, unsupported configuration or "
      "compilation failure.\n");
  auto fail = [](const Twine &message) {
    WithColor::error(errs(), "megaslide-translate") << message << "\n";
    return 1;
  };
  if (emitDsaKernels == emitExecPlan)
    return fail(emitDsaKernels ? "--emit-dsa-kernels and --emit-exec-plan "
                                 "are exclusive: give one"
                               : "nothing to do: pass --emit-dsa-kernels or "
                                 "--emit-exec-plan");
  if (emitExecPlan &&
      (!cubinArch.empty() || splitInputFile || verifyDiagnostics))
    return fail("--cubin, --split-input-file and --verify-diagnostics are "
                "for --emit-dsa-kernels");
  if (!cubinArch.empty() && outputPath.empty())
    return fail("--cubin needs an output directory (-o DIR)");
  if ((splitInputFile || verifyDiagnostics) && !outputPath.empty())
    return fail("--split-input-file and --verify-diagnostics write to "
                "stdout: drop -o");

  std::string error;
  auto file = mlir::openInputFile(inputFile, &error);
  if (!file)
    return fail(error);
  // Input that would overflow the parser's stack is refused first.
  if (std::optional<unsigned> line = findDeepIrNesting(file->getBuffer())) {
    errs() << file->getBufferIdentifier() << ":" << *line
           << ": error: " << kIrNestingMessage << "\n";
    return 1;
  }
  // Standard output through an AtomicFile too: a full disk behind a
  // redirection is an error, not LLVM's fatal "IO failure on output stream".
  std::unique_ptr<AtomicFile> out = cantFail(AtomicFile::create("-"));
  int status =
      emitExecPlan ? exportPlan(std::move(file), out->os())
      : !splitInputFile
          ? processBuffer(std::move(file), out->os())
          : (mlir::failed(mlir::splitAndProcessBuffer(
                 std::move(file),
                 [](std::unique_ptr<MemoryBuffer> chunk, raw_ostream &os) {
                   return mlir::LogicalResult::success(
                       processBuffer(std::move(chunk), os) == 0);
                 },
                 out->os()))
                 ? 1
                 : 0);
  if (Error err = out->commit())
    return fail(toString(std::move(err)));
  return status;
}
