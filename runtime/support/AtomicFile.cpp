//===- AtomicFile.cpp - Output files that are all-or-nothing --------------===//

#include "megaslide/runtime/support/AtomicFile.h"
#include "megaslide/runtime/support/FaultInjection.h"

#include "llvm/Support/Path.h"

#include <atomic>
#include <cassert>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

using namespace megaslide;
using llvm::Error;
using llvm::StringRef;

namespace {

/// What this process has written through AtomicFile, against
/// fault::writeLimit() (docs/Testing.md, "Fault injection").
std::atomic<uint64_t> bytesWrittenByProcess{0};

//===----------------------------------------------------------------------===//
// Paths and errors
//===----------------------------------------------------------------------===//

std::string parentOf(StringRef path) {
  StringRef parent = llvm::sys::path::parent_path(path);
  return parent.empty() ? std::string(".") : parent.str();
}

/// `path` without trailing slashes ("/" stays "/").
StringRef withoutTrailingSlashes(StringRef path) {
  while (path.size() > 1 && path.ends_with("/"))
    path = path.drop_back();
  return path;
}

/// `path` with every symlink of its last component followed (a dangling
/// link gives the path it names, which writing creates). 0 or errno.
int followSymlinks(StringRef path, std::string &out) {
  out = path.str();
  for (int hops = 0; hops < 40; ++hops) {
    struct stat st;
    if (::lstat(out.c_str(), &st) != 0 || !S_ISLNK(st.st_mode))
      return 0;
    std::string target(static_cast<size_t>(st.st_size) + 256, '\0');
    ssize_t n = ::readlink(out.c_str(), target.data(), target.size());
    if (n < 0)
      return errno;
    target.resize(static_cast<size_t>(n));
    if (!StringRef(target).starts_with("/"))
      target = parentOf(out) + "/" + target;
    out = std::move(target);
  }
  return ELOOP;
}

/// Where `folder` (or its nearest existing ancestor) is on a file system of
/// the kernel that holds no user files, a note saying so; else "".
std::string virtualFileSystemNote(StringRef folder) {
  std::string at = withoutTrailingSlashes(folder).str();
  struct statfs fs;
  while (::statfs(at.c_str(), &fs) != 0) {
    std::string up = parentOf(at);
    if (up == at)
      return "";
    at = std::move(up);
  }
  static constexpr struct {
    long magic;
    const char *name;
  } kVirtual[] = {{0x9fa0, "proc"},          {0x62656572, "sysfs"},
                  {0x27e0eb, "cgroup"},      {0x63677270, "cgroup2"},
                  {0x64626720, "debugfs"},   {0x74726163, "tracefs"},
                  {0x73636673, "securityfs"}};
  for (const auto &v : kVirtual)
    if (static_cast<long>(fs.f_type) == v.magic)
      return " ('" + at + "' is on " + v.name +
             ", a virtual file system of the kernel that holds no user "
             "files; choose a folder on a disk)";
  return "";
}

Error errnoError(const llvm::Twine &what, int err, StringRef folder) {
  std::error_code ec(err, std::generic_category());
  std::string note = folder.empty() ? "" : virtualFileSystemNote(folder);
  return llvm::createStringError(ec, what + ": " + ec.message() + note);
}

Error writeError(StringRef path, int err, StringRef folder = "") {
  if (path == "-")
    return errnoError("cannot write to standard output", err, "");
  return errnoError("cannot write '" + path + "'", err, folder);
}

/// Six characters for a temporary's name; O_EXCL settles collisions.
std::string randomSuffix() {
  static std::atomic<uint64_t> counter{0};
  uint64_t x =
      static_cast<uint64_t>(
          std::chrono::steady_clock::now().time_since_epoch().count()) ^
      (counter.fetch_add(1) * 0x9e3779b97f4a7c15ull) ^
      (static_cast<uint64_t>(::getpid()) << 32);
  // splitmix64's finaliser.
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  static constexpr char kChars[] =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::string s;
  for (int i = 0; i < 6; ++i, x /= 62)
    s += kChars[x % 62];
  return s;
}

/// Creates `.<name>.tmp-<pid>-XXXXXX` next to `dest` (mode 0666 & ~umask,
/// as any new file). Returns the descriptor, or -1 with errno set.
int createTemporary(StringRef dest, std::string &tempPath) {
  // Long names are cut so that the temporary's stays within NAME_MAX.
  StringRef name = llvm::sys::path::filename(dest).take_front(200);
  std::string prefix = parentOf(dest) + "/." + name.str() + ".tmp-" +
                       std::to_string(::getpid()) + "-";
  for (int attempt = 0; attempt < 100; ++attempt) {
    tempPath = prefix + randomSuffix();
    int fd =
        ::open(tempPath.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0 || errno != EEXIST)
      return fd;
  }
  return -1;
}

/// 0 if a file can be created (and is removed again) in `folder`, else the
/// errno of the attempt.
int probeFolder(StringRef folder) {
  std::string probe;
  int fd = createTemporary((folder + "/probe").str(), probe);
  if (fd < 0)
    return errno;
  ::close(fd);
  ::unlink(probe.c_str());
  return 0;
}

} // namespace

//===----------------------------------------------------------------------===//
// AtomicFile
//===----------------------------------------------------------------------===//

/// A buffered stream over a descriptor that writes with write(2) and keeps
/// the first errno instead of reporting a fatal error.
class AtomicFile::Stream : public llvm::raw_ostream {
public:
  explicit Stream(int fd) : fd(fd) { SetBufferSize(1 << 16); }
  ~Stream() override { flush(); }

  int fd;
  int error = 0;
  /// Set when the file is abandoned: what is still buffered is dropped.
  bool discard = false;

private:
  void write_impl(const char *ptr, size_t size) override {
    position += size;
    if (error || discard)
      return;
    size_t allowed = size;
    bool full = false;
    if (std::optional<uint64_t> limit = fault::writeLimit()) {
      uint64_t done = bytesWrittenByProcess.load();
      if (done + size > *limit) {
        allowed = *limit > done ? static_cast<size_t>(*limit - done) : 0;
        full = true;
      }
    }
    while (allowed) {
      ssize_t n = ::write(fd, ptr, allowed);
      if (n < 0) {
        if (errno == EINTR)
          continue;
        error = errno;
        return;
      }
      ptr += n;
      allowed -= static_cast<size_t>(n);
      bytesWrittenByProcess += static_cast<uint64_t>(n);
    }
    if (full)
      error = ENOSPC;
  }
  uint64_t current_pos() const override { return position; }

  uint64_t position = 0;
};

AtomicFile::AtomicFile() = default;

AtomicFile::~AtomicFile() {
  if (stream && !finished)
    stream->discard = true;
  stream.reset();
  if (fd >= 0 && ownsFd)
    ::close(fd);
  if (!committed && !tempPath.empty())
    ::unlink(tempPath.c_str());
}

Error AtomicFile::failure(int err) const { return writeError(givenPath, err); }

llvm::Expected<std::unique_ptr<AtomicFile>> AtomicFile::create(StringRef path) {
  std::unique_ptr<AtomicFile> file(new AtomicFile());
  file->givenPath = path.str();
  if (path == "-") {
    // Whatever llvm::outs() holds goes first.
    llvm::outs().flush();
    file->destPath = path.str();
    file->fd = STDOUT_FILENO;
    file->stream = std::make_unique<Stream>(file->fd);
    return file;
  }
  if (path.empty())
    return writeError(path, ENOENT);
  if (int err = followSymlinks(path, file->destPath))
    return writeError(path, err);
  const std::string &dest = file->destPath;
  struct stat st;
  if (::stat(dest.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode))
      return writeError(path, EISDIR);
    if (::faccessat(AT_FDCWD, dest.c_str(), W_OK, AT_EACCESS) != 0) {
      int err = errno;
      return writeError(path, err, parentOf(dest));
    }
    if (!S_ISREG(st.st_mode)) {
      // A device or FIFO: there is nothing to replace.
      int fd = ::open(dest.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd < 0) {
        int err = errno;
        return writeError(path, err);
      }
      file->fd = fd;
      file->ownsFd = true;
      file->stream = std::make_unique<Stream>(fd);
      return file;
    }
    file->keepMode = true;
    file->mode = st.st_mode & 07777;
    file->uid = st.st_uid;
    file->gid = st.st_gid;
  } else if (int err = errno; err != ENOENT) {
    return writeError(path, err, parentOf(dest));
  }
  int fd = createTemporary(dest, file->tempPath);
  if (fd < 0) {
    int err = errno;
    file->tempPath.clear();
    return writeError(path, err, parentOf(dest));
  }
  file->fd = fd;
  file->ownsFd = true;
  file->stream = std::make_unique<Stream>(fd);
  return file;
}

llvm::raw_ostream &AtomicFile::os() {
  assert(!finished && "writing to a finished AtomicFile");
  return *stream;
}

uint64_t AtomicFile::bytesWritten() const { return stream->tell(); }

Error AtomicFile::write(const void *data, size_t size) {
  assert(!finished && "writing to a finished AtomicFile");
  stream->write(static_cast<const char *>(data), size);
  if (stream->error)
    return failure(stream->error);
  return Error::success();
}

Error AtomicFile::finish() {
  if (finished)
    return stream->error ? failure(stream->error) : Error::success();
  finished = true;
  stream->flush();
  int &err = stream->error;
  if (!err && !tempPath.empty()) {
    // Owner first: chown clears the set-user-ID bits that fchmod restores.
    // Giving the file to its owner needs privileges; without them the new
    // file is ours, as with any editor's save.
    if (keepMode) {
      if (uid != ::geteuid() || gid != ::getegid()) {
        int ignored =
            ::fchown(fd, static_cast<uid_t>(uid), static_cast<gid_t>(gid));
        (void)ignored;
      }
      if (::fchmod(fd, static_cast<mode_t>(mode)) != 0)
        err = errno;
    }
    if (!err && ::fsync(fd) != 0)
      err = errno;
  }
  if (fd >= 0 && ownsFd) {
    // close() reports what some file systems (NFS) defer.
    if (::close(fd) != 0 && !err)
      err = errno;
    fd = -1;
    stream->fd = -1;
  }
  return err ? failure(err) : Error::success();
}

Error AtomicFile::commit() {
  assert(!committed && "AtomicFile committed twice");
  if (Error e = finish())
    return e;
  committed = true;
  if (tempPath.empty())
    return Error::success();
  if (::rename(tempPath.c_str(), destPath.c_str()) != 0) {
    int err = errno;
    committed = false;
    return failure(err);
  }
  // The rename itself is durable once the folder is synced.
  std::string folder = parentOf(destPath);
  int dirFd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dirFd < 0) {
    int err = errno;
    return failure(err);
  }
  int rc = ::fsync(dirFd);
  int err = errno;
  ::close(dirFd);
  if (rc != 0 && err != EINVAL)
    return failure(err);
  return Error::success();
}

//===----------------------------------------------------------------------===//
// One-call writers and checks
//===----------------------------------------------------------------------===//

Error megaslide::writeFileAtomically(
    StringRef path, llvm::function_ref<void(llvm::raw_ostream &)> write) {
  llvm::Expected<std::unique_ptr<AtomicFile>> file = AtomicFile::create(path);
  if (!file)
    return file.takeError();
  write((*file)->os());
  return (*file)->commit();
}

Error megaslide::writeFileAtomically(StringRef path, StringRef contents) {
  llvm::Expected<std::unique_ptr<AtomicFile>> file = AtomicFile::create(path);
  if (!file)
    return file.takeError();
  if (Error e = (*file)->write(contents.data(), contents.size()))
    return e;
  return (*file)->commit();
}

Error megaslide::checkOutputFile(StringRef path) {
  if (path == "-")
    return Error::success();
  if (path.empty())
    return writeError(path, ENOENT);
  std::string dest;
  if (int err = followSymlinks(path, dest))
    return writeError(path, err);
  std::string folder = parentOf(dest);
  struct stat st;
  if (::stat(dest.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode))
      return writeError(path, EISDIR);
    if (::faccessat(AT_FDCWD, dest.c_str(), W_OK, AT_EACCESS) != 0) {
      int err = errno;
      return writeError(path, err, folder);
    }
    if (!S_ISREG(st.st_mode))
      return Error::success();
  } else if (int err = errno; err != ENOENT) {
    return writeError(path, err, folder);
  }
  if (int err = probeFolder(folder))
    return writeError(path, err, folder);
  return Error::success();
}

Error megaslide::prepareOutputDirectory(StringRef dirPath,
                                        std::vector<std::string> *created) {
  std::string dir = withoutTrailingSlashes(dirPath).str();
  if (dir.empty())
    dir = ".";
  // The missing folders, innermost first.
  std::vector<std::string> missing;
  std::string at = dir;
  struct stat st;
  while (::stat(at.c_str(), &st) != 0) {
    int err = errno;
    std::string up = parentOf(at);
    if (err != ENOENT || up == at)
      return errnoError("cannot create directory '" + dirPath + "'", err, at);
    missing.push_back(at);
    at = std::move(up);
  }
  if (!S_ISDIR(st.st_mode)) {
    if (missing.empty())
      return llvm::createStringError(
          std::make_error_code(std::errc::not_a_directory),
          "'" + dirPath + "' exists and is not a directory");
    return llvm::createStringError(
        std::make_error_code(std::errc::not_a_directory),
        "cannot create directory '" + dirPath + "': '" + at +
            "' is not a directory");
  }
  std::vector<std::string> made;
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    if (::mkdir(it->c_str(), 0777) == 0) {
      made.push_back(*it);
      continue;
    }
    int err = errno;
    // Created meanwhile by someone else: not ours to remove.
    if (err == EEXIST && ::stat(it->c_str(), &st) == 0 && S_ISDIR(st.st_mode))
      continue;
    removeCreatedDirectories(made);
    std::string what = "cannot create directory '" + *it + "'";
    if (*it != dir)
      what += " (for '" + dirPath.str() + "')";
    return errnoError(what, err, *it);
  }
  if (int err = probeFolder(dir)) {
    removeCreatedDirectories(made);
    return errnoError("cannot write in directory '" + dirPath + "'", err, dir);
  }
  if (created)
    created->insert(created->end(), made.begin(), made.end());
  return Error::success();
}

Error megaslide::checkOutputDirectory(StringRef dir) {
  return prepareOutputDirectory(dir, nullptr);
}

void megaslide::removeCreatedDirectories(llvm::ArrayRef<std::string> created) {
  for (auto it = created.rbegin(); it != created.rend(); ++it)
    ::rmdir(it->c_str());
}
