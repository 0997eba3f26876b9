//===- FuzzSafetensors.cpp - Fuzz target: safetensors reader --------------===//
//
// Arbitrary bytes as a .safetensors file (weights, data samples and
// checkpoints are read through SafetensorsReader). The reader works on
// paths, so the input goes to an in-memory file (memfd) opened by its
// /proc path. Every tensor the header describes is then looked up by name
// and read as fp32 (an error for dtypes other than F32/BF16/F16) and as
// raw bytes; a crash, a sanitizer report or a broken header promise
// (abort) is a bug.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/host/Safetensors.h"

#include "llvm/Support/Error.h"

#include <cstdint>
#include <cstdlib>
#include <string>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

using namespace megaslide::host;

/// The in-memory file every input is written to.
static int fileFd() {
  static int fd = memfd_create("megaslide-fuzz-safetensors", MFD_CLOEXEC);
  if (fd < 0)
    abort();
  return fd;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  int fd = fileFd();
  if (ftruncate(fd, 0) != 0 ||
      (size && pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)))
    abort();
  std::string path = "/proc/self/fd/" + std::to_string(fd);

  auto reader = SafetensorsReader::open(path);
  if (!reader) {
    llvm::consumeError(reader.takeError());
    return 0;
  }
  const SafetensorsReader &r = **reader;
  uint64_t previousEnd = 0;
  for (const StTensorInfo &info : r.tensors()) {
    // What open() checked: sizes agree, spans sorted, disjoint, in the file.
    if (info.end - info.begin !=
            static_cast<uint64_t>(info.numElements()) *
                stDTypeBytes(info.dtype) ||
        info.begin < previousEnd || r.dataStart() + info.end > r.fileSize() ||
        r.find(info.name) != &info)
      abort();
    previousEnd = info.end;

    std::vector<float> values(info.numElements());
    uint64_t rawBytes = 0;
    llvm::Error err =
        r.readF32(info, values, [&](llvm::ArrayRef<uint8_t> chunk) {
          rawBytes += chunk.size();
        });
    bool readable = info.dtype == StDType::F32 ||
                    info.dtype == StDType::BF16 || info.dtype == StDType::F16;
    if (static_cast<bool>(err) == readable)
      abort();
    llvm::consumeError(std::move(err));
    if (readable && rawBytes != info.end - info.begin)
      abort();

    uint32_t crc = 0;
    if (llvm::Error e = r.readRaw(r.dataStart() + info.begin,
                                  info.end - info.begin,
                                  [&](llvm::ArrayRef<uint8_t> chunk) {
                                    crc = crc32c(crc, chunk);
                                  }))
      abort();
  }
  // Metadata comes out of the header, which lies within the input.
  for (const auto &[key, value] : r.metadata())
    if (key.size() + value.size() > size)
      abort();
  return 0;
}
