//===- Safetensors.h - Reading and writing .safetensors files ---*- C++ -*-===//
//
// The safetensors format (huggingface/safetensors): an 8-byte little-endian
// header length N, N bytes of JSON {name: {"dtype", "shape",
// "data_offsets": [begin, end]}, "__metadata__": {string: string}}, then the
// tensor bytes, offsets relative to the end of the header. It is how
// diffusers stores weights and how MegaSlide stores checkpoints.
//
// Files are untrusted input: the reader checks every structural invariant
// before any tensor is read and reads tensor bytes with pread, so a
// multi-GB file is neither loaded nor mapped as a whole, and a file that
// shrinks while being read gives an error, not a crash. Errors name the
// file and the tensor or field at fault.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_HOST_SAFETENSORS_H
#define MEGASLIDE_RUNTIME_HOST_SAFETENSORS_H

#include "megaslide/runtime/cpu/HalfFloat.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/ADT/StringMap.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace megaslide {
class AtomicFile;
} // namespace megaslide

namespace megaslide::host {

/// The element types of the safetensors format. Every one can be described
/// by a file; F32, BF16 and F16 can be read as fp32 and F32 and BF16 written.
enum class StDType : uint8_t {
  Bool,
  U8,
  I8,
  F8E5M2,
  F8E4M3,
  I16,
  U16,
  F16,
  BF16,
  I32,
  U32,
  F32,
  F64,
  I64,
  U64,
};

/// The format's spelling ("F32", "BF16", ...).
const char *stDTypeName(StDType dtype);
std::optional<StDType> parseStDType(llvm::StringRef name);
int64_t stDTypeBytes(StDType dtype);

/// One tensor described by a header.
struct StTensorInfo {
  std::string name;
  StDType dtype = StDType::F32;
  std::vector<int64_t> shape;
  /// Byte range [begin, end) relative to the start of the data section.
  uint64_t begin = 0, end = 0;
  int64_t numElements() const;
};

/// Limits of a header the reader accepts (docs/Runtime.md, "Limits on
/// input files"),
/// checked before the header is parsed, so a hostile header is refused at
/// the cost of reading it once: parsed, a header costs some 60 times its
/// size in memory. A diffusers shard lists 1-2 thousand tensors, the
/// checkpoint of the 105B model about 4 thousand, of a 1024-layer Wan
/// model about 84 thousand (some 11 MB of header).
/// The reference implementation allows 100 MB.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 64ull << 20;
/// Tensors listed by one header (__metadata__ not counted).
inline constexpr uint64_t kMaxSafetensorsTensors = 200'000;
/// JSON values in one header: a tensor of rank 5 takes 15. Bounds the
/// memory of parsing a header of tiny values (a 64 MiB `[0,0,...]` shape).
inline constexpr uint64_t kMaxSafetensorsHeaderValues = 4'000'000;

/// The header of a safetensors file, checked; tensor data is read on demand.
class SafetensorsReader {
public:
  /// Opens `path`, which must be a regular file (a FIFO or device is
  /// refused without blocking), and validates its header against the file
  /// size: header length within the file and the limits above, valid
  /// UTF-8 JSON object, known dtypes, non-negative shapes, shape x dtype
  /// size equal to the data_offsets span, spans inside the data section
  /// and not overlapping, no duplicate names, __metadata__ a map of
  /// strings.
  static llvm::Expected<std::unique_ptr<SafetensorsReader>>
  open(llvm::StringRef path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader &) = delete;
  SafetensorsReader &operator=(const SafetensorsReader &) = delete;

  llvm::StringRef path() const { return filePath; }
  uint64_t fileSize() const { return size; }
  /// Bytes before the data section (8 + header length).
  uint64_t dataStart() const { return dataOffset; }

  /// Tensors in data order (ascending begin offset).
  llvm::ArrayRef<StTensorInfo> tensors() const { return entries; }
  const StTensorInfo *find(llvm::StringRef name) const;
  const std::map<std::string, std::string> &metadata() const { return meta; }

  /// Reads tensor `info` of this file converted to fp32 (F32, BF16 or F16;
  /// other dtypes are an error naming the tensor). `out` must hold exactly
  /// info.numElements() values. `onRaw`, when given, sees the tensor's
  /// bytes as stored, in order (e.g. to checksum the file while loading).
  llvm::Error readF32(
      const StTensorInfo &info, llvm::MutableArrayRef<float> out,
      llvm::function_ref<void(llvm::ArrayRef<uint8_t>)> onRaw = nullptr) const;

  /// Reads `length` raw bytes at absolute file offset `offset`, passing
  /// them to `onRaw` in chunks.
  llvm::Error
  readRaw(uint64_t offset, uint64_t length,
          llvm::function_ref<void(llvm::ArrayRef<uint8_t>)> onRaw) const;

private:
  SafetensorsReader() = default;
  llvm::Error readExact(uint64_t offset, llvm::MutableArrayRef<uint8_t> buf,
                        llvm::StringRef what) const;

  std::string filePath;
  int fd = -1;
  uint64_t size = 0;
  uint64_t dataOffset = 0;
  std::vector<StTensorInfo> entries;
  llvm::StringMap<size_t> byName;
  std::map<std::string, std::string> meta;
};

/// A tensor to write: fp32 values in host memory, stored as `dtype` (F32 or
/// BF16, rounded to nearest even).
struct StTensorToWrite {
  std::string name;
  std::vector<int64_t> shape;
  const float *data = nullptr; ///< shape's product of values
  StDType dtype = StDType::F32;
  /// Instead of `data`: values already in bf16 (dtype BF16), written as
  /// they are.
  const uint16_t *bf16 = nullptr;
  /// Instead of either: fp32 values produced a range of elements at a time
  /// (a tensor in the NVMe tier), in `dtype`; an error stops the write.
  std::function<llvm::Error(int64_t begin, int64_t end, float *dst)> source =
      nullptr;
  /// Instead of `data`: bytes (dtype U8, e.g. 8-bit optimizer codes),
  /// written as they are.
  const uint8_t *u8 = nullptr;
};

struct SafetensorsWriteOptions {
  std::map<std::string, std::string> metadata;
  /// Kept for its callers: every file is now fsynced before it replaces
  /// its destination (support/AtomicFile.h).
  bool sync = false;
  /// When set, receives the CRC-32C of every byte of the file, computed
  /// while writing, so checkpoints need not read their files back.
  uint32_t *crc32c = nullptr;
};

/// Writes `tensors` to `path` in the given order, contiguous and with the
/// header padded to 8 bytes, as the reference implementation does, so
/// Python's safetensors reads the file. Names must be unique, non-empty and
/// not "__metadata__"; they are checked before anything is created. The
/// file is written atomically (support/AtomicFile.h): on any error `path`
/// is as it was, and the error names it.
llvm::Error writeSafetensors(llvm::StringRef path,
                             llvm::ArrayRef<StTensorToWrite> tensors,
                             const SafetensorsWriteOptions &options = {});
/// The same into an open `file`, which the caller commits (to replace a set
/// of files only once all of them are written).
llvm::Error writeSafetensors(AtomicFile &file,
                             llvm::ArrayRef<StTensorToWrite> tensors,
                             const SafetensorsWriteOptions &options = {});

/// Writes `contents` to `path` atomically (writeFileAtomically): on error
/// `path` is as it was. `sync` is kept for its callers: the file is always
/// fsynced before it replaces `path`.
llvm::Error writeFile(llvm::StringRef path, llvm::StringRef contents,
                      bool sync);

/// fsyncs directory `path`, making entries created or renamed in it durable.
llvm::Error syncDirectory(llvm::StringRef path);

/// The exact fp32 value of an IEEE binary16 bit pattern.
using cpu::halfToFloat;

/// CRC-32C (Castagnoli, as iSCSI and ext4 use it), incrementally:
/// crc = crc32c(crc32c(0, a), b) is the CRC of a followed by b. Uses the
/// SSE4.2 instruction where the CPU has it.
uint32_t crc32c(uint32_t crc, llvm::ArrayRef<uint8_t> data);

} // namespace megaslide::host

#endif // MEGASLIDE_RUNTIME_HOST_SAFETENSORS_H
