//===- TestPlans.cpp - Saved plans for the runtime's tests ----------------===//

#include "megaslide/Testing/TestPlans.h"
#include "megaslide/runtime/plan/ExecPlanJson.h"

#include "llvm/Support/Error.h"

#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>

namespace megaslide {

const exec::ExecPlan *savedTestPlan(const std::string &name, std::string &why) {
  struct Cached {
    std::optional<exec::ExecPlan> plan;
    std::string why;
  };
  static std::map<std::string, Cached> cache;
  auto [it, fresh] = cache.try_emplace(name);
  Cached &c = it->second;
  if (fresh) {
    namespace fs = std::filesystem;
    const char *env = std::getenv("MEGASLIDE_TEST_PLANS");
    fs::path dir = env && *env ? fs::path(env)
                               : fs::read_symlink("/proc/self/exe")
                                         .parent_path()
                                         .parent_path() /
                                     "test" / "plans";
    fs::path path = dir / (name + ".json");
    if (!fs::exists(path)) {
      c.why = "no saved plan '" + path.string() +
              "': build the full configuration (it saves them) or set "
              "MEGASLIDE_TEST_PLANS to a folder holding " + name + ".json";
    } else if (auto loaded = exec::loadExecPlan(path.string())) {
      c.plan = std::move(*loaded);
    } else {
      c.why = llvm::toString(loaded.takeError());
    }
  }
  why = c.why;
  return c.plan ? &*c.plan : nullptr;
}

} // namespace megaslide
