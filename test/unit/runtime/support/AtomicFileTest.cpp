//===- AtomicFileTest.cpp - All-or-nothing output files -------------------===//
//
// support/AtomicFile (runtime): commit replaces a file whole; a failed
// write (a file-size limit, which fails write(2) with EFBIG as a full disk
// fails it with ENOSPC, and the MEGASLIDE_FAULT_WRITE_LIMIT seam in a fresh
// process) or a file never committed leaves the old file byte-identical
// and no temporary; modes are kept (0600 stays 0600) and new files follow
// the umask; symlinks are followed; devices are written directly; and the
// checks of output files and folders name the path and the reason.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/support/AtomicFile.h"
#include "megaslide/runtime/trace/ChromeTrace.h"

#include "megaslide/Testing/HostTestSupport.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"

#include "gtest/gtest.h"

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

using namespace megaslide;
using megaslide::host::test::FileSizeLimit;

namespace {

std::string errorText(llvm::Error err) {
  return err ? llvm::toString(std::move(err)) : "";
}

template <typename T> std::string errorText(llvm::Expected<T> &value) {
  return value ? "" : llvm::toString(value.takeError());
}

class AtomicFileTest : public ::testing::Test {
protected:
  void SetUp() override {
    llvm::SmallString<128> path;
    ASSERT_FALSE(llvm::sys::fs::createUniqueDirectory("atomic-file", path));
    dir = path.str().str();
  }
  void TearDown() override { llvm::sys::fs::remove_directories(dir); }

  std::string path(llvm::StringRef name) const {
    return dir + "/" + name.str();
  }

  static void writeAll(const std::string &p, const std::string &text) {
    std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
  }
  static std::string readAll(const std::string &p) {
    std::ifstream in(p, std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  static unsigned modeOf(const std::string &p) {
    struct stat st;
    return ::stat(p.c_str(), &st) == 0 ? st.st_mode & 07777 : ~0u;
  }
  std::vector<std::string> entries() const {
    return host::test::entries(dir);
  }

  std::string dir;
};

/// Sets the process umask for the scope.
class ScopedUmask {
public:
  explicit ScopedUmask(mode_t mask) : saved(::umask(mask)) {}
  ~ScopedUmask() { ::umask(saved); }

private:
  mode_t saved;
};

TEST_F(AtomicFileTest, CommitReplacesTheWholeFile) {
  writeAll(path("out.txt"), "the user's old contents, longer than the new\n");
  auto file = AtomicFile::create(path("out.txt"));
  ASSERT_TRUE(bool(file)) << errorText(file);
  EXPECT_EQ((*file)->destination(), path("out.txt"));
  llvm::StringRef temp = (*file)->temporary();
  EXPECT_TRUE(llvm::sys::path::filename(temp).starts_with(
      ".out.txt.tmp-" + std::to_string(::getpid()) + "-"))
      << temp.str();
  EXPECT_EQ(llvm::sys::path::parent_path(temp), dir);
  (*file)->os() << "new text ";
  std::string big(3 << 20, 'x'); // larger than the stream's buffer
  ASSERT_EQ(errorText((*file)->write(big.data(), big.size())), "");
  EXPECT_EQ((*file)->bytesWritten(), 9 + big.size());
  // Nothing is replaced before commit().
  EXPECT_EQ(readAll(path("out.txt")),
            "the user's old contents, longer than the new\n");
  ASSERT_EQ(errorText((*file)->commit()), "");
  EXPECT_EQ(readAll(path("out.txt")), "new text " + big);
  file->reset();
  EXPECT_EQ(entries(), std::vector<std::string>{"out.txt"});

  ASSERT_EQ(errorText(writeFileAtomically(path("b.txt"), "contents")), "");
  ASSERT_EQ(errorText(writeFileAtomically(
                path("c.txt"), [](llvm::raw_ostream &os) { os << 42; })),
            "");
  EXPECT_EQ(readAll(path("b.txt")), "contents");
  EXPECT_EQ(readAll(path("c.txt")), "42");
  EXPECT_EQ(entries(), (std::vector<std::string>{"b.txt", "c.txt", "out.txt"}));
}

TEST_F(AtomicFileTest, UncommittedFileLeavesTheOldOneAndNoTemporary) {
  writeAll(path("keep.txt"), "old");
  {
    auto file = AtomicFile::create(path("keep.txt"));
    ASSERT_TRUE(bool(file)) << errorText(file);
    (*file)->os() << "half a new file";
    ASSERT_EQ(errorText((*file)->finish()), ""); // written, synced, not renamed
    EXPECT_EQ(entries().size(), 2u);
  }
  EXPECT_EQ(readAll(path("keep.txt")), "old");
  EXPECT_EQ(entries(), std::vector<std::string>{"keep.txt"});
}

TEST_F(AtomicFileTest, FailedWriteLeavesTheOldFileByteIdentical) {
  std::string old(10000, 'o');
  writeAll(path("plan.json"), old);
  std::string big(1 << 20, 'n');
  {
    FileSizeLimit full(4096);
    auto file = AtomicFile::create(path("plan.json"));
    ASSERT_TRUE(bool(file)) << errorText(file);
    // Buffered text fails at commit, a bulk write at once; both name the
    // file the user gave and the errno text, and are not fatal.
    (*file)->os() << big;
    std::string e = errorText((*file)->commit());
    EXPECT_EQ(e, "cannot write '" + path("plan.json") + "': File too large");
    file->reset();
    EXPECT_EQ(entries(), std::vector<std::string>{"plan.json"});

    e = errorText(writeFileAtomically(path("plan.json"), big));
    EXPECT_EQ(e, "cannot write '" + path("plan.json") + "': File too large");
    auto bulk = AtomicFile::create(path("plan.json"));
    ASSERT_TRUE(bool(bulk));
    e = errorText((*bulk)->write(big.data(), big.size()));
    EXPECT_NE(e.find("File too large"), std::string::npos) << e;
  }
  EXPECT_EQ(readAll(path("plan.json")), old);
  EXPECT_EQ(entries(), std::vector<std::string>{"plan.json"});
}

TEST_F(AtomicFileTest, FaultInjectionSeamFailsWithEnospc) {
  // The seam is read once per process, so the check runs in a fresh one:
  // the threadsafe death-test style re-executes this test in a child, which
  // runs the statement in a folder of its own, checks it, removes it and
  // exits with what it found.
  std::string style = GTEST_FLAG_GET(death_test_style);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  ASSERT_EQ(::setenv("MEGASLIDE_FAULT_WRITE_LIMIT", "100", 1), 0);
  EXPECT_EXIT(
      {
        std::string target = path("seam.txt");
        writeAll(target, "old contents"); // not through AtomicFile
        std::string chunk(60, 'x');
        int code = 0;
        // 60 bytes fit under the limit, the next 60 cross it.
        if (!errorText(writeFileAtomically(target, chunk)).empty())
          code = 2;
        else if (errorText(writeFileAtomically(target, chunk + "y")) !=
                 "cannot write '" + target + "': No space left on device")
          code = 3;
        else if (readAll(target) != chunk)
          code = 4;
        else if (entries() != std::vector<std::string>{"seam.txt"})
          code = 5;
        llvm::sys::fs::remove_directories(dir);
        std::_Exit(code);
      },
      ::testing::ExitedWithCode(0), "");
  ::unsetenv("MEGASLIDE_FAULT_WRITE_LIMIT");
  GTEST_FLAG_SET(death_test_style, style);
}

TEST_F(AtomicFileTest, ModeOfTheDestinationIsKept) {
  writeAll(path("secret"), "old");
  ASSERT_EQ(::chmod(path("secret").c_str(), 0600), 0);
  ASSERT_EQ(errorText(writeFileAtomically(path("secret"), "new")), "");
  EXPECT_EQ(modeOf(path("secret")), 0600u);
  EXPECT_EQ(readAll(path("secret")), "new");

  ASSERT_EQ(::chmod(path("secret").c_str(), 0751), 0);
  ASSERT_EQ(errorText(writeFileAtomically(path("secret"), "newer")), "");
  EXPECT_EQ(modeOf(path("secret")), 0751u);

  // A new file gets 0666 & ~umask, like any created file.
  {
    ScopedUmask mask(027);
    ASSERT_EQ(errorText(writeFileAtomically(path("fresh"), "x")), "");
  }
  EXPECT_EQ(modeOf(path("fresh")), 0640u);
  {
    ScopedUmask mask(0);
    ASSERT_EQ(errorText(writeFileAtomically(path("open"), "x")), "");
  }
  EXPECT_EQ(modeOf(path("open")), 0666u);
}

TEST_F(AtomicFileTest, SymlinkDestinationReplacesTheFileItNames) {
  ASSERT_EQ(::mkdir(path("real").c_str(), 0755), 0);
  writeAll(path("real/target.txt"), "old");
  ASSERT_EQ(::symlink("real/target.txt", path("link").c_str()), 0);
  ASSERT_EQ(errorText(writeFileAtomically(path("link"), "via link")), "");
  EXPECT_EQ(readAll(path("real/target.txt")), "via link");
  struct stat st;
  ASSERT_EQ(::lstat(path("link").c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  EXPECT_EQ(entries(), (std::vector<std::string>{"link", "real"}));

  // A dangling link: the file it names is created.
  ASSERT_EQ(::symlink("real/new.txt", path("dangling").c_str()), 0);
  ASSERT_EQ(errorText(writeFileAtomically(path("dangling"), "created")), "");
  EXPECT_EQ(readAll(path("real/new.txt")), "created");

  ASSERT_EQ(::symlink("loop", path("loop").c_str()), 0);
  EXPECT_NE(errorText(writeFileAtomically(path("loop"), "x"))
                .find("Too many levels of symbolic links"),
            std::string::npos);
}

TEST_F(AtomicFileTest, DevicesAreWrittenDirectly) {
  auto file = AtomicFile::create("/dev/null");
  ASSERT_TRUE(bool(file)) << errorText(file);
  EXPECT_TRUE((*file)->temporary().empty());
  (*file)->os() << "discarded";
  ASSERT_EQ(errorText((*file)->commit()), "");
  struct stat st;
  ASSERT_EQ(::stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));

  // /dev/full fails every write with ENOSPC: an error, not a crash.
  if (::access("/dev/full", W_OK) == 0) {
    std::string e = errorText(writeFileAtomically("/dev/full", "x"));
    EXPECT_EQ(e, "cannot write '/dev/full': No space left on device");
  }

  auto out = AtomicFile::create("-");
  ASSERT_TRUE(bool(out));
  EXPECT_TRUE((*out)->temporary().empty());
  ASSERT_EQ(errorText((*out)->commit()), "");
}

TEST_F(AtomicFileTest, CreateRefusesWhatCannotBeWritten) {
  ASSERT_EQ(::mkdir(path("sub").c_str(), 0755), 0);
  EXPECT_EQ(errorText(writeFileAtomically(path("sub"), "x")),
            "cannot write '" + path("sub") + "': Is a directory");
  EXPECT_EQ(errorText(writeFileAtomically(path("no/such/f"), "x")),
            "cannot write '" + path("no/such/f") +
                "': No such file or directory");
  writeAll(path("plain"), "x");
  EXPECT_EQ(errorText(writeFileAtomically(path("plain/f"), "x")),
            "cannot write '" + path("plain/f") + "': Not a directory");
  std::string e = errorText(writeFileAtomically("/proc/megaslide-test", "x"));
  EXPECT_NE(e.find("cannot write '/proc/megaslide-test': "), std::string::npos)
      << e;
  EXPECT_NE(e.find("'/proc' is on proc, a virtual file system"),
            std::string::npos)
      << e;
  EXPECT_EQ(entries(), (std::vector<std::string>{"plain", "sub"}));
}

TEST_F(AtomicFileTest, CheckOutputFileNamesPathAndReason) {
  EXPECT_EQ(errorText(checkOutputFile(path("new.txt"))), "");
  EXPECT_EQ(errorText(checkOutputFile("-")), "");
  EXPECT_EQ(errorText(checkOutputFile("/dev/null")), "");
  writeAll(path("old.txt"), "x");
  EXPECT_EQ(errorText(checkOutputFile(path("old.txt"))), "");
  EXPECT_EQ(entries(), std::vector<std::string>{"old.txt"}); // probe removed

  EXPECT_EQ(errorText(checkOutputFile(dir)),
            "cannot write '" + dir + "': Is a directory");
  EXPECT_EQ(errorText(checkOutputFile(path("missing/new.txt"))),
            "cannot write '" + path("missing/new.txt") +
                "': No such file or directory");
  EXPECT_EQ(errorText(checkOutputFile(path("old.txt/x"))),
            "cannot write '" + path("old.txt/x") + "': Not a directory");
  std::string e = errorText(checkOutputFile("/proc/w"));
  EXPECT_NE(e.find("cannot write '/proc/w': No such file or directory ('/proc' "
                   "is on proc, a virtual file system"),
            std::string::npos)
      << e;
  e = errorText(checkOutputFile("/sys/megaslide-test"));
  EXPECT_NE(e.find("cannot write '/sys/megaslide-test': "), std::string::npos)
      << e;
  EXPECT_NE(e.find("'/sys' is on sysfs"), std::string::npos) << e;

  if (::geteuid() != 0) {
    // Root ignores permission bits.
    ASSERT_EQ(::mkdir(path("locked").c_str(), 0500), 0);
    EXPECT_EQ(errorText(checkOutputFile(path("locked/f"))),
              "cannot write '" + path("locked/f") + "': Permission denied");
    writeAll(path("readonly.txt"), "x");
    ASSERT_EQ(::chmod(path("readonly.txt").c_str(), 0444), 0);
    EXPECT_EQ(errorText(checkOutputFile(path("readonly.txt"))),
              "cannot write '" + path("readonly.txt") + "': Permission denied");
  }
}

TEST_F(AtomicFileTest, PrepareOutputDirectoryRecordsWhatItCreated) {
  std::vector<std::string> created;
  ASSERT_EQ(errorText(prepareOutputDirectory(path("a/b/c/"), &created)), "");
  EXPECT_EQ(created,
            (std::vector<std::string>{path("a"), path("a/b"), path("a/b/c")}));
  EXPECT_TRUE(llvm::sys::fs::is_directory(path("a/b/c")));
  // Existing folders are not recorded; the probe file is gone.
  std::vector<std::string> again;
  ASSERT_EQ(errorText(prepareOutputDirectory(path("a/b"), &again)), "");
  EXPECT_TRUE(again.empty());
  EXPECT_EQ(errorText(checkOutputDirectory(path("a/b/c"))), "");
  std::error_code ec;
  EXPECT_EQ(llvm::sys::fs::directory_iterator(path("a/b/c"), ec),
            llvm::sys::fs::directory_iterator());

  // Only empty folders are removed: a/b/c holds a file now.
  writeAll(path("a/b/c/user.txt"), "x");
  removeCreatedDirectories(created);
  EXPECT_TRUE(llvm::sys::fs::exists(path("a/b/c/user.txt")));
  llvm::sys::fs::remove(path("a/b/c/user.txt"));
  removeCreatedDirectories(created);
  EXPECT_FALSE(llvm::sys::fs::exists(path("a")));
}

TEST_F(AtomicFileTest, PrepareOutputDirectoryNamesPathAndReason) {
  writeAll(path("file"), "x");
  EXPECT_EQ(errorText(checkOutputDirectory(path("file"))),
            "'" + path("file") + "' exists and is not a directory");
  EXPECT_EQ(errorText(checkOutputDirectory(path("file/sub"))),
            "cannot create directory '" + path("file/sub") +
                "': Not a directory");
  std::string e = errorText(checkOutputDirectory("/proc/megaslide-w"));
  EXPECT_NE(e.find("cannot create directory '/proc/megaslide-w': No such file "
                   "or directory ('/proc' is on proc"),
            std::string::npos)
      << e;
  e = errorText(checkOutputDirectory("/sys/megaslide-ck"));
  EXPECT_NE(e.find("cannot create directory '/sys/megaslide-ck': "),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("'/sys' is on sysfs"), std::string::npos) << e;

  // A failed call removes the folders it created: "made" is created, the
  // name inside it is too long.
  std::vector<std::string> created;
  std::string tooLong = path("made/" + std::string(300, 'n'));
  e = errorText(prepareOutputDirectory(tooLong, &created));
  EXPECT_EQ(e, "cannot create directory '" + tooLong + "': File name too long");
  EXPECT_TRUE(created.empty());
  EXPECT_FALSE(llvm::sys::fs::exists(path("made")));

  if (::geteuid() != 0) {
    ASSERT_EQ(::mkdir(path("locked").c_str(), 0500), 0);
    std::vector<std::string> none;
    EXPECT_EQ(errorText(prepareOutputDirectory(path("locked/a/b"), &none)),
              "cannot create directory '" + path("locked/a") + "' (for '" +
                  path("locked/a/b") + "'): Permission denied");
    EXPECT_TRUE(none.empty());
    ASSERT_EQ(::chmod(path("locked").c_str(), 0700), 0);
  }
}

TEST_F(AtomicFileTest, UnfinishedTraceNeverReplacesOne) {
  // A run that fails before ChromeTrace::finish() keeps the old trace.
  writeAll(path("step.trace.json"), "the user's earlier trace");
  ASSERT_EQ(::chmod(path("step.trace.json").c_str(), 0600), 0);
  {
    auto trace = trace::ChromeTrace::create(path("step.trace.json"), "p");
    ASSERT_TRUE(bool(trace)) << errorText(trace);
    (*trace)->complete(exec::Stream::DeviceToHost, "d2h", 0, 1);
  }
  EXPECT_EQ(readAll(path("step.trace.json")), "the user's earlier trace");
  EXPECT_EQ(entries(), std::vector<std::string>{"step.trace.json"});

  auto trace = trace::ChromeTrace::create(path("step.trace.json"), "p");
  ASSERT_TRUE(bool(trace)) << errorText(trace);
  (*trace)->complete(exec::Stream::DeviceToHost, "d2h", 0, 1);
  EXPECT_EQ(readAll(path("step.trace.json")), "the user's earlier trace");
  ASSERT_EQ(errorText((*trace)->finish()), "");
  std::string text = readAll(path("step.trace.json"));
  EXPECT_EQ(errorText(trace::validateChromeTrace(text)), "") << text;
  EXPECT_EQ(modeOf(path("step.trace.json")), 0600u);
  EXPECT_EQ(entries(), std::vector<std::string>{"step.trace.json"});
}

} // namespace
