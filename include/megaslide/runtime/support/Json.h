//===- Json.h - Parsing JSON documents of the user --------------*- C++ -*-===//
//
// llvm::json::parse recurses once per level of nesting, and so does the
// destructor of the value it returns: a document of "[[[[..." some ten
// thousand levels deep overflows the stack (a crash, not an error). The
// JSON the runtime reads from the user (safetensors headers, checkpoint
// manifests, weight indexes, hardware descriptions, trainer state) goes
// through parseJson, which refuses such nesting before parsing; so do the
// compiler's (model configs, C API plan options), through parseJsonObject.
// Header-only: no library dependency beyond LLVM Support.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_SUPPORT_JSON_H
#define MEGASLIDE_RUNTIME_SUPPORT_JSON_H

#include "llvm/Support/JSON.h"

namespace megaslide {

/// The deepest nesting of arrays and objects accepted. Our documents nest
/// at most five deep; 256 levels of recursion stay far below any stack.
inline constexpr unsigned kMaxJsonDepth = 256;

/// A parse error ("[line:column, byte=N]: ...", like llvm::json's own) if
/// arrays and objects in `text` nest deeper than kMaxJsonDepth.
inline llvm::Error checkJsonNesting(llvm::StringRef text) {
  unsigned depth = 0, line = 1;
  size_t lineStart = 0;
  bool inString = false;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (c == '\n') {
      ++line;
      lineStart = i + 1;
    }
    if (inString) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        inString = false;
    } else if (c == '"') {
      inString = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth)
        return llvm::make_error<llvm::json::ParseError>(
            "arrays and objects nested more than 256 levels deep", line,
            static_cast<unsigned>(i - lineStart), static_cast<unsigned>(i));
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  static_assert(kMaxJsonDepth == 256, "update the message above");
  return llvm::Error::success();
}

/// llvm::json::parse, refusing documents nested deeper than kMaxJsonDepth.
inline llvm::Expected<llvm::json::Value> parseJson(llvm::StringRef text) {
  if (llvm::Error e = checkJsonNesting(text))
    return std::move(e);
  return llvm::json::parse(text);
}

/// parseJson of a document that must be an object; errors name `source`
/// and say what `what` (e.g. "a model config") must be.
inline llvm::Expected<llvm::json::Object>
parseJsonObject(llvm::StringRef text, llvm::StringRef source,
                llvm::StringRef what) {
  llvm::Expected<llvm::json::Value> parsed = parseJson(text);
  if (!parsed)
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "%s: invalid JSON: %s", source.str().c_str(),
                                   llvm::toString(parsed.takeError()).c_str());
  llvm::json::Object *obj = parsed->getAsObject();
  if (!obj)
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "%s: %s must be a JSON object",
                                   source.str().c_str(), what.str().c_str());
  return std::move(*obj);
}

} // namespace megaslide

#endif // MEGASLIDE_RUNTIME_SUPPORT_JSON_H
