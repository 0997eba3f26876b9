//===- megaslide-opt.cpp - MegaSlide optimizer driver ---------------------===//
//
// mlir-opt for MegaSlide: every dialect and pass of the project, plus the
// upstream passes a pipeline author needs (canonicalize, cse, ...). Unlike
// mlir-opt, a failed run leaves an existing -o file as it was: the output
// is written atomically (support/AtomicFile.h: a temporary next to it,
// renamed over it only on success, its permissions kept), and a full disk
// is an error naming the file, not LLVM's "IO failure on output stream".
// Exit status: 0 success, 1 bad input, failed pass or command line.
//
//===----------------------------------------------------------------------===//

#include "dialects/Graph/GraphOps.h"
#include "dialects/Schedule/ScheduleOps.h"
#include "megaslide/Pipelines/Pipelines.h"
#include "megaslide/Support/IrNesting.h"
#include "megaslide/Transforms/Passes.h"
#include "megaslide/Version.h"
#include "megaslide/runtime/support/AtomicFile.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/DialectRegistry.h"
#include "mlir/Support/FileUtilities.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"
#include "mlir/Transforms/Passes.h"

#include "llvm/Support/InitLLVM.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Process.h"
#include "llvm/Support/WithColor.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <unistd.h>

namespace megaslide::test {
void registerTestPasses();
} // namespace megaslide::test

/// Refuses input nested deeper than MLIR's parser can recurse. Piped stdin
/// is read here, checked and handed back to MlirOptMain as stdin through a
/// temporary file; a terminal is left alone (a person typing IR nests
/// shallowly, and `--list-passes` must not wait for input).
static mlir::LogicalResult checkIrNesting(llvm::StringRef inputFile) {
  bool fromStdin = inputFile == "-";
  if (fromStdin && llvm::sys::Process::StandardInIsUserInput())
    return mlir::success();
  llvm::ErrorOr<std::unique_ptr<llvm::MemoryBuffer>> input =
      llvm::MemoryBuffer::getFileOrSTDIN(inputFile);
  if (!input)
    return mlir::success();
  llvm::StringRef text = (*input)->getBuffer();
  if (std::optional<unsigned> line = megaslide::findDeepIrNesting(text)) {
    llvm::errs() << (*input)->getBufferIdentifier() << ":" << *line
                 << ": error: " << megaslide::kIrNestingMessage << "\n";
    return mlir::failure();
  }
  if (!fromStdin)
    return mlir::success();
  std::FILE *copy = std::tmpfile();
  bool handedBack =
      copy && std::fwrite(text.data(), 1, text.size(), copy) == text.size() &&
      std::fflush(copy) == 0 && std::fseek(copy, 0, SEEK_SET) == 0 &&
      ::dup2(::fileno(copy), STDIN_FILENO) >= 0;
  int error = errno;
  if (copy)
    std::fclose(copy); // stdin keeps the file open
  if (!handedBack) {
    llvm::WithColor::error(llvm::errs(), "megaslide-opt")
        << "cannot buffer stdin: " << std::strerror(error) << "\n";
    return mlir::failure();
  }
  return mlir::success();
}

int main(int argc, char **argv) {
  megaslide::addVersionPrinter("megaslide-opt");
  mlir::registerTransformsPasses();
  megaslide::registerMegaSlidePasses();
  megaslide::registerPipelines();
  megaslide::test::registerTestPasses();

  mlir::DialectRegistry registry;
  registry.insert<megaslide::graph::GraphDialect,
                  megaslide::schedule::ScheduleDialect, mlir::func::FuncDialect>();
  auto [inputFile, outputFile] = mlir::registerAndParseCLIOptions(
      argc, argv, "MegaSlide optimizer driver\n", registry);

  // Input that would overflow the parser's stack is refused first (a file
  // that does not open is reported below).
  if (failed(checkIrNesting(inputFile)))
    return 1;

  // What MlirOptMain(argc, argv, input, output, registry) does, but with
  // the output written through an AtomicFile instead of mlir-opt's
  // ToolOutputFile, which truncates the output before the input is read,
  // deletes it on failure and aborts with a fatal error on a full disk.
  llvm::InitLLVM init(argc, argv);
  mlir::MlirOptMainConfig config =
      mlir::MlirOptMainConfig::createFromCLOptions();
  auto error = [](const llvm::Twine &message) {
    llvm::WithColor::error(llvm::errs(), "megaslide-opt") << message << "\n";
    return 1;
  };
  // --show-dialects and --list-passes print and return: no input is read,
  // no output created.
  if (config.shouldShowDialects() || config.shouldListPasses())
    return mlir::asMainReturnCode(mlir::MlirOptMain(
        llvm::outs(), llvm::MemoryBuffer::getMemBuffer(""), registry, config));
  if (inputFile == "-" &&
      llvm::sys::Process::FileDescriptorIsDisplayed(fileno(stdin)))
    llvm::errs() << "(processing input from stdin now, hit ctrl-c/ctrl-d to "
                    "interrupt)\n";
  std::string errorMessage;
  std::unique_ptr<llvm::MemoryBuffer> input =
      mlir::openInputFile(inputFile, &errorMessage);
  if (!input) {
    llvm::errs() << errorMessage << "\n";
    return 1;
  }
  llvm::Expected<std::unique_ptr<megaslide::AtomicFile>> output =
      megaslide::AtomicFile::create(outputFile);
  if (!output)
    return error(llvm::toString(output.takeError()));
  // On failure the temporary goes with `output`.
  if (mlir::failed(mlir::MlirOptMain((*output)->os(), std::move(input),
                                     registry, config)))
    return 1;
  if (llvm::Error err = (*output)->commit())
    return error(llvm::toString(std::move(err)));
  return 0;
}
