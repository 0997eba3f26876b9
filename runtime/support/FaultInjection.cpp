//===- FaultInjection.cpp - Test-only faults from the environment ---------===//

#include "megaslide/runtime/support/FaultInjection.h"

#include <cstdlib>
#include <string>

using namespace megaslide;

namespace {

/// A parameter's gradient at an optimizer step.
struct GradientAt {
  std::string param;
  int64_t step = 0;
};

/// Every fault the environment asks for, read once.
struct Faults {
  std::optional<uint64_t> writeLimit;
  std::optional<GradientAt> nanGradient;
  std::optional<std::pair<int, int64_t>> hang; ///< rank, step
};

std::optional<uint64_t> parseWriteLimit(const char *text) {
  if (!text || !*text)
    return std::nullopt;
  char *end = nullptr;
  unsigned long long value = std::strtoull(text, &end, 10);
  if (*end)
    return std::nullopt;
  return value;
}

const Faults &faults() {
  static const Faults f = [] {
    Faults f;
    f.writeLimit = parseWriteLimit(std::getenv("MEGASLIDE_FAULT_WRITE_LIMIT"));
    // NAME@STEP; anything else asks for no fault.
    if (const char *text = std::getenv("MEGASLIDE_FAULT_NAN_GRADIENT")) {
      auto [name, step] = llvm::StringRef(text).rsplit('@');
      GradientAt at{name.str()};
      if (!step.getAsInteger(10, at.step))
        f.nanGradient = std::move(at);
    }
    // RANK@STEP
    if (const char *text = std::getenv("MEGASLIDE_FAULT_HANG")) {
      auto [rank, step] = llvm::StringRef(text).split('@');
      std::pair<int, int64_t> at;
      if (!rank.getAsInteger(10, at.first) && !step.getAsInteger(10, at.second))
        f.hang = at;
    }
    return f;
  }();
  return f;
}

} // namespace

std::optional<uint64_t> fault::writeLimit() { return faults().writeLimit; }

bool fault::nanGradient(llvm::StringRef param, int64_t step) {
  const std::optional<GradientAt> &at = faults().nanGradient;
  return at && at->step == step && at->param == param;
}

bool fault::hangs(int rank, int64_t step) {
  const std::optional<std::pair<int, int64_t>> &at = faults().hang;
  return at && at->first == rank && at->second == step;
}
