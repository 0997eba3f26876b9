//===- ReadFileTest.cpp - Bounded reads of regular files ------------------===//
//
// support/ReadFile (runtime): readers open regular files only (FIFOs,
// devices and directories are refused without opening them, by
// openRegularFile, readBoundedFile and the safetensors reader alike), and
// whole-file reads stay within their bound, /proc files included.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Testing/HostTestSupport.h"

#include "megaslide/runtime/host/Safetensors.h"
#include "megaslide/runtime/support/ReadFile.h"

#include "gtest/gtest.h"

#include <sys/stat.h>
#include <unistd.h>

using namespace megaslide;
using namespace megaslide::host;
using namespace megaslide::host::test;
using llvm::StringRef;

namespace {

class ReadFileTest : public ScratchDirTest {};

TEST_F(ReadFileTest, ReadBoundedFileReadsRegularFilesWithinTheBound) {
  writeAll(path("f"), "hello");
  llvm::Expected<std::string> text = readBoundedFile(path("f"), 5, "greeting");
  ASSERT_TRUE(!!text) << llvm::toString(text.takeError());
  EXPECT_EQ(*text, "hello");

  EXPECT_EQ(errorText(readBoundedFile(path("f"), 4, "greeting").takeError()),
            "cannot read greeting '" + path("f") +
                "': it is 5 bytes, over the limit of 4 bytes");
  // Refused by its size: 1 GiB is never read (nor stored: sparse).
  writeSparse(path("big"), "x", uint64_t(1) << 30);
  EXPECT_EQ(errorText(readBoundedFile(path("big"), 4096, "").takeError()),
            "cannot read '" + path("big") +
                "': it is 1073741824 bytes, over the limit of 4096 bytes");
  // stat says 0 bytes for /proc files: the bound holds all the same.
  text = readBoundedFile("/proc/self/status", 1 << 20, "");
  ASSERT_TRUE(!!text) << llvm::toString(text.takeError());
  EXPECT_NE(text->find("Name:"), std::string::npos);
  EXPECT_EQ(errorText(readBoundedFile("/proc/self/status", 8, "").takeError()),
            "cannot read '/proc/self/status': it holds more than 8 bytes, "
            "over the limit of 8 bytes");
  EXPECT_EQ(errorText(readBoundedFile(path("absent"), 8, "x").takeError()),
            "cannot read x '" + path("absent") +
                "': No such file or directory");
}

TEST_F(ReadFileTest, ReadersRefuseFifosDevicesAndDirectories) {
  std::string fifo = path("x.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(::symlink("/dev/zero", path("zero").c_str()), 0);
  FifoWatch watch(fifo);
  uint64_t size;
  struct Case {
    std::string path, kind;
  };
  for (const Case &c :
       {Case{fifo, "a FIFO (named pipe)"},
        Case{"/dev/zero", "a character device"},
        Case{path("zero"), "a character device"}, Case{dir, "a directory"}}) {
    std::string notRegular = "': it is " + c.kind + ", not a regular file";
    EXPECT_EQ(errorText(readBoundedFile(c.path, 1 << 20, "").takeError()),
              "cannot read '" + c.path + notRegular);
    EXPECT_EQ(errorText(openRegularFile(c.path, "data", size).takeError()),
              "cannot open data '" + c.path + notRegular);
    EXPECT_EQ(errorText(SafetensorsReader::open(c.path).takeError()),
              "cannot open '" + c.path + notRegular);
  }
  EXPECT_FALSE(watch.openedByReader()) << "a reader opened the FIFO";
}

} // namespace
