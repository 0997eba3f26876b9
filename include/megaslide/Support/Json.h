//===- Json.h - Reading JSON documents of the user --------------*- C++ -*-===//

#ifndef MEGASLIDE_SUPPORT_JSON_H
#define MEGASLIDE_SUPPORT_JSON_H

#include "llvm/Support/Error.h"
#include "llvm/Support/JSON.h"

namespace megaslide {

/// Parses `text` as a JSON object; errors name `source` and say what
/// `what` (e.g. "a model config") must be.
llvm::Expected<llvm::json::Object> parseJsonObject(llvm::StringRef text,
                                                   llvm::StringRef source,
                                                   llvm::StringRef what);

} // namespace megaslide

#endif // MEGASLIDE_SUPPORT_JSON_H
