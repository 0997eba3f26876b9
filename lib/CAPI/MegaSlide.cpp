//===- MegaSlide.cpp - C API of the MegaSlide compiler --------------------===//

#include "megaslide/CAPI/MegaSlide.h"

#include "megaslide/Model/ModelInfo.h"
#include "megaslide/Pipelines/Plan.h"
#include "megaslide/Target/ExecPlan/ExportExecPlan.h"
#include "megaslide/Support/Json.h"
#include "megaslide/Version.h"

#include "mlir/IR/MLIRContext.h"
#include "llvm/ADT/StringSwitch.h"
#include "llvm/Support/FormatVariadic.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

using namespace megaslide;

static char *copyString(const std::string &s) {
  char *out = static_cast<char *>(std::malloc(s.size() + 1));
  std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

/// The C API's `batch` and `text_len` (0: the config's) as options.
static TrainingOptions trainingOptions(int64_t batch, int64_t textLen) {
  TrainingOptions options;
  options.batch = batch;
  if (textLen != 0)
    options.textLen = textLen;
  return options;
}

int megaslideModelInfoJson(const char *model, int64_t frames, int64_t height,
                           int64_t width, int latentUnits, int64_t batch,
                           int64_t textLen, char **json, char **error) {
  TrainingOptions options = trainingOptions(batch, textLen);
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

/// Reads the plan options object; unknown keys are errors naming the key.
/// `training` receives the training keys (lr, weight_decay) when given.
static llvm::Expected<PlanOptions>
parsePlanOptions(const char *text, TrainingOptions *training = nullptr) {
  PlanOptions options;
  if (!text || !*text)
    return options;
  llvm::Expected<llvm::json::Object> obj =
      parseJsonObject(text, "plan options", "the plan options");
  if (!obj)
    return obj.takeError();
  for (const auto &[key, value] : *obj) {
    std::string *text =
        llvm::StringSwitch<std::string *>(key)
            .Case("gpu_mem", &options.gpuMemory)
            .Case("gpu_reserve", &options.gpuReserve)
            .Case("host_mem", &options.hostMemory)
            .Case("os_allowance", &options.osAllowance)
            .Case("hw", &options.hardwarePath)
            .Case("activation_policy", &options.activationPolicy)
            .Case("host_state_policy", &options.hostStatePolicy)
            .Case("attention", &options.attention)
            .Case("precision", &options.precision)
            .Default(nullptr);
    int64_t *number = llvm::StringSwitch<int64_t *>(key)
                          .Case("buffers", &options.buffers)
                          .Case("prefetch_distance", &options.prefetchDistance)
                          .Case("dsa_radius", &options.dsaRadius)
                          .Default(nullptr);
    std::vector<int64_t> *triple =
        llvm::StringSwitch<std::vector<int64_t> *>(key)
            .Case("dsa_window", &options.dsaWindow)
            .Case("dsa_tile", &options.dsaTile)
            .Default(nullptr);
    double *real = nullptr;
    if (training)
      real = llvm::StringSwitch<double *>(key)
                 .Case("lr", &training->learningRate)
                 .Case("weight_decay", &training->weightDecay)
                 .Default(nullptr);
    if (real) {
      std::optional<double> number = value.getAsNumber();
      if (!number || !(*number >= 0) || !std::isfinite(*number))
        return llvm::createStringError(
            llvm::inconvertibleErrorCode(),
            "plan option '%s': expected a non-negative number",
            key.str().c_str());
      *real = *number;
    } else if (triple) {
      const llvm::json::Array *list = value.getAsArray();
      if (!list)
        return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                       "plan option '%s': expected a list",
                                       key.str().c_str());
      for (const llvm::json::Value &v : *list) {
        if (!v.getAsInteger())
          return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                         "plan option '%s': expected integers",
                                         key.str().c_str());
        triple->push_back(*v.getAsInteger());
      }
    } else if (text && value.getAsString()) {
      *text = value.getAsString()->str();
    } else if (number && value.getAsInteger()) {
      *number = *value.getAsInteger();
    } else {
      return llvm::createStringError(
          llvm::inconvertibleErrorCode(), "plan option '%s': %s",
          key.str().c_str(),
          text || number ? (text ? "expected a string" : "expected an integer")
                         : "unknown option");
    }
  }
  return options;
}

int megaslidePlanJson(const char *model, int64_t frames, int64_t height,
                      int64_t width, int latentUnits, int64_t batch,
                      int64_t textLen, const char *optionsJson, char **json,
                      char **error) {
  llvm::Expected<PlanOptions> options = parsePlanOptions(optionsJson);
  if (!options) {
    *error = copyString(llvm::toString(options.takeError()));
    return 1;
  }
  TrainingOptions training = trainingOptions(batch, textLen);
  VideoShape video{frames, height, width, latentUnits != 0};
  mlir::MLIRContext context(mlir::MLIRContext::Threading::DISABLED);
  llvm::Expected<PlanResult> plan =
      planModel(context, model ? model : "", video, training, *options);
  if (!plan) {
    *error = copyString(llvm::toString(plan.takeError()));
    return 1;
  }
  *json = copyString(llvm::formatv("{0}", toJson(*plan)).str());
  return 0;
}

int megaslideExecPlanJson(const char *model, int64_t frames, int64_t height,
                          int64_t width, int latentUnits, int64_t batch,
                          int64_t textLen, const char *optionsJson,
                          char **json, char **error) {
  TrainingOptions training = trainingOptions(batch, textLen);
  llvm::Expected<PlanOptions> options =
      parsePlanOptions(optionsJson, &training);
  if (!options) {
    *error = copyString(llvm::toString(options.takeError()));
    return 1;
  }
  VideoShape video{frames, height, width, latentUnits != 0};
  mlir::MLIRContext context(mlir::MLIRContext::Threading::DISABLED);
  bool overBudget = false;
  llvm::Expected<exec::ExecPlan> plan = compileExecPlan(
      context, model ? model : "", video, training, *options, &overBudget);
  if (!plan) {
    *error = copyString(llvm::toString(plan.takeError()));
    return overBudget ? 3 : 1;
  }
  *json = copyString(exec::serialize(*plan));
  return 0;
}

void megaslideFreeString(char *str) { std::free(str); }

const char *megaslideVersion(void) { return MEGASLIDE_VERSION; }
