//===- HyperParameters.h - The AdamW hyper-parameters ----------*- C++ -*-===//
//
// One rule and one set of defaults for the AdamW hyper-parameters wherever
// they come from: the command line (--lr, --weight-decay), a model config
// (learning_rate), the C API and Python plan options, and the host_adamw
// attributes of a loaded execution plan (exec::validate). Header-only and
// without MLIR or LLVM, so the compiler, the runtime and its kernels
// (cpu/AdamW.h) include the same definition.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_PLAN_HYPERPARAMETERS_H
#define MEGASLIDE_RUNTIME_PLAN_HYPERPARAMETERS_H

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

namespace megaslide::exec {

/// The AdamW hyper-parameters where nothing sets one: the training step's
/// defaults (no --lr and no config learning_rate gives kDefaultLr) and the
/// backends' reading of a host_adamw that leaves an attribute out (the
/// compiler's plans carry all five).
inline constexpr double kDefaultLr = 1e-5;
inline constexpr double kDefaultBeta1 = 0.9;
inline constexpr double kDefaultBeta2 = 0.999;
inline constexpr double kDefaultEps = 1e-8;
inline constexpr double kDefaultWeightDecay = 0.0;

/// What is wrong with `value` as the AdamW hyper-parameter `name`, as the
/// predicate of a sentence whose subject the caller names ("--lr", "config
/// field 'learning_rate':", "attribute 'lr'"), or nullopt when it is valid:
///
///   lr             finite, > 0
///   beta1, beta2   in [0, 1)      (1 makes the bias correction divide by 0)
///   eps            finite, > 0
///   weight_decay   finite, >= 0
///
/// `name` is one of those five (the plan's attribute names); any other
/// name is a programming error and reported as such.
inline std::optional<std::string>
checkAdamWHyperParameter(std::string_view name, double value) {
  bool ok;
  const char *rule;
  if (name == "lr" || name == "eps") {
    ok = std::isfinite(value) && value > 0;
    rule = "must be a positive number";
  } else if (name == "beta1" || name == "beta2") {
    ok = value >= 0 && value < 1;
    rule = "must be in [0, 1)";
  } else if (name == "weight_decay") {
    ok = std::isfinite(value) && value >= 0;
    rule = "must be a non-negative number";
  } else {
    return "is not an AdamW hyper-parameter";
  }
  if (ok)
    return std::nullopt;
  char shown[32];
  std::snprintf(shown, sizeof(shown), "%g", value);
  return std::string(rule) + ", got " + shown;
}

} // namespace megaslide::exec

#endif // MEGASLIDE_RUNTIME_PLAN_HYPERPARAMETERS_H
