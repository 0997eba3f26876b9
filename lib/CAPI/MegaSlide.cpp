//===- MegaSlide.cpp - C API of the MegaSlide compiler --------------------===//

#include "megaslide/CAPI/MegaSlide.h"

#include "dialects/Graph/GraphOps.h"
#include "dialects/Schedule/ScheduleOps.h"
#include "megaslide/Analysis/DeviceBuffers.h"
#include "megaslide/Model/ModelBuilder.h"
#include "megaslide/Model/ModelInfo.h"
#include "megaslide/Pipelines/CompileExecPlan.h"
#include "megaslide/Pipelines/Pipelines.h"
#include "megaslide/Pipelines/Plan.h"
#include "megaslide/Support/IrNesting.h"
#include "megaslide/Target/Cuda/DsaKernels.h"
#include "megaslide/Transforms/Passes.h"
#include "megaslide/Version.h"
#include "megaslide/runtime/plan/ExecPlanJson.h"
#include "megaslide/runtime/plan/HyperParameters.h"
#include "megaslide/runtime/support/Json.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Pass/PassManager.h"
#include "mlir/Pass/PassRegistry.h"
#include "mlir/Transforms/Passes.h"
#include "llvm/ADT/StringSwitch.h"
#include "llvm/Support/FormatVariadic.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>

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

namespace {

llvm::Error planOptionError(llvm::StringRef key, llvm::StringRef problem) {
  return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                 "plan option '%s': %s", key.str().c_str(),
                                 problem.str().c_str());
}

/// Sets a planning option from its JSON value.
template <typename T>
llvm::Error readPlanningOption(const OptionInfo &info, llvm::StringRef key,
                               const llvm::json::Value &value, T &field) {
  if constexpr (std::is_enum_v<T>) {
    std::optional<llvm::StringRef> text = value.getAsString();
    if (!text)
      return planOptionError(key, "expected a string");
    std::optional<T> parsed = parseOptionEnum<T>(*text);
    if (!parsed)
      return llvm::createStringError(
          llvm::inconvertibleErrorCode(), "option '%s': %s",
          info.name.str().c_str(), unknownOptionValue<T>(*text).c_str());
    field = *parsed;
  } else if constexpr (std::is_base_of_v<ByteSize, T>) {
    std::optional<llvm::StringRef> text = value.getAsString();
    if (!text)
      return planOptionError(key, "expected a string");
    llvm::Expected<T> parsed = T::parse(*text);
    if (!parsed)
      return llvm::createStringError(
          llvm::inconvertibleErrorCode(), "option '%s': %s",
          info.name.str().c_str(), llvm::toString(parsed.takeError()).c_str());
    field = std::move(*parsed);
  } else if constexpr (std::is_same_v<T, bool>) {
    std::optional<bool> flag = value.getAsBoolean();
    if (!flag)
      return planOptionError(key, "expected true or false");
    field = *flag;
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    const llvm::json::Array *list = value.getAsArray();
    if (!list)
      return planOptionError(key, "expected a list");
    field.clear();
    for (const llvm::json::Value &v : *list) {
      if (!v.getAsInteger())
        return planOptionError(key, "expected integers");
      field.push_back(*v.getAsInteger());
    }
  } else {
    std::optional<int64_t> number = value.getAsInteger();
    if (!number)
      return planOptionError(key, "expected an integer");
    field = *number;
  }
  return llvm::Error::success();
}

/// The JSON type name of an option's value, as Python spells it.
template <typename T> const char *pythonTypeOf() {
  if constexpr (std::is_enum_v<T> || std::is_base_of_v<ByteSize, T>)
    return "str";
  else if constexpr (std::is_same_v<T, bool>)
    return "bool";
  else if constexpr (std::is_same_v<T, std::vector<int64_t>>)
    return "triple";
  else
    return "int";
}

/// The plan options that are not planning options (PlanOptions).
struct OtherOption {
  const char *key, *help;
  std::string PlanOptions::*field;
};
const OtherOption kOtherPlanOptions[] = {
    {"hw", "Hardware description JSON (docs/CostModel.md); default H200",
     &PlanOptions::hardwarePath},
    {"precision", "Compute precision: bf16 | f32", &PlanOptions::precision},
};

} // namespace

/// Reads the plan options object; unknown keys are errors naming the key.
/// `training` receives the training keys (lr, weight_decay, adam_beta1,
/// adam_beta2, adam_eps, weighted_loss)
/// when given.
static llvm::Expected<PlanOptions>
parsePlanOptions(const char *text, TrainingOptions *training = nullptr) {
  PlanOptions options;
  if (!text || !*text)
    return options;
  llvm::Expected<llvm::json::Object> obj =
      parseJsonObject(text, "plan options", "the plan options");
  if (!obj)
    return obj.takeError();
  for (const auto &entry : *obj) {
    // Named references, not structured bindings: the lambda below captures
    // them (a C++20 extension).
    const llvm::json::ObjectKey &key = entry.first;
    const llvm::json::Value &value = entry.second;
    // A planning option with a flag has this key (PipelineOptions.def).
    bool known = false;
    llvm::Error err = llvm::Error::success();
    forEachOption(options, [&](const OptionInfo &info, auto &field) {
      if (known || info.flag.empty() || info.key() != key.str())
        return;
      known = true;
      err = readPlanningOption(info, key, value, field);
    });
    if (err)
      return std::move(err);
    if (known)
      continue;
    for (const OtherOption &other : kOtherPlanOptions) {
      if (key != other.key)
        continue;
      known = true;
      std::optional<llvm::StringRef> text = value.getAsString();
      if (!text)
        return planOptionError(key, "expected a string");
      options.*other.field = text->str();
    }
    if (known)
      continue;
    if (training && key == "weighted_loss") {
      std::optional<bool> flag = value.getAsBoolean();
      if (!flag)
        return planOptionError(key, "expected a bool");
      training->weightedLoss = *flag;
      continue;
    }
    double *real = nullptr;
    // The key, and the plan's name of the hyper-parameter it sets.
    llvm::StringRef hyper = llvm::StringSwitch<llvm::StringRef>(key)
                                .Case("adam_beta1", "beta1")
                                .Case("adam_beta2", "beta2")
                                .Case("adam_eps", "eps")
                                .Default(key);
    if (training)
      real = llvm::StringSwitch<double *>(key)
                 .Case("lr", &training->learningRate)
                 .Case("weight_decay", &training->weightDecay)
                 .Case("adam_beta1", &training->beta1)
                 .Case("adam_beta2", &training->beta2)
                 .Case("adam_eps", &training->adamEps)
                 .Default(nullptr);
    if (!real)
      return planOptionError(key, "unknown option");
    std::optional<double> number = value.getAsNumber();
    if (!number)
      return planOptionError(key, "expected a number");
    // The rule of the command line and of loaded plans.
    if (std::optional<std::string> problem =
            exec::checkAdamWHyperParameter(hyper, *number))
      return planOptionError(key, *problem);
    *real = *number;
  }
  return options;
}

int megaslidePlanOptionsJson(char **json) {
  llvm::json::Array list;
  PlanOptions defaults;
  forEachOption(defaults, [&](const OptionInfo &info, const auto &value) {
    using T = std::decay_t<decltype(value)>;
    if (info.flag.empty())
      return;
    llvm::json::Object option{{"key", info.key()},
                              {"name", info.name},
                              {"type", pythonTypeOf<T>()},
                              {"help", info.help}};
    if constexpr (std::is_enum_v<T>) {
      llvm::json::Array choices;
      for (T choice : OptionEnum<T>::values())
        choices.push_back(OptionEnum<T>::name(choice));
      option["choices"] = std::move(choices);
      option["default"] = OptionEnum<T>::name(value);
    } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
      option["default"] = nullptr;
    } else if constexpr (std::is_base_of_v<ByteSize, T>) {
      option["default"] = value.text();
    } else {
      option["default"] = value;
    }
    list.push_back(std::move(option));
  });
  for (const OtherOption &other : kOtherPlanOptions)
    list.push_back(llvm::json::Object{{"key", other.key},
                                      {"name", other.key},
                                      {"type", "str"},
                                      {"help", other.help},
                                      {"default", defaults.*other.field}});
  *json = copyString(llvm::formatv("{0}", llvm::json::Value(std::move(list))));
  return 0;
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

//===----------------------------------------------------------------------===//
// MLIR text in, text out: modules, pipelines, kernels
//===----------------------------------------------------------------------===//

namespace {

/// The dialects megaslide-opt registers.
mlir::DialectRegistry dialectRegistry() {
  mlir::DialectRegistry registry;
  registry.insert<graph::GraphDialect, schedule::ScheduleDialect,
                  mlir::func::FuncDialect>();
  return registry;
}

/// The passes and pipelines megaslide-opt registers (but its test passes),
/// once per process: the registry is global.
void registerPassesOnce() {
  static const bool registered = [] {
    mlir::registerTransformsPasses();
    registerMegaSlidePasses();
    registerPipelines();
    return true;
  }();
  (void)registered;
}

/// "<file>:<line>:<col>: " of the first file location in `loc`, or "".
std::string where(mlir::Location loc) {
  if (auto file = loc->findInstanceOf<mlir::FileLineColLoc>())
    return llvm::formatv("{0}:{1}:{2}: ", file.getFilename().getValue(),
                         file.getLine(), file.getColumn())
        .str();
  return "";
}

const char *severityName(mlir::DiagnosticSeverity severity) {
  switch (severity) {
  case mlir::DiagnosticSeverity::Error:
    return "error";
  case mlir::DiagnosticSeverity::Warning:
    return "warning";
  case mlir::DiagnosticSeverity::Remark:
    return "remark";
  case mlir::DiagnosticSeverity::Note:
    return "note";
  }
  return "note";
}

/// Collects the diagnostics of one call instead of printing them, rendered
/// as megaslide-opt prints their first line; notes follow on lines of
/// their own, indented by two spaces.
class DiagnosticCapture {
public:
  explicit DiagnosticCapture(mlir::MLIRContext &context)
      : handler(&context, [this](mlir::Diagnostic &diag) {
          record(diag);
          return mlir::success();
        }) {}

  std::vector<std::string> errors, warnings, remarks;

  /// The errors, one per line, or `fallback` when there were none.
  std::string errorText(llvm::StringRef fallback) const {
    std::string text;
    for (const std::string &e : errors)
      text += (text.empty() ? "" : "\n") + e;
    return text.empty() ? fallback.str() : text;
  }

private:
  void record(mlir::Diagnostic &diag) {
    std::string text = where(diag.getLocation()) +
                       severityName(diag.getSeverity()) + ": " + diag.str();
    for (mlir::Diagnostic &note : diag.getNotes())
      text += "\n  " + where(note.getLocation()) + "note: " + note.str();
    switch (diag.getSeverity()) {
    case mlir::DiagnosticSeverity::Error:
      errors.push_back(std::move(text));
      break;
    case mlir::DiagnosticSeverity::Warning:
      warnings.push_back(std::move(text));
      break;
    default:
      remarks.push_back(std::move(text));
      break;
    }
  }

  mlir::ScopedDiagnosticHandler handler;
};

/// The text-in entry points' common start: a context with the MegaSlide
/// dialects that captures the call's diagnostics, and `ir` parsed and
/// verified in it. Diagnostics name the op by location only: its text
/// (video-sized tensor types) would bury the message.
struct ParsedInput {
  ParsedInput(const char *ir, const char *sourceName)
      : context(dialectRegistry(), mlir::MLIRContext::Threading::DISABLED),
        diags(context) {
    context.printOpOnDiagnostic(false);
    llvm::StringRef name = sourceName && *sourceName ? sourceName : "<string>";
    // Refused before MLIR's parser recurses itself into a stack overflow.
    if (std::optional<unsigned> line =
            megaslide::findDeepIrNesting(ir ? ir : "")) {
      mlir::emitError(mlir::FileLineColLoc::get(&context, name, *line, 1))
          << megaslide::kIrNestingMessage;
      return;
    }
    module = mlir::parseSourceString<mlir::ModuleOp>(
        ir ? ir : "", mlir::ParserConfig(&context), name);
  }

  /// True, with the parser's diagnostics in `*error`, when `ir` did not
  /// parse or verify.
  bool failed(char **error) const {
    if (module)
      return false;
    *error = copyString(diags.errorText("the input is not a valid module"));
    return true;
  }

  mlir::MLIRContext context;
  DiagnosticCapture diags;
  mlir::OwningOpRef<mlir::ModuleOp> module;
};

std::string print(mlir::ModuleOp module) {
  std::string text;
  llvm::raw_string_ostream os(text);
  module.print(os);
  return text;
}

/// Runs `fn` with file descriptor 2 redirected to a temporary file and
/// returns what was written there. MLIR's pass-option parser reports an
/// unknown option or a bad value only on llvm::errs() (unbuffered, fd 2),
/// and the caller's message must name it. Without a temporary file or a
/// descriptor to spare, `fn` runs as is and nothing is captured.
template <typename Fn> std::string captureStderr(Fn &&fn) {
  std::fflush(stderr);
  int saved = dup(2);
  std::FILE *tmp = saved >= 0 ? std::tmpfile() : nullptr;
  if (!tmp || dup2(fileno(tmp), 2) < 0) {
    if (tmp)
      std::fclose(tmp);
    if (saved >= 0)
      close(saved);
    fn();
    return "";
  }
  fn();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::string text;
  std::rewind(tmp);
  char chunk[4096];
  for (size_t n; (n = std::fread(chunk, 1, sizeof(chunk), tmp)) > 0;)
    text.append(chunk, n);
  std::fclose(tmp);
  return text;
}

/// The captured cl::opt messages as clauses: "<Pass-Options-Parser>: no
/// such option x" and ": for the --buffers option: 'x' value invalid ..."
/// become "no such option x" and "for the --buffers option: ...".
std::string optionMessages(llvm::StringRef captured) {
  std::string text;
  llvm::SmallVector<llvm::StringRef> lines;
  captured.split(lines, '\n', -1, /*KeepEmpty=*/false);
  for (llvm::StringRef line : lines) {
    line = line.trim();
    line.consume_front("<Pass-Options-Parser>");
    line = line.ltrim(": ");
    if (!line.empty())
      text += (text.empty() ? "" : "; ") + line.str();
  }
  return text;
}

llvm::json::Array toJsonArray(const std::vector<std::string> &items) {
  llvm::json::Array array;
  for (const std::string &item : items)
    array.push_back(item);
  return array;
}

} // namespace

int megaslideBuildModule(const char *model, int64_t frames, int64_t height,
                         int64_t width, int latentUnits, int64_t batch,
                         int64_t textLen, const char *precision, char **ir,
                         char **error) {
  TrainingOptions training = trainingOptions(batch, textLen);
  if (precision && *precision) {
    llvm::Expected<ComputeType> type = parseComputeType(precision);
    if (!type) {
      *error = copyString(llvm::toString(type.takeError()));
      return 1;
    }
    training.computeType = *type;
  }
  VideoShape video{frames, height, width, latentUnits != 0};
  mlir::MLIRContext context(mlir::MLIRContext::Threading::DISABLED);
  mlir::OwningOpRef<mlir::ModuleOp> module;
  llvm::Expected<ModelInfo> info =
      computeModelInfo(context, model ? model : "", video, training, &module);
  if (!info) {
    *error = copyString(llvm::toString(info.takeError()));
    return 1;
  }
  *ir = copyString(print(*module));
  return 0;
}

int megaslideParseModule(const char *ir, const char *sourceName, char **printed,
                         char **error) {
  ParsedInput input(ir, sourceName);
  if (input.failed(error))
    return 1;
  *printed = copyString(print(*input.module));
  return 0;
}

int megaslideRunPipeline(const char *ir, const char *sourceName,
                         const char *pipeline, char **json, char **error) {
  registerPassesOnce();
  ParsedInput input(ir, sourceName);
  if (input.failed(error))
    return 1;
  // The FailureOr overload keeps the text's anchor; the overload filling a
  // PassManager would nest `builtin.module(...)` inside it and match
  // nothing (docs/Architecture.md, "Toolchain").
  std::string parseErrors;
  llvm::raw_string_ostream parseOs(parseErrors);
  llvm::StringRef text = pipeline ? pipeline : "";
  llvm::FailureOr<mlir::OpPassManager> parsed = mlir::failure();
  std::string captured =
      captureStderr([&] { parsed = mlir::parsePassPipeline(text, parseOs); });
  if (mlir::failed(parsed)) {
    // A pass reports a bad option into `parseOs`, a pipeline on stderr.
    std::string why = llvm::StringRef(parseErrors).rtrim().str();
    for (size_t at;
         (at = why.find("<Pass-Options-Parser>: ")) != std::string::npos;)
      why.erase(at, strlen("<Pass-Options-Parser>: "));
    for (size_t at; (at = why.find("\n\n")) != std::string::npos;)
      why.erase(at, 1);
    if (std::string options = optionMessages(captured); !options.empty())
      why = options + " (" + why + ")";
    *error = copyString("invalid pass pipeline '" + text.str() + "': " + why);
    return 1;
  }
  // Whatever else was printed belongs where it was going.
  llvm::errs() << captured;
  llvm::StringRef anchor = parsed->getOpAnchorName();
  if (anchor != mlir::ModuleOp::getOperationName() &&
      anchor != mlir::OpPassManager::getAnyOpAnchorName()) {
    *error = copyString("invalid pass pipeline '" + text.str() +
                        "': it is anchored on '" + anchor.str() +
                        "'; anchor it on builtin.module, e.g. "
                        "builtin.module(func.func(cse))");
    return 1;
  }
  mlir::PassManager pm(&input.context, anchor);
  static_cast<mlir::OpPassManager &>(pm) = std::move(*parsed);
  mlir::LogicalResult ran = pm.run(*input.module);
  llvm::json::Object result{{"ir", print(*input.module)},
                            {"remarks", toJsonArray(input.diags.remarks)},
                            {"warnings", toJsonArray(input.diags.warnings)}};
  *json = copyString(
      llvm::formatv("{0}", llvm::json::Value(std::move(result))).str());
  if (mlir::failed(ran)) {
    *error = copyString(input.diags.errorText("the pass pipeline failed"));
    return 2;
  }
  return 0;
}

int megaslideEmitDsaKernelsJson(const char *ir, const char *sourceName,
                                char **json, char **error) {
  ParsedInput input(ir, sourceName);
  if (input.failed(error))
    return 1;
  cuda::EmittedDsaKernels emitted;
  llvm::raw_null_ostream discard;
  if (mlir::failed(cuda::emitDsaKernels(*input.module, "", discard, emitted))) {
    *error = copyString(input.diags.errorText("3D-DSA kernel emission failed"));
    return 1;
  }
  llvm::json::Array kernels;
  for (size_t i = 0; i < emitted.configs.size(); ++i) {
    // One configuration's manifest, as an execution plan's kernel module
    // carries it.
    std::string manifest;
    llvm::raw_string_ostream os(manifest);
    cuda::writeDsaManifest(emitted.configs[i], emitted.plans[i], os);
    llvm::Expected<llvm::json::Value> parsedManifest =
        llvm::json::parse(manifest);
    if (!parsedManifest) {
      *error = copyString(llvm::toString(parsedManifest.takeError()));
      return 1;
    }
    kernels.push_back(
        llvm::json::Object{{"name", cuda::configName(emitted.configs[i])},
                           {"description", emitted.configs[i].describe()},
                           {"source", emitted.sources[i]},
                           {"manifest", std::move(*parsedManifest)}});
  }
  *json = copyString(llvm::formatv("{0}", llvm::json::Value(llvm::json::Object{
                                              {"kernels", std::move(kernels)}}))
                         .str());
  return 0;
}

/// The device buffers of a planned module, offsets from msched.offsets and
/// msched.workspace (-1 where memory was not packed).
static llvm::json::Array deviceBuffersJson(mlir::ModuleOp module,
                                           int64_t &numSteps) {
  llvm::json::Array out;
  numSteps = 0;
  auto step = module.lookupSymbol<mlir::func::FuncOp>("train_step");
  if (!step)
    return out;
  DeviceBuffers buffers = collectDeviceBuffers(step);
  numSteps = buffers.numSteps;
  for (const DeviceBuffer &b : buffers.buffers) {
    int64_t offset = -1;
    if (b.value) {
      if (auto offsets = b.owner->getAttrOfType<mlir::DenseI64ArrayAttr>(
              schedule::kOffsetsAttrName))
        offset = offsets[llvm::cast<mlir::OpResult>(b.value).getResultNumber()];
    } else if (auto ws = b.owner->getAttrOfType<mlir::DenseI64ArrayAttr>(
                   schedule::kWorkspaceAttrName)) {
      offset = ws[0];
    }
    out.push_back(llvm::json::Object{
        {"what", b.describe()},
        {"category", b.category},
        {"layer", b.layer ? llvm::json::Value(*b.layer) : nullptr},
        {"offset", offset},
        {"bytes", b.slice.size},
        {"start", b.slice.start},
        {"end", b.slice.end}});
  }
  return out;
}

int megaslideMemoryPlanJson(const char *model, int64_t frames, int64_t height,
                            int64_t width, int latentUnits, int64_t batch,
                            int64_t textLen, const char *optionsJson,
                            char **json, char **error) {
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
  int64_t numSteps = 0;
  llvm::json::Array buffers = deviceBuffersJson(*plan->module, numSteps);
  llvm::json::Object result{{"report", toJson(*plan)},
                            {"num_steps", numSteps},
                            {"device_buffers", std::move(buffers)}};
  *json = copyString(
      llvm::formatv("{0}", llvm::json::Value(std::move(result))).str());
  return 0;
}

void megaslideFreeString(char *str) { std::free(str); }

const char *megaslideVersion(void) { return MEGASLIDE_VERSION; }
