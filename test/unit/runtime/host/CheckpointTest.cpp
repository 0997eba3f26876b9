//===- CheckpointTest.cpp - Checkpoints -----------------------------------===//
//
// host/Checkpoint (runtime): checkpoints bit-exact, with their manifest
// and checksums; corruption, truncation and `latest` handling, each error
// naming the checkpoint to fall back to; retention; the guards (symlinks,
// non-finite state, one owner per folder); int8 and factored moments saved
// as kept and refused by a state of another policy; failed saves leaving
// earlier checkpoints intact; and small files read within a bound.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Testing/HostTestSupport.h"

#include "megaslide/runtime/host/Checkpoint.h"
#include "megaslide/runtime/host/HostOptimizer.h"
#include "megaslide/runtime/host/Safetensors.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/Path.h"

#include "gtest/gtest.h"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <limits>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

using namespace megaslide;
using namespace megaslide::host;
using namespace megaslide::host::test;
using llvm::StringRef;

namespace {

class CheckpointTest : public ScratchDirTest {};

void flipByte(StringRef path, uint64_t offset) {
  std::string bytes = readAll(path);
  ASSERT_LT(offset, bytes.size());
  bytes[offset] ^= 0x5A;
  writeAll(path, bytes);
}

// Tests that a manifest naming a file outside its checkpoint's folder (a
// name read from a file, e.g. '../../victim') is refused before it is
// joined to the folder, not followed.
TEST_F(CheckpointTest, ManifestNamesStayInTheFolder) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState saved = makeState(plan, 10);
  saved.step = 7;
  auto stepDir = saveCheckpoint(dir, saved, "{}");
  ASSERT_TRUE(!!stepDir) << llvm::toString(stepDir.takeError());
  std::string manifestPath = *stepDir + "/manifest.json";
  std::string text = readAll(manifestPath);
  size_t at = text.find("\"trainer.json\"");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 14, "\"../../victim\"");
  writeAll(manifestPath, text);
  HostState loaded = makeState(plan, 1);
  std::string trainer;
  std::string e = errorText(loadCheckpoint(*stepDir, loaded, trainer));
  EXPECT_NE(e.find("the 'files' entry '../../victim' is not a file name in "
                   "the checkpoint's folder"),
            std::string::npos)
      << e;
}

TEST_F(CheckpointTest, RoundTripIsBitExact) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState saved = makeState(plan, 10);
  saved.step = 123;
  std::string trainer = R"({"epoch": 3, "rng": [1, 2, 3], "s": "\u00e9"})";
  auto stepDir = saveCheckpoint(dir, saved, trainer);
  ASSERT_TRUE(!!stepDir) << llvm::toString(stepDir.takeError());
  EXPECT_EQ(*stepDir, path("step-000123"));
  EXPECT_EQ(readAll(path("latest")), "step-000123\n");
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"latest", "step-000123"}));
  EXPECT_EQ(entries(*stepDir),
            (std::vector<std::string>{"manifest.json", "state.safetensors",
                                      "trainer.json"}));

  auto manifest = llvm::json::parse(readAll(*stepDir + "/manifest.json"));
  ASSERT_TRUE(!!manifest);
  const llvm::json::Object *m = manifest->getAsObject();
  EXPECT_EQ(m->getInteger("step"), 123);
  EXPECT_EQ(m->getString("checksum"), "crc32c");
  const llvm::json::Array *files = m->getArray("files");
  ASSERT_EQ(files->size(), 2u);
  for (const llvm::json::Value &f : *files) {
    const llvm::json::Object *o = f.getAsObject();
    std::string content = readAll(*stepDir + "/" + o->getString("name")->str());
    EXPECT_EQ(o->getInteger("bytes"), static_cast<int64_t>(content.size()));
    char hex[9];
    snprintf(hex, sizeof(hex), "%08x",
             crc32c(0, llvm::ArrayRef<uint8_t>(
                           reinterpret_cast<const uint8_t *>(content.data()),
                           content.size())));
    EXPECT_EQ(o->getString("crc32c"), StringRef(hex));
  }

  HostState loaded = makeState(plan, 11);
  std::string gotTrainer;
  ASSERT_EQ(errorText(loadLatestCheckpoint(dir, loaded, gotTrainer)), "");
  EXPECT_EQ(gotTrainer, trainer);
  EXPECT_EQ(loaded.step, 123);
  for (const HostTensor &t : saved.tensors)
    EXPECT_TRUE(bitEqual(get(loaded, t.param->name).data, t.data))
        << t.param->name;

  auto list = listCheckpoints(dir);
  ASSERT_TRUE(!!list);
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].step, 123);
  EXPECT_EQ(checkpointDirName(1234567), "step-1234567");
  auto none = listCheckpoints(path("nothing-here"));
  ASSERT_TRUE(!!none);
  EXPECT_TRUE(none->empty());
}

TEST_F(CheckpointTest, CorruptionIsDetected) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 12);
  state.step = 10;
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "{}"));
  state.step = 20;
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "{\"at\": 20}"));
  std::string stateFile = path("step-000020/state.safetensors");
  std::string original = readAll(stateFile);
  std::string trainer;

  // A flipped byte in the tensor data: found by the checksum.
  flipByte(stateFile, original.size() - 3);
  HostState loaded = makeState(plan, 13);
  std::string e = errorText(loadLatestCheckpoint(dir, loaded, trainer));
  EXPECT_NE(e.find("'" + stateFile + "' is corrupt: its CRC-32C is"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("the previous checkpoint is '" + path("step-000010") + "'"),
            std::string::npos)
      << e;
  EXPECT_EQ(loaded.step, 7) << "step changed by a failed load";
  EXPECT_EQ(trainer, "");
  // ... and the suggested one loads.
  ASSERT_EQ(errorText(loadCheckpoint(path("step-000010"), loaded, trainer)),
            "");
  EXPECT_EQ(loaded.step, 10);
  EXPECT_EQ(trainer, "{}");

  // A flipped byte in the header: a format error, said to be corruption.
  writeAll(stateFile, original);
  flipByte(stateFile, 9);
  e = errorText(loadCheckpoint(path("step-000020"), loaded, trainer));
  EXPECT_NE(e.find(stateFile), std::string::npos) << e;
  EXPECT_NE(e.find("the file is corrupt"), std::string::npos) << e;

  // Truncated: named by its size before anything is read.
  writeAll(stateFile, StringRef(original).drop_back(100));
  e = errorText(loadLatestCheckpoint(dir, loaded, trainer));
  EXPECT_NE(e.find("'" + stateFile + "' is " +
                   std::to_string(original.size() - 100) +
                   " bytes, the manifest records " +
                   std::to_string(original.size()) + " (truncated)"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find(path("step-000010")), std::string::npos) << e;

  // trainer.json edited: its checksum.
  writeAll(stateFile, original);
  std::string trainerFile = path("step-000020/trainer.json");
  std::string trainerText = readAll(trainerFile);
  trainerText[trainerText.find("20")] = '3';
  writeAll(trainerFile, trainerText);
  e = errorText(loadCheckpoint(path("step-000020"), loaded, trainer));
  EXPECT_NE(e.find("'" + trainerFile + "' is corrupt: its CRC-32C"),
            std::string::npos)
      << e;

  // No manifest: incomplete.
  llvm::sys::fs::remove(path("step-000020/manifest.json"));
  e = errorText(loadCheckpoint(path("step-000020"), loaded, trainer));
  EXPECT_NE(e.find("not a complete checkpoint: manifest.json is missing"),
            std::string::npos)
      << e;

  // Tensors that do not match the plan.
  exec::ExecPlan other = makePlan({{"something.else", {2}}});
  HostState otherState = makeState(other, 1);
  e = errorText(loadCheckpoint(path("step-000010"), otherState, trainer));
  EXPECT_NE(e.find("3 missing: something.else, something.else.exp_avg, "
                   "something.else.exp_avg_sq"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("unexpected (not in the model)"), std::string::npos) << e;
}

TEST_F(CheckpointTest, LatestHandling) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 14);
  std::string trainer;
  std::string e = errorText(loadLatestCheckpoint(dir, state, trainer));
  EXPECT_NE(e.find("no checkpoint in '" + dir + "'"), std::string::npos) << e;

  state.step = 5;
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "five"));
  state.step = 6;
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "six"));

  writeAll(path("latest"), "\x01garbage\xff");
  e = errorText(loadLatestCheckpoint(dir, state, trainer));
  EXPECT_NE(e.find("'" + path("latest") + "' is corrupt"), std::string::npos)
      << e;
  EXPECT_NE(
      e.find("the newest complete checkpoint is '" + path("step-000006") + "'"),
      std::string::npos)
      << e;

  writeAll(path("latest"), "step-000099\n");
  e = errorText(loadLatestCheckpoint(dir, state, trainer));
  EXPECT_NE(e.find(path("step-000099")), std::string::npos) << e;
  EXPECT_NE(e.find("the previous checkpoint is '" + path("step-000006") + "'"),
            std::string::npos)
      << e;

  // No `latest` at all (a save killed before naming its checkpoint): the
  // newest complete checkpoint, which `latest` would have named.
  llvm::sys::fs::remove(path("latest"));
  ASSERT_EQ(errorText(loadLatestCheckpoint(dir, state, trainer)), "");
  EXPECT_EQ(state.step, 6);

  // `latest` pointing at the older one is honoured.
  writeAll(path("latest"), "step-000005");
  ASSERT_EQ(errorText(loadLatestCheckpoint(dir, state, trainer)), "");
  EXPECT_EQ(trainer, "five");
  EXPECT_EQ(state.step, 5);
}

TEST_F(CheckpointTest, Retention) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 15);
  // Leftovers of a crashed save (a dead pid) go; those of a live process
  // (this one) stay.
  std::string dead = path(".tmp-step-000001-999999999");
  std::string live = path(".tmp-step-000001-" + std::to_string(::getpid()));
  llvm::sys::fs::create_directories(dead);
  llvm::sys::fs::create_directories(live);
  writeAll(dead + "/state.safetensors", "partial");
  for (int64_t step : {100, 200, 300, 400}) {
    state.step = step;
    ASSERT_TRUE(!!saveCheckpoint(dir, state, ""));
  }
  EXPECT_FALSE(llvm::sys::fs::exists(dead));
  EXPECT_TRUE(llvm::sys::fs::exists(live));
  llvm::sys::fs::remove(live);
  EXPECT_EQ(entries(dir),
            (std::vector<std::string>{"latest", "step-000300", "step-000400"}));
  // keep = 0 keeps all; keep = 1 only the new one.
  state.step = 500;
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "", {/*keep=*/0}));
  EXPECT_EQ(entries(dir).size(), 4u);
  state.step = 600;
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "", {/*keep=*/1}));
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"latest", "step-000600"}));
  // A run restarted from an earlier step never deletes later checkpoints,
  // and saving the same step again replaces it.
  state.step = 50;
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "a"));
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "b"));
  EXPECT_EQ(entries(dir),
            (std::vector<std::string>{"latest", "step-000050", "step-000600"}));
  std::string trainer;
  ASSERT_EQ(errorText(loadLatestCheckpoint(dir, state, trainer)), "");
  EXPECT_EQ(trainer, "b");
  EXPECT_EQ(state.step, 50);
}

// Tests that saving never follows a symlink named like a checkpoint, that
// it refuses non-finite state, that replaceOthers replaces only real
// checkpoints, and that a checkpoint folder has one owner at a time.
TEST_F(CheckpointTest, Guards) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 17);
  std::string mine = path("../mine-" + std::to_string(::getpid()));
  llvm::sys::fs::create_directories(mine);
  writeAll(mine + "/thesis.txt", "years");
  ASSERT_FALSE(llvm::sys::fs::create_link(mine, path("step-000001")));
  for (int64_t step : {2, 3, 4}) {
    state.step = step;
    ASSERT_EQ(errorText(saveCheckpoint(dir, state, "").takeError()), "");
  }
  EXPECT_TRUE(llvm::sys::fs::exists(mine + "/thesis.txt"));
  EXPECT_EQ(entries(dir),
            (std::vector<std::string>{"latest", "step-000001", "step-000003",
                                      "step-000004"}));
  // A save onto a symlinked step is refused; nothing is followed.
  ASSERT_FALSE(llvm::sys::fs::create_link(mine, path("step-000005")));
  state.step = 5;
  std::string refused = errorText(saveCheckpoint(dir, state, "").takeError());
  EXPECT_NE(refused.find("step-000005' exists and is not a checkpoint"),
            std::string::npos)
      << refused;
  EXPECT_TRUE(llvm::sys::fs::exists(mine + "/thesis.txt"));
  llvm::sys::fs::remove(path("step-000005"));
  // Non-finite state is never saved.
  std::vector<std::string> before = entries(dir);
  state.tensors[0].data[1] = std::numeric_limits<float>::quiet_NaN();
  std::string nan = errorText(saveCheckpoint(dir, state, "").takeError());
  EXPECT_NE(nan.find("holds nan at element 1"), std::string::npos) << nan;
  EXPECT_EQ(entries(dir), before);
  state.tensors[0].data[1] = 0;
  // replaceOthers: a fresh run's first save removes the old run's real
  // checkpoints, later steps included, and leaves the symlink alone.
  state.step = 2;
  CheckpointOptions replace;
  replace.replaceOthers = true;
  ASSERT_EQ(errorText(saveCheckpoint(dir, state, "fresh", replace).takeError()),
            "");
  EXPECT_EQ(entries(dir),
            (std::vector<std::string>{"latest", "step-000001", "step-000002"}));
  llvm::Expected<std::string> trainer = readLatestTrainerState(dir);
  ASSERT_TRUE(!!trainer) << llvm::toString(trainer.takeError());
  EXPECT_EQ(*trainer, "fresh");
  EXPECT_TRUE(llvm::sys::fs::exists(mine + "/thesis.txt"));
  llvm::sys::fs::remove(path("step-000001"));
  llvm::sys::fs::remove_directories(mine);

  // One lock per folder, also within one process (flock is per open file).
  auto first = CheckpointLock::acquire(dir);
  ASSERT_TRUE(!!first) << llvm::toString(first.takeError());
  auto second = CheckpointLock::acquire(dir);
  ASSERT_FALSE(!!second);
  std::string busy = llvm::toString(second.takeError());
  EXPECT_NE(busy.find("in use by another run (pid " +
                      std::to_string(::getpid()) + ")"),
            std::string::npos)
      << busy;
  first->reset();
  auto third = CheckpointLock::acquire(dir);
  EXPECT_TRUE(!!third) << llvm::toString(third.takeError());
}

TEST_F(CheckpointTest, FailedSaveKeepsPreviousCheckpoints) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 16);
  state.step = 1;
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "one"));
  std::string before = readAll(path("step-000001/state.safetensors"));

  // Disk full halfway through state.safetensors.
  state.step = 2;
  {
    FileSizeLimit full(300);
    auto saved = saveCheckpoint(dir, state, "two");
    ASSERT_FALSE(!!saved);
    std::string e = llvm::toString(saved.takeError());
    EXPECT_NE(e.find("state.safetensors"), std::string::npos) << e;
    EXPECT_NE(e.find("cannot write"), std::string::npos) << e;
  }
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"latest", "step-000001"}));
  EXPECT_EQ(readAll(path("latest")), "step-000001\n");
  EXPECT_EQ(readAll(path("step-000001/state.safetensors")), before);
  std::string trainer;
  ASSERT_EQ(errorText(loadLatestCheckpoint(dir, state, trainer)), "");
  EXPECT_EQ(trainer, "one");

  // Unwritable location (works as root too: a file where a directory
  // should be).
  writeAll(path("plain-file"), "x");
  auto saved = saveCheckpoint(path("plain-file/ckpt"), state, "");
  ASSERT_FALSE(!!saved);
  EXPECT_NE(llvm::toString(saved.takeError()).find("plain-file/ckpt"),
            std::string::npos);

  // Tensors of the wrong size are refused before anything is written.
  get(state, "patch_embedding.bias").data.pop_back();
  state.step = 3;
  saved = saveCheckpoint(dir, state, "");
  ASSERT_FALSE(!!saved);
  EXPECT_NE(llvm::toString(saved.takeError()).find("patch_embedding.bias"),
            std::string::npos);
  EXPECT_EQ(entries(dir),
            (std::vector<std::string>{"latest", "plain-file", "step-000001"}));
}

TEST_F(CheckpointTest, SmallFilesAreBounded) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 3);
  std::string trainer;
  std::string latest = path("latest");
  auto loadError = [&] {
    return errorText(loadLatestCheckpoint(dir, state, trainer));
  };

  ASSERT_EQ(::symlink("/dev/zero", latest.c_str()), 0);
  EXPECT_NE(loadError().find("cannot read '" + latest +
                             "': it is a character device, not a regular "
                             "file"),
            std::string::npos)
      << loadError();
  ASSERT_EQ(::unlink(latest.c_str()), 0);

  writeSparse(latest, "step-000001\n", 64 << 20);
  EXPECT_NE(loadError().find("cannot read '" + latest +
                             "': it is 67108864 bytes, over the limit of "
                             "4096 bytes"),
            std::string::npos)
      << loadError();
  ASSERT_EQ(::unlink(latest.c_str()), 0);

  ASSERT_EQ(::mkfifo(latest.c_str(), 0600), 0);
  {
    FifoWatch watch(latest);
    EXPECT_NE(loadError().find("it is a FIFO (named pipe), not a regular "
                               "file"),
              std::string::npos)
        << loadError();
    EXPECT_FALSE(watch.openedByReader()) << "a reader opened 'latest'";
  }

  // A manifest that is a FIFO.
  ASSERT_TRUE(llvm::sys::fs::create_directory(path("step-000001")) ==
              std::error_code());
  std::string manifest = path("step-000001/manifest.json");
  ASSERT_EQ(::mkfifo(manifest.c_str(), 0600), 0);
  FifoWatch watch(manifest);
  std::string e =
      errorText(loadCheckpoint(path("step-000001"), state, trainer));
  EXPECT_NE(e.find("cannot read '" + manifest +
                   "': it is a FIFO (named pipe), not a regular file"),
            std::string::npos)
      << e;
  EXPECT_FALSE(watch.openedByReader()) << "a reader opened the manifest";
}

} // namespace

namespace {

/// A state of `hostState` (int8-moments or factored-moments) for a plan of
/// a matrix, a vector and a small matrix, after three AdamW updates with
/// fixed gradients, so that codes, absmax and statistics are not zero.
HostState leanState(const exec::ExecPlan &plan) {
  HostState s = initHostState(plan, 5);
  for (int64_t step = 1; step <= 3; ++step)
    for (const exec::Param &p : plan.params) {
      if (p.role != "master")
        continue;
      auto t = adamwTensors(s, p.name);
      EXPECT_TRUE(!!t) << llvm::toString(t.takeError());
      std::vector<float> g(p.type.numElements());
      for (size_t i = 0; i < g.size(); ++i)
        g[i] = std::sin(float(i * step)) * 1e-2f;
      cpu::AdamWHyper h;
      h.step = step;
      EXPECT_FALSE(static_cast<bool>(
          adamwUpdate(h, *t, {g.data(), exec::DType::F32, int64_t(g.size())})));
    }
  s.step = 3;
  return s;
}

// Tests that int8 and factored moments are saved as kept (codes, absmax,
// row and column statistics, a bf16 m) and load bit-exactly, and that a
// checkpoint of one host state is refused by a state of another.
TEST_F(CheckpointTest, LeanMomentsRoundTripAndOtherPoliciesAreRefused) {
  for (llvm::StringRef policy : {exec::kInt8Moments, exec::kFactoredMoments}) {
    exec::ExecPlan plan =
        makePlan({{"w", {64, 80}}, {"b", {80}}, {"small", {8, 8}}});
    plan.hostState = policy.str();
    HostState saved = leanState(plan);
    const HostTensor &v = get(saved, "w.exp_avg_sq");
    ASSERT_TRUE(v.lean()) << policy.str();
    EXPECT_EQ(saved.bytes(), stateBytes(plan)) << policy.str();
    std::string sub = (dir + "/" + policy).str();
    auto stepDir = saveCheckpoint(sub, saved, "{}");
    ASSERT_TRUE(!!stepDir) << llvm::toString(stepDir.takeError());
    HostState loaded = initHostState(plan, 9);
    std::string trainer;
    ASSERT_EQ(errorText(loadLatestCheckpoint(sub, loaded, trainer)), "");
    for (const HostTensor &t : saved.tensors) {
      const HostTensor &l = get(loaded, t.param->name);
      EXPECT_TRUE(bitEqual(l.data, t.data)) << t.param->name;
      EXPECT_EQ(l.codes, t.codes) << t.param->name;
      EXPECT_TRUE(bitEqual(l.absmax, t.absmax)) << t.param->name;
      EXPECT_TRUE(bitEqual(l.rowStat, t.rowStat)) << t.param->name;
      EXPECT_TRUE(bitEqual(l.colStat, t.colStat)) << t.param->name;
      EXPECT_EQ(l.bf16, t.bf16) << t.param->name;
    }
    // A state that keeps its moments in fp32 refuses the checkpoint.
    plan.hostState.clear();
    HostState fp32 = initHostState(plan, 9);
    std::string e = errorText(loadLatestCheckpoint(sub, fp32, trainer));
    EXPECT_NE(e.find("keeps the AdamW moments as " + policy.str() +
                     ", this run's plan as fp32 (or bf16) moments: resume "
                     "with the --host-state-policy it was saved with"),
              std::string::npos)
        << e;
  }
}

} // namespace
