//===- AtomicFile.h - Output files that are all-or-nothing ------*- C++ -*-===//
//
// Every file a MegaSlide tool or the runtime writes goes through AtomicFile:
// the bytes go to a temporary file in the destination's folder
// (`.<name>.tmp-<pid>-XXXXXX`), which commit() fsyncs, gives the mode the
// destination had (a new file gets 0666 & ~umask, as a plain create) and
// renames over the destination, then fsyncs the folder. Until then the
// destination is untouched; a failure at any point (a full disk, a killed
// run, an error of the caller) removes the temporary, so the user has the
// old file or the whole new one, never a truncated one. Streams write with
// write(2) and keep the first errno, so no raw_fd_ostream "IO failure on
// output stream" fatal error can fire; errors name the destination and the
// errno text: "cannot write 'F': No space left on device".
//
// Destinations that are not regular files (stdout "-", /dev/null, a FIFO, a
// character device) are written directly. A symlink is followed: the file
// it points to is replaced, the link stays.
//
// Test-only seam: MEGASLIDE_FAULT_WRITE_LIMIT=<bytes> (fault::writeLimit(),
// support/FaultInjection.h) makes every AtomicFile write fail with ENOSPC
// once that many bytes have been written by the process, like a disk that
// fills up (docs/Testing.md). No MLIR dependency: LLVM Support and POSIX
// only.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_SUPPORT_ATOMICFILE_H
#define MEGASLIDE_RUNTIME_SUPPORT_ATOMICFILE_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/raw_ostream.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace megaslide {

/// One output file, replaced as a whole by commit() or not at all.
class AtomicFile {
public:
  /// Opens the output `path`: a temporary file next to it (after following
  /// symlinks), or `path` itself when it is "-" (stdout) or an existing
  /// non-regular file. Fails, naming `path`, when `path` is a directory, an
  /// existing regular file that may not be written, or in a folder where no
  /// file can be created.
  static llvm::Expected<std::unique_ptr<AtomicFile>>
  create(llvm::StringRef path);
  /// Removes the temporary unless commit() succeeded.
  ~AtomicFile();
  AtomicFile(const AtomicFile &) = delete;
  AtomicFile &operator=(const AtomicFile &) = delete;

  /// The stream to write text to. Write errors are kept, not fatal: they
  /// surface from write(), finish() and commit().
  llvm::raw_ostream &os();
  /// Appends `size` bytes (after what os() has buffered); an error naming
  /// the file if this or an earlier write failed.
  llvm::Error write(const void *data, size_t size);
  /// Makes the contents durable under the temporary name: flushes, checks
  /// for write errors, fsyncs and sets the mode. commit() calls it; call it
  /// first to learn of every I/O error of a set of files before any of
  /// them replaces its destination. Nothing may be written afterwards.
  llvm::Error finish();
  /// finish(), then renames the temporary over the destination and fsyncs
  /// the folder. Once only.
  llvm::Error commit();

  /// The path given to create().
  llvm::StringRef path() const { return givenPath; }
  /// What commit() replaces: path() with symlinks followed.
  llvm::StringRef destination() const { return destPath; }
  /// The temporary file; empty when writing directly.
  llvm::StringRef temporary() const { return tempPath; }
  /// Bytes written so far, including what os() still buffers.
  uint64_t bytesWritten() const;

private:
  class Stream;
  AtomicFile();
  llvm::Error failure(int err) const;

  std::string givenPath, destPath, tempPath;
  std::unique_ptr<Stream> stream;
  int fd = -1;
  bool ownsFd = false;   ///< false for stdout
  bool keepMode = false; ///< the destination existed: give its mode
  unsigned mode = 0;
  unsigned uid = 0, gid = 0;
  bool finished = false, committed = false;
};

/// Writes `path` atomically with what `write` puts into the stream.
llvm::Error
writeFileAtomically(llvm::StringRef path,
                    llvm::function_ref<void(llvm::raw_ostream &)> write);
/// Writes `contents` to `path` atomically.
llvm::Error writeFileAtomically(llvm::StringRef path, llvm::StringRef contents);

/// Proves, before any long work, that `path` can be written: "-", or its
/// folder exists and a file can be created there (one is created and
/// removed), and if `path` exists it is a writable regular file, device or
/// FIFO, not a directory. Nothing is left behind. The error names `path`
/// and the reason (errno text; virtual file systems such as /proc and /sys
/// are named as such).
llvm::Error checkOutputFile(llvm::StringRef path);

/// Creates folder `dir` and its missing parents (mode 0777 & ~umask) and
/// proves a file can be created in it. The folders it created, outermost
/// first, are appended to `*created` (when given), so that a run that fails
/// later can remove them with removeCreatedDirectories(); when this call
/// itself fails it removes what it created. Errors name the folder and the
/// reason: "exists and is not a directory", EROFS, EACCES, /proc and /sys.
llvm::Error prepareOutputDirectory(llvm::StringRef dir,
                                   std::vector<std::string> *created);
/// prepareOutputDirectory(dir, nullptr).
llvm::Error checkOutputDirectory(llvm::StringRef dir);
/// Removes the folders in `created` (as prepareOutputDirectory recorded
/// them), innermost first, where they are still empty; never anything else.
void removeCreatedDirectories(llvm::ArrayRef<std::string> created);

} // namespace megaslide

#endif // MEGASLIDE_RUNTIME_SUPPORT_ATOMICFILE_H
