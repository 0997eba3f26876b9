//===- Files.h - What the readers of the user's folders share ---*- C++ -*-===//
//
// Weights (a diffusers folder, host/Weights.h) and checkpoints (step-N
// folders, host/Checkpoint.h) are folders of the user's files: both name
// the files inside by joining paths and report what fails as an
// invalid-argument error. Header-only: LLVM Support only.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_HOST_FILES_H
#define MEGASLIDE_RUNTIME_HOST_FILES_H

#include "llvm/ADT/SmallString.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/ADT/Twine.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/Path.h"

#include <string>
#include <system_error>

namespace megaslide::host {

/// An llvm::Error with `message` and std::errc::invalid_argument, the code
/// the weight and checkpoint readers and writers give all their errors.
inline llvm::Error error(const llvm::Twine &message) {
  return llvm::createStringError(
      std::make_error_code(std::errc::invalid_argument), message);
}

/// `dir`/`name` with the platform's separator.
inline std::string joinPath(llvm::StringRef dir, llvm::StringRef name) {
  llvm::SmallString<256> p(dir);
  llvm::sys::path::append(p, name);
  return std::string(p);
}

} // namespace megaslide::host

#endif // MEGASLIDE_RUNTIME_HOST_FILES_H
