//===- Units.h - Byte quantities and durations as text ----------*- C++ -*-===//

#ifndef MEGASLIDE_SUPPORT_UNITS_H
#define MEGASLIDE_SUPPORT_UNITS_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <string>

namespace megaslide {

/// Parses "141GB", "1.5TB", "80GiB", "1.5 TiB", "512MB" or a plain byte
/// count. Decimal suffixes (KB, MB, GB, TB) are powers of 1000, binary
/// ones (KiB, MiB, GiB, TiB) powers of 1024. Zero is a valid size.
llvm::Expected<uint64_t> parseBytes(llvm::StringRef text);

/// "141.00 GB (131.32 GiB)": decimal and binary units of the magnitude's
/// rank ("67.11 MB (64.00 MiB)"), saying which is which.
std::string formatBytes(uint64_t bytes);

/// "1.234 s": seconds with three decimals, how the plan and training
/// reports spell a duration.
std::string formatSeconds(double seconds);

/// Storage bytes of one element of `type` (bf16 2, f32 4, i64 8, ...).
uint64_t elementBytes(unsigned bitWidth);

} // namespace megaslide

#endif // MEGASLIDE_SUPPORT_UNITS_H
