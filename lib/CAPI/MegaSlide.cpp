//===- MegaSlide.cpp - C API of the MegaSlide compiler --------------------===//

#include "megaslide/CAPI/MegaSlide.h"

#include "megaslide/Model/ModelInfo.h"
#include "megaslide/Version.h"

#include "mlir/IR/MLIRContext.h"
#include "llvm/Support/FormatVariadic.h"

#include <cstdlib>
#include <cstring>

using namespace megaslide;

static char *copyString(const std::string &s) {
  char *out = static_cast<char *>(std::malloc(s.size() + 1));
  std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

int megaslideModelInfoJson(const char *model, int64_t frames, int64_t height,
                           int64_t width, int latentUnits, int64_t batch,
                           int64_t textLen, char **json, char **error) {
  TrainingOptions options;
  options.batch = batch;
  if (textLen != 0)
    options.textLen = textLen;
  VideoShape video{frames, height, width, latentUnits != 0};
  mlir::MLIRContext context(mlir::MLIRContext::Threading::DISABLED);
  llvm::Expected<ModelInfo> info =
      computeModelInfo(context, model ? model : "", video, options);
  if (!info) {
    *error = copyString(llvm::toString(info.takeError()));
    return 1;
  }
  *json = copyString(llvm::formatv("{0}", toJson(*info)).str());
  return 0;
}

void megaslideFreeString(char *str) { std::free(str); }

const char *megaslideVersion(void) { return MEGASLIDE_VERSION; }
