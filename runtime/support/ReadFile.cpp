//===- ReadFile.cpp - Reading the user's files with bounds ----------------===//

#include "megaslide/runtime/support/ReadFile.h"

#include "llvm/ADT/Twine.h"

#include <algorithm>
#include <cerrno>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

using namespace megaslide;
using llvm::StringRef;

namespace {

std::string subject(StringRef verb, StringRef what, StringRef path) {
  return ("cannot " + verb + " " + what + (what.empty() ? "" : " ") + "'" +
          path + "'")
      .str();
}

llvm::Error errnoError(StringRef verb, StringRef what, StringRef path,
                       int err) {
  std::error_code ec(err, std::generic_category());
  return llvm::createStringError(
      ec, "%s: %s", subject(verb, what, path).c_str(), ec.message().c_str());
}

/// What a non-regular file is, for the error.
const char *kindOf(mode_t mode) {
  if (S_ISDIR(mode))
    return "a directory";
  if (S_ISFIFO(mode))
    return "a FIFO (named pipe)";
  if (S_ISCHR(mode))
    return "a character device";
  if (S_ISBLK(mode))
    return "a block device";
  if (S_ISSOCK(mode))
    return "a socket";
  return "not a regular file";
}

llvm::Error notRegular(StringRef verb, StringRef what, StringRef path,
                       mode_t mode) {
  return llvm::createStringError(
      std::make_error_code(std::errc::invalid_argument),
      "%s: it is %s, not a regular file", subject(verb, what, path).c_str(),
      kindOf(mode));
}

llvm::Expected<int> openChecked(StringRef path, StringRef what, StringRef verb,
                                uint64_t &size) {
  std::string p = path.str();
  // stat first: opening a device can have effects of its own (a tape
  // rewinds), and nothing but a regular file is ever opened on purpose.
  struct stat st;
  if (::stat(p.c_str(), &st) != 0)
    return errnoError(verb, what, path, errno);
  if (!S_ISREG(st.st_mode))
    return notRegular(verb, what, path, st.st_mode);
  // O_NONBLOCK: if the path was replaced by a FIFO since the stat, open
  // returns at once instead of waiting for a writer; fstat then refuses it.
  int fd;
  do
    fd = ::open(p.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  while (fd < 0 && errno == EINTR);
  if (fd < 0)
    return errnoError(verb, what, path, errno);
  int err = ::fstat(fd, &st) != 0 ? errno : 0;
  if (err || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return err ? errnoError(verb, what, path, err)
               : notRegular(verb, what, path, st.st_mode);
  }
  int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0)
    ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  size = static_cast<uint64_t>(st.st_size);
  return fd;
}

} // namespace

llvm::Expected<int> megaslide::openRegularFile(StringRef path, StringRef what,
                                               uint64_t &size) {
  return openChecked(path, what, "open", size);
}

llvm::Expected<std::string>
megaslide::readBoundedFile(StringRef path, uint64_t maxBytes, StringRef what) {
  uint64_t size = 0;
  llvm::Expected<int> fd = openChecked(path, what, "read", size);
  if (!fd)
    return fd.takeError();
  // Refused before reading when stat knows the size.
  auto tooLarge = [&](const std::string &howLarge) {
    return llvm::createStringError(
        std::make_error_code(std::errc::file_too_large),
        "%s: it %s, over the limit of %llu bytes",
        subject("read", what, path).c_str(), howLarge.c_str(),
        static_cast<unsigned long long>(maxBytes));
  };
  if (size > maxBytes) {
    ::close(*fd);
    return tooLarge("is " + std::to_string(size) + " bytes");
  }
  // The size is only a hint: /proc files say 0, and a file may grow while
  // being read. One byte more than the bound is read to see an excess.
  std::string text;
  text.resize(static_cast<size_t>(std::min<uint64_t>(size, maxBytes) + 1));
  uint64_t done = 0;
  for (;;) {
    if (done == text.size()) {
      if (done > maxBytes)
        break;
      text.resize(static_cast<size_t>(std::min<uint64_t>(
          std::max<uint64_t>(2 * done, 4096), maxBytes + 1)));
    }
    ssize_t n = ::read(*fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0) {
      int err = errno;
      ::close(*fd);
      return errnoError("read", what, path, err);
    }
    if (n == 0)
      break;
    done += static_cast<uint64_t>(n);
  }
  ::close(*fd);
  if (done > maxBytes)
    return tooLarge("holds more than " + std::to_string(maxBytes) + " bytes");
  text.resize(static_cast<size_t>(done));
  return text;
}
