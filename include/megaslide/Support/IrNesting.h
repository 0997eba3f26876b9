//===- IrNesting.h - IR nested deeper than MLIR can parse -------*- C++ -*-===//
//
// MLIR's parser recurses once per level of nested attributes, types and
// regions, so a text of a few thousand "[" (a fuzzer's favourite) overflows
// the stack: a crash instead of an error. Everything that parses IR from a
// user (megaslide-opt, megaslide-translate, the C API and so Python) checks
// the nesting of (), [], {} and <> first. Header-only, LLVM Support only.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_SUPPORT_IRNESTING_H
#define MEGASLIDE_SUPPORT_IRNESTING_H

#include "llvm/ADT/StringRef.h"

#include <optional>

namespace megaslide {

/// The deepest bracket nesting accepted. MegaSlide IR nests fewer than 20
/// levels; MLIR's parser overflows an 8 MiB stack somewhere above 5000.
inline constexpr unsigned kMaxIrNesting = 1000;

/// What to say about it, after "<file>:<line>: error: ".
inline constexpr const char *kIrNestingMessage =
    "brackets nest more than 1000 deep; MLIR's parser cannot read this "
    "(MegaSlide IR nests fewer than 20 levels)";

/// The 1-based line on which brackets in `text` first nest deeper than
/// kMaxIrNesting, if they do. Brackets in string literals and // comments
/// do not count, nor does the '>' of "->"; closing brackets never take the
/// depth below zero, so unbalanced text errs towards acceptance and the
/// parser reports it.
inline std::optional<unsigned> findDeepIrNesting(llvm::StringRef text) {
  static_assert(kMaxIrNesting == 1000, "update kIrNestingMessage");
  unsigned depth = 0, line = 1;
  for (size_t i = 0; i < text.size(); ++i) {
    switch (text[i]) {
    case '\n':
      ++line;
      break;
    case '"':
      for (++i; i < text.size() && text[i] != '"'; ++i) {
        if (text[i] == '\n') { // unterminated: the parser will say so
          --i;
          break;
        }
        if (text[i] == '\\')
          ++i;
      }
      break;
    case '/':
      if (i + 1 < text.size() && text[i + 1] == '/')
        while (i + 1 < text.size() && text[i + 1] != '\n')
          ++i;
      break;
    case '(':
    case '[':
    case '{':
    case '<':
      if (++depth > kMaxIrNesting)
        return line;
      break;
    case '>':
      if (i > 0 && text[i - 1] == '-')
        break;
      [[fallthrough]];
    case ')':
    case ']':
    case '}':
      if (depth > 0)
        --depth;
      break;
    default:
      break;
    }
  }
  return std::nullopt;
}

} // namespace megaslide

#endif // MEGASLIDE_SUPPORT_IRNESTING_H
