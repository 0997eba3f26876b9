//===- Units.h - Byte quantities and durations as text ----------*- C++ -*-===//

#ifndef MEGASLIDE_SUPPORT_UNITS_H
#define MEGASLIDE_SUPPORT_UNITS_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/raw_ostream.h"

#include <cstdint>
#include <string>

namespace megaslide {

/// Parses "141GB", "1.5TB", "80GiB", "1.5 TiB", "512MB" or a plain byte
/// count. Decimal suffixes (KB, MB, GB, TB) are powers of 1000, binary
/// ones (KiB, MiB, GiB, TiB) powers of 1024. Zero is a valid size.
llvm::Expected<uint64_t> parseBytes(llvm::StringRef text);

/// A memory size as it was written ("141GB", "1.5 TiB") and its bytes: the
/// value of the size options (PipelineOptions.def, `min-bytes` of
/// megaslide-report-bytes-moved). It is parsed where the text is given
/// (llvm::cl::parser<ByteSize> below for pass and pipeline options, the
/// tools' flags, the C API), so a bad size is an error there and passes
/// read bytes. The text is kept so that printing the option (a pass
/// pipeline, the option listing, the bucket cache key) gives back what was
/// written.
class ByteSize {
public:
  /// Zero bytes: what llvm::cl parses into.
  ByteSize() = default;
  /// A size written in the source (an option's default); it must parse.
  ByteSize(const char *text);
  /// `text` as a size, or why it is not one (parseBytes).
  static llvm::Expected<ByteSize> parse(llvm::StringRef text);

  uint64_t bytes() const { return count; }
  const std::string &text() const { return spelling; }

private:
  friend class AutoByteSize; // spells "auto"
  std::string spelling = "0";
  uint64_t count = 0;
};

/// A budget (`gpu-mem`, `host-mem`): a size that must be positive.
class ByteBudget : public ByteSize {
public:
  /// Zero bytes, not a budget: what llvm::cl parses into.
  ByteBudget() = default;
  /// A budget written in the source (an option's default); it must parse.
  ByteBudget(const char *text);
  /// `text` as a budget, or why it is not one ("a budget must be
  /// positive").
  static llvm::Expected<ByteBudget> parse(llvm::StringRef text);

private:
  explicit ByteBudget(ByteSize size) : ByteSize(std::move(size)) {}
};

/// A size that may be left to the planner ("auto"): `os-allowance`, whose
/// automatic value follows the host (osAllowanceFor in PipelineOptions.h).
class AutoByteSize : public ByteSize {
public:
  /// "auto": what llvm::cl parses into.
  AutoByteSize() : AutoByteSize("auto") {}
  /// A size or "auto" written in the source; it must parse.
  AutoByteSize(const char *text);
  /// "auto", or `text` as a size (ByteSize::parse).
  static llvm::Expected<AutoByteSize> parse(llvm::StringRef text);

  bool isAuto() const { return automatic; }
  /// The size given, or `automatic` when the planner is to choose.
  uint64_t bytesOr(uint64_t automatic) const {
    return isAuto() ? automatic : bytes();
  }

private:
  explicit AutoByteSize(ByteSize size, bool automatic)
      : ByteSize(std::move(size)), automatic(automatic) {}
  bool automatic = false;
};

/// The llvm::cl parser of a size option (T is ByteSize or ByteBudget): the
/// error is T::parse's, under the option's name.
template <typename T> class ByteSizeParser : public llvm::cl::basic_parser<T> {
public:
  using llvm::cl::basic_parser<T>::basic_parser;

  bool parse(llvm::cl::Option &option, llvm::StringRef argName,
             llvm::StringRef arg, T &value) {
    llvm::Expected<T> parsed = T::parse(arg);
    if (!parsed)
      return option.error(llvm::toString(parsed.takeError()), argName);
    value = std::move(*parsed);
    return false;
  }
  llvm::StringRef getValueName() const override { return "size"; }
  void printOptionDiff(const llvm::cl::Option &option, const T &value,
                       const llvm::cl::OptionValue<T> &,
                       size_t globalWidth) const {
    this->printOptionName(option, globalWidth);
    llvm::outs() << "= " << value.text() << "\n";
  }
  /// The value as option text: braced when it holds a space, as a pass
  /// pipeline needs it ("gpu-mem={1.5 TB}").
  static void print(llvm::raw_ostream &os, const T &value) {
    llvm::StringRef text = value.text();
    if (text.contains(' '))
      os << "{" << text << "}";
    else
      os << text;
  }
};

/// "141.00 GB (131.32 GiB)": decimal and binary units of the magnitude's
/// rank ("67.11 MB (64.00 MiB)"), saying which is which.
std::string formatBytes(uint64_t bytes);

/// "1.234 s": seconds with three decimals, how the plan and training
/// reports spell a duration.
std::string formatSeconds(double seconds);

/// Storage bytes of one element of `type` (bf16 2, f32 4, i64 8, ...).
uint64_t elementBytes(unsigned bitWidth);

} // namespace megaslide

namespace llvm::cl {
template <>
class parser<megaslide::ByteSize>
    : public megaslide::ByteSizeParser<megaslide::ByteSize> {
public:
  using ByteSizeParser::ByteSizeParser;
};
template <>
class parser<megaslide::ByteBudget>
    : public megaslide::ByteSizeParser<megaslide::ByteBudget> {
public:
  using ByteSizeParser::ByteSizeParser;
};
template <>
class parser<megaslide::AutoByteSize>
    : public megaslide::ByteSizeParser<megaslide::AutoByteSize> {
public:
  using ByteSizeParser::ByteSizeParser;
};
} // namespace llvm::cl

#endif // MEGASLIDE_SUPPORT_UNITS_H
