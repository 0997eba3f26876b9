//===- ReplayMain.cpp - Run a fuzz target over saved inputs ---------------===//
//
// The main of the megaslide-fuzz-<name>-replay binaries: feeds every file
// named on the command line (directories: every file in them but dotfiles,
// in name order) through the target's LLVMFuzzerTestOneInput once, as
// libFuzzer does when given files, but without libFuzzer, so any compiler
// builds it and the regular test suite replays the corpus and the crash
// regressions (test/fuzz/replay.test). Arguments starting with '-' are
// libFuzzer options and are ignored, so both binaries take the same
// command line.
//
//===----------------------------------------------------------------------===//

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/SmallVector.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <cstdint>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int *argc,
                                                          char ***argv);

/// Appends `path`, or the regular files directly in it, to `inputs`.
static bool collect(llvm::StringRef path, std::vector<std::string> &inputs) {
  if (!llvm::sys::fs::is_directory(path)) {
    if (!llvm::sys::fs::exists(path)) {
      llvm::errs() << "error: no such file or directory '" << path << "'\n";
      return false;
    }
    inputs.push_back(path.str());
    return true;
  }
  std::vector<std::string> files;
  std::error_code ec;
  for (llvm::sys::fs::directory_iterator it(path, ec), end; it != end && !ec;
       it.increment(ec))
    if (llvm::sys::fs::is_regular_file(it->path()) &&
        !llvm::sys::path::filename(it->path()).starts_with("."))
      files.push_back(it->path());
  if (ec) {
    llvm::errs() << "error: cannot list '" << path << "': " << ec.message()
                 << "\n";
    return false;
  }
  llvm::sort(files);
  llvm::append_range(inputs, files);
  return true;
}

int main(int argc, char **argv) {
  if (LLVMFuzzerInitialize)
    LLVMFuzzerInitialize(&argc, &argv);
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; ++i)
    if (argv[i][0] != '-' && !collect(argv[i], inputs))
      return 2;
  for (const std::string &path : inputs) {
    // Named before it runs, so a crash report says which input it was.
    llvm::errs() << "Running: " << path << "\n";
    llvm::ErrorOr<std::unique_ptr<llvm::MemoryBuffer>> buffer =
        llvm::MemoryBuffer::getFile(path, /*IsText=*/false,
                                    /*RequiresNullTerminator=*/false);
    if (!buffer) {
      llvm::errs() << "error: cannot read '" << path
                   << "': " << buffer.getError().message() << "\n";
      return 2;
    }
    // A copy of exactly the input's bytes, as libFuzzer passes it, so that
    // ASan sees a read one past the end.
    llvm::StringRef bytes = (*buffer)->getBuffer();
    std::vector<uint8_t> data(bytes.begin(), bytes.end());
    LLVMFuzzerTestOneInput(data.data(), data.size());
  }
  llvm::outs() << "replayed " << inputs.size() << " inputs\n";
  return 0;
}
