//===- megaslide-opt.cpp - MegaSlide optimizer driver ---------------------===//
//
// mlir-opt for MegaSlide: every dialect and pass of the project, plus the
// upstream passes a pipeline author needs (canonicalize, cse, ...). Unlike
// mlir-opt, a failed run leaves an existing -o file as it was: the output
// goes to a temporary file next to it, renamed over it only on success.
// Exit status: 0 success, 1 bad input, failed pass or command line.
//
//===----------------------------------------------------------------------===//

#include "Graph/GraphOps.h"
#include "Schedule/ScheduleOps.h"
#include "megaslide/Pipelines/Pipelines.h"
#include "megaslide/Support/IrNesting.h"
#include "megaslide/Transforms/Passes.h"
#include "megaslide/Version.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/DialectRegistry.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"
#include "mlir/Transforms/Passes.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
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
                  megaslide::sched::ScheduleDialect, mlir::func::FuncDialect>();
  auto [inputFile, outputFile] = mlir::registerAndParseCLIOptions(
      argc, argv, "MegaSlide optimizer driver\n", registry);

  // Input that would overflow the parser's stack is refused first (a file
  // that does not open is reported by MlirOptMain).
  if (failed(checkIrNesting(inputFile)))
    return 1;

  // mlir-opt truncates the output before reading the input and deletes it
  // on failure, destroying what a previous run wrote there. Write a
  // temporary file in the same directory instead and rename it into place
  // on success. Devices, pipes and stdout are written directly.
  llvm::SmallString<256> target(outputFile);
  bool replace = outputFile != "-";
  if (replace && llvm::sys::fs::exists(outputFile)) {
    replace = !llvm::sys::fs::real_path(outputFile, target) &&
              llvm::sys::fs::is_regular_file(target);
  }
  llvm::SmallString<256> temp;
  if (replace) {
    llvm::SmallString<256> model(target);
    model += ".tmp-%%%%%%";
    int fd;
    // Where no temporary can be created (a read-only directory), the
    // output is written in place as mlir-opt does.
    if (llvm::sys::fs::createUniqueFile(model, fd, temp))
      temp.clear();
    else
      llvm::sys::fs::closeFile(fd);
  }
  if (temp.empty())
    return mlir::asMainReturnCode(
        mlir::MlirOptMain(argc, argv, inputFile, outputFile, registry));

  mlir::LogicalResult result =
      mlir::MlirOptMain(argc, argv, inputFile, temp, registry);
  if (mlir::succeeded(result)) {
    if (std::error_code ec = llvm::sys::fs::rename(temp, target)) {
      llvm::WithColor::error(llvm::errs(), "megaslide-opt")
          << "cannot write '" << outputFile << "': " << ec.message() << "\n";
      result = mlir::failure();
    }
  }
  // After a failure MlirOptMain has removed the temporary already.
  if (mlir::failed(result))
    llvm::sys::fs::remove(temp);
  return mlir::asMainReturnCode(result);
}
