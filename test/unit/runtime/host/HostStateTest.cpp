//===- HostStateTest.cpp - Host memory a run may use ----------------------===//
//
// host/HostState (runtime): the host memory a run may use, from the
// machine's readings (hot-plugged memory blocks, a container's limit, the
// override and its parse errors), and this machine's readings.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/host/HostState.h"

#include "gtest/gtest.h"

#include <string>
#include <utility>

using namespace megaslide::host;

namespace {

TEST(HostMemory, WhatARunMayUse) {
  constexpr uint64_t GiB = 1ull << 30;
  auto usable = [](HostMemoryReadings r) {
    llvm::Expected<uint64_t> bytes = usableHostMemoryBytes(r);
    return bytes ? *bytes : (llvm::consumeError(bytes.takeError()), 0);
  };
  HostMemoryReadings plain;
  plain.physicalBytes = 24 * GiB;
  EXPECT_EQ(usable(plain), 24 * GiB);
  // A VM whose memory is hot-plugged as it is used: few blocks online.
  HostMemoryReadings growing;
  growing.physicalBytes = 8 * GiB;
  growing.blockBytes = 128 * GiB;
  EXPECT_EQ(usable(growing), 128 * GiB);
  // A container's limit caps what the machine has, and no more.
  HostMemoryReadings container;
  container.physicalBytes = 24 * GiB;
  container.cgroupLimit = 4 * GiB;
  EXPECT_EQ(usable(container), 4 * GiB);
  container.cgroupLimit = 128 * GiB;
  EXPECT_EQ(usable(container), 24 * GiB);
  for (auto [text, bytes] : {std::pair<const char *, uint64_t>{"1000", 1000},
                             {"128GiB", 128 * GiB},
                             {"1.5TB", 1500000000000ull},
                             {" 2 TiB ", 2048 * GiB},
                             {"64 GB", 64000000000ull},
                             {"0", 0},
                             {"lots", 0},
                             {"GiB", 0},
                             {"99999999999999TiB", 0}}) {
    SCOPED_TRACE(text);
    HostMemoryReadings given;
    given.physicalBytes = 24 * GiB;
    given.cgroupLimit = 128 * GiB;
    given.override = std::string(text);
    llvm::Expected<uint64_t> got = usableHostMemoryBytes(given);
    if (bytes) {
      ASSERT_TRUE(!!got) << llvm::toString(got.takeError());
      EXPECT_EQ(*got, bytes);
    } else {
      ASSERT_FALSE(!!got);
      EXPECT_NE(llvm::toString(got.takeError()).find("is not a size"),
                std::string::npos);
    }
  }
}

TEST(HostMemory, ThisMachineHasSome) {
  HostMemoryReadings r = readHostMemory();
  EXPECT_GT(r.physicalBytes, 0u);
  if (r.blockBytes) { // the online blocks hold MemTotal and more
    EXPECT_GE(*r.blockBytes, r.physicalBytes / 2);
  }
}

} // namespace
