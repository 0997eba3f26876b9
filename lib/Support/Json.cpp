//===- Json.cpp - Reading JSON documents of the user ----------------------===//

#include "megaslide/Support/Json.h"

using namespace megaslide;

llvm::Expected<llvm::json::Object>
megaslide::parseJsonObject(llvm::StringRef text, llvm::StringRef source,
                           llvm::StringRef what) {
  llvm::Expected<llvm::json::Value> parsed = llvm::json::parse(text);
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
