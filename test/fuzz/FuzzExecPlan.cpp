//===- FuzzExecPlan.cpp - Fuzz target: execution plan loader --------------===//
//
// Arbitrary bytes through megaslide::exec::parseExecPlan, the loader of
// `megaslide-run --plan` that treats the file as untrusted input. A plan it
// accepts is what every backend trusts, so it must also replay on the sim
// backend (`--backend sim`, which leaves all checking to the loader) with
// every write inside the arena, and must serialise and load again to the
// same text (the format is its own fixed point after one round trip). A
// crash, a sanitizer report or a broken promise (abort) is a bug.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/plan/ExecPlan.h"
#include "megaslide/runtime/plan/ExecPlanJson.h"
#include "megaslide/runtime/plan/Liveness.h"
#include "megaslide/runtime/sim/SimBackend.h"

#include "llvm/Support/Error.h"
#include "llvm/Support/raw_ostream.h"

#include <cstdint>
#include <cstdlib>

using namespace megaslide::exec;

static void fail(const char *what, llvm::Error err) {
  llvm::errs() << "fuzz-exec-plan: " << what << ": "
               << llvm::toString(std::move(err)) << "\n";
  abort();
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  llvm::StringRef text(reinterpret_cast<const char *>(data), size);
  llvm::Expected<ExecPlan> plan = parseExecPlan(text, "fuzz.json");
  if (!plan) {
    llvm::consumeError(plan.takeError());
    return 0;
  }
  Liveness live = computeLiveness(*plan);
  if (live.liveBytes.size() != plan->instructions.size() ||
      live.peakLiveBytes < 0)
    abort();

  llvm::Expected<megaslide::sim::SimResult> sim =
      megaslide::sim::simulateStep(*plan, megaslide::sim::HardwareModel());
  if (!sim)
    fail("the sim backend rejects a valid plan", sim.takeError());
  if (!(sim->makespan >= 0) || sim->arenaHighWater > plan->arenaBytes ||
      sim->start.size() != plan->instructions.size())
    abort();

  std::string once = serialize(*plan);
  llvm::Expected<ExecPlan> again = parseExecPlan(once, "serialized");
  if (!again)
    fail("a serialised valid plan does not load", again.takeError());
  std::string twice = serialize(*again);
  llvm::Expected<ExecPlan> third = parseExecPlan(twice, "reserialized");
  if (!third)
    fail("a reserialised valid plan does not load", third.takeError());
  if (serialize(*third) != twice)
    fail("serialisation is not a fixed point",
         llvm::createStringError("after one round trip"));
  return 0;
}
