//===- IrNesting.h - Refuse IR nested deeper than MLIR can parse -*- C++ -*-===//
//
// MLIR's parser recurses once per level of nested attributes, types and
// regions, so a file of a few thousand "[" (a fuzzer's favourite) overflows
// the stack: a crash instead of an error. The tools that parse IR check the
// nesting of (), [], {} and <> first. Header-only, used by megaslide-opt and
// megaslide-translate.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TOOLS_COMMON_IRNESTING_H
#define MEGASLIDE_TOOLS_COMMON_IRNESTING_H

#include "llvm/ADT/Twine.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/MemoryBuffer.h"

namespace megaslide::tools {

/// The deepest bracket nesting accepted. MegaSlide IR nests fewer than 20;
/// MLIR's parser overflows an 8 MiB stack somewhere above 5000.
inline constexpr unsigned kMaxIrNesting = 1000;

/// An error naming the buffer and line where brackets nest deeper than
/// kMaxIrNesting. Brackets in string literals and // comments do not
/// count; the '>' of "->" does not close anything. Closing brackets never
/// take the depth below zero, so unbalanced text errs towards acceptance
/// and the parser reports it.
inline llvm::Error checkIrNesting(const llvm::MemoryBuffer &buffer) {
  llvm::StringRef text = buffer.getBuffer();
  unsigned depth = 0, line = 1;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    switch (c) {
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
        return llvm::createStringError(
            llvm::inconvertibleErrorCode(),
            llvm::Twine(buffer.getBufferIdentifier()) + ":" +
                llvm::Twine(line) +
                ": error: brackets nest more than " +
                llvm::Twine(kMaxIrNesting) +
                " deep; MLIR's parser cannot read this (MegaSlide IR nests "
                "fewer than 20 levels)");
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
  return llvm::Error::success();
}

} // namespace megaslide::tools

#endif // MEGASLIDE_TOOLS_COMMON_IRNESTING_H
