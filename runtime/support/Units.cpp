//===- Units.cpp - Byte quantities and durations as text ------------------===//

#include "megaslide/Support/Units.h"

#include "llvm/ADT/StringSwitch.h"
#include "llvm/Support/FormatVariadic.h"

#include <cmath>

using namespace megaslide;

llvm::Expected<uint64_t> megaslide::parseBytes(llvm::StringRef text) {
  llvm::StringRef trimmed = text.trim();
  size_t split = trimmed.find_first_not_of("0123456789.eE+");
  llvm::StringRef number = trimmed.substr(0, split);
  llvm::StringRef unit =
      split == llvm::StringRef::npos ? "" : trimmed.substr(split).trim();
  double value = 0;
  double scale = llvm::StringSwitch<double>(unit)
                     .Cases({"", "B"}, 1.0)
                     .Case("KB", 1e3)
                     .Case("MB", 1e6)
                     .Case("GB", 1e9)
                     .Case("TB", 1e12)
                     .Case("KiB", 1024.0)
                     .Case("MiB", 1024.0 * 1024)
                     .Case("GiB", 1024.0 * 1024 * 1024)
                     .Case("TiB", 1024.0 * 1024 * 1024 * 1024)
                     .Default(0);
  if (number.empty() || number.getAsDouble(value) || scale == 0 ||
      !std::isfinite(value) || value < 0)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "'%s' is not a memory size; write e.g. 141GB, 1.5TB (decimal) or "
        "80GiB, 1.5TiB (binary)",
        text.str().c_str());
  // Byte counts are added and compared as int64 elsewhere; beyond 2^63 the
  // conversion below would not even be defined.
  double bytes = std::round(value * scale);
  if (bytes >= 0x1p63)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "'%s' is too large: a memory size must be below 2^63 bytes (about "
        "9223372 TB)",
        text.str().c_str());
  return static_cast<uint64_t>(bytes);
}

ByteSize::ByteSize(const char *text) : ByteSize(llvm::cantFail(parse(text))) {}

llvm::Expected<ByteSize> ByteSize::parse(llvm::StringRef text) {
  llvm::Expected<uint64_t> bytes = parseBytes(text);
  if (!bytes)
    return bytes.takeError();
  ByteSize size;
  size.spelling = text.str();
  size.count = *bytes;
  return size;
}

ByteBudget::ByteBudget(const char *text)
    : ByteBudget(llvm::cantFail(parse(text))) {}

llvm::Expected<ByteBudget> ByteBudget::parse(llvm::StringRef text) {
  llvm::Expected<ByteSize> size = ByteSize::parse(text);
  if (!size)
    return size.takeError();
  if (size->bytes() == 0)
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "a budget must be positive");
  return ByteBudget(std::move(*size));
}

AutoByteSize::AutoByteSize(const char *text)
    : AutoByteSize(llvm::cantFail(parse(text))) {}

llvm::Expected<AutoByteSize> AutoByteSize::parse(llvm::StringRef text) {
  if (text == "auto") {
    // Zero bytes under the text "auto", which printing gives back.
    ByteSize none;
    none.spelling = "auto";
    return AutoByteSize(std::move(none), true);
  }
  llvm::Expected<ByteSize> size = ByteSize::parse(text);
  if (!size)
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   llvm::toString(size.takeError()) +
                                       " (or 'auto')");
  return AutoByteSize(std::move(*size), false);
}

std::string megaslide::formatBytes(uint64_t bytes) {
  // The largest unit that keeps the number at least 1, decimal and binary
  // of the same rank, so small plans do not read "0.00 GB".
  static const char *decimal[] = {"B", "KB", "MB", "GB", "TB"};
  static const char *binary[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int rank = 0;
  while (rank < 4 && bytes >= std::pow(1000.0, rank + 1))
    ++rank;
  if (rank == 0)
    return llvm::formatv("{0} B", bytes).str();
  return llvm::formatv("{0:F2} {1} ({2:F2} {3})",
                       bytes / std::pow(1000.0, rank), decimal[rank],
                       bytes / std::pow(1024.0, rank), binary[rank])
      .str();
}

std::string megaslide::formatSeconds(double seconds) {
  return llvm::formatv("{0:F3} s", seconds).str();
}

uint64_t megaslide::elementBytes(unsigned bitWidth) {
  return (bitWidth + 7) / 8;
}
