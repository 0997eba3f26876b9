//===- WeightsTest.cpp - Diffusers weight directories ---------------------===//
//
// host/Weights (runtime): diffusers weight directories, single file and
// sharded with an index, in F32 and BF16; index errors, a bounded index,
// and the one error that lists unknown, missing and misshapen tensors.
// Plans and host states are built by hand (HostTestSupport.h).
//
//===----------------------------------------------------------------------===//

#include "megaslide/Testing/HostTestSupport.h"

#include "megaslide/runtime/host/Safetensors.h"
#include "megaslide/runtime/host/Weights.h"

#include "megaslide/runtime/cpu/HalfFloat.h"
#include "megaslide/runtime/support/ReadFile.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/Path.h"

#include "gtest/gtest.h"

#include <fstream>
#include <sys/stat.h>
#include <unistd.h>

using namespace megaslide;
using namespace megaslide::host;
using namespace megaslide::host::test;
using llvm::StringRef;

namespace {

class WeightsTest : public ScratchDirTest {};

TEST_F(WeightsTest, RoundTripF32AndBf16) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState saved = makeState(plan, 1);
  for (StDType dtype : {StDType::F32, StDType::BF16}) {
    std::string out = path(std::string("w-") + stDTypeName(dtype));
    SaveWeightsOptions options;
    options.dtype = dtype;
    ASSERT_EQ(errorText(saveWeights(plan, saved, out, options)), "");
    EXPECT_TRUE(llvm::sys::fs::exists(out + "/" + kWeightsFile.str()));
    EXPECT_FALSE(llvm::sys::fs::exists(out + "/" + kWeightsIndexFile.str()));
    // The model config plus what the run records about its attention.
    llvm::Expected<llvm::json::Value> config =
        llvm::json::parse(readAll(out + "/config.json"));
    ASSERT_TRUE(!!config) << llvm::toString(config.takeError());
    llvm::json::Value expected = llvm::cantFail(llvm::json::parse(
        R"({"_class_name": "WanTransformer3DModel", "num_layers": 1,
            "in_channels": 2, "_megaslide": {"format": 1,
            "attention": "global", "grid": [], "global_layers": []}})"));
    EXPECT_EQ(*config, expected);

    HostState loaded = makeState(plan, 2);
    ASSERT_EQ(errorText(loadWeights(out, loaded)), "");
    for (const HostTensor &t : saved.tensors) {
      const HostTensor &l = get(loaded, t.param->name);
      if (t.param->role == "moment") {
        // Weights do not touch the optimizer state.
        EXPECT_TRUE(
            bitEqual(l.data, get(makeState(plan, 2), t.param->name).data));
        continue;
      }
      std::vector<float> want = t.data;
      if (dtype == StDType::BF16)
        for (float &f : want)
          f = cpu::bf16ToFloat(cpu::floatToBf16(f));
      EXPECT_TRUE(bitEqual(l.data, want)) << t.param->name;
    }
    // The file alone loads too; it carries only weights.
    HostState again = makeState(plan, 3);
    ASSERT_EQ(errorText(loadWeights(out + "/" + kWeightsFile.str(), again)),
              "");
    auto reader = SafetensorsReader::open(out + "/" + kWeightsFile.str());
    ASSERT_TRUE(!!reader);
    EXPECT_EQ((*reader)->tensors().size(), 7u);
    EXPECT_EQ((*reader)->metadata().at("format"), "pt");
  }
}

/// Appends an instruction to `plan` with fresh f32 results; returns them.
static std::vector<int64_t> addOp(exec::ExecPlan &plan, exec::OpCode op,
                                  std::vector<int64_t> operands, int results,
                                  std::optional<int64_t> layer) {
  exec::Instruction inst;
  inst.op = op;
  inst.operands = std::move(operands);
  inst.layer = layer;
  for (int i = 0; i < results; ++i) {
    inst.results.push_back(static_cast<int64_t>(plan.values.size()));
    plan.values.emplace_back();
  }
  plan.instructions.push_back(inst);
  return plan.instructions.back().results;
}

// Tests that the record names the 3D-DSA configuration of the plan's
// dsa3d_offsets ops and their blocks, and as global only the attentions
// over RoPE'd queries and keys (through a reshape), not cross-attention.
TEST_F(WeightsTest, RunConfigRecordsDsaAndGlobalSelfAttention) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  plan.grid = {4, 6, 6};
  plan.values.resize(2); // q, k inputs
  for (int64_t layer : {0, 1}) {
    int64_t q = addOp(plan, exec::OpCode::Rope3d, {0}, 1, layer)[0];
    int64_t k = addOp(plan, exec::OpCode::Rope3d, {1}, 1, layer)[0];
    if (layer == 0) {
      int64_t off =
          addOp(plan, exec::OpCode::Dsa3dOffsets, {q, k}, 1, layer)[0];
      exec::Instruction &o = plan.instructions.back();
      o.attrs["window"] = std::vector<int64_t>{2, 3, 3};
      o.attrs["tile"] = std::vector<int64_t>{1, 2, 2};
      o.attrs["radius"] = int64_t(2);
      addOp(plan, exec::OpCode::Dsa3d, {q, k, k, off}, 2, layer);
    } else {
      int64_t viewed = addOp(plan, exec::OpCode::Reshape, {k}, 1, layer)[0];
      addOp(plan, exec::OpCode::Attention, {q, viewed, viewed}, 1, layer);
    }
    // Cross-attention: the keys are text, not RoPE'd.
    addOp(plan, exec::OpCode::Attention, {q, 1, 1}, 1, layer);
  }
  llvm::Expected<llvm::json::Object> record = runConfigOf({&plan});
  ASSERT_TRUE(!!record) << llvm::toString(record.takeError());
  llvm::json::Value expected = llvm::cantFail(llvm::json::parse(
      R"({"format": 1, "attention": "dsa", "grid": [4, 6, 6],
          "dsa3d": {"window": [2, 3, 3], "tile": [1, 2, 2], "radius": 2,
                    "layers": [0]},
          "global_layers": [1]})"));
  EXPECT_EQ(llvm::json::Value(std::move(*record)), expected);

  // Two configurations cannot be recorded as one.
  exec::ExecPlan mixed = plan;
  for (exec::Instruction &inst : mixed.instructions)
    if (inst.op == exec::OpCode::Dsa3dOffsets)
      inst.attrs["radius"] = int64_t(3);
  mixed.instructions.push_back(plan.instructions[2]);
  EXPECT_EQ(errorText(runConfigOf({&mixed}).takeError()),
            "the plan's 3D-DSA ops differ in their 'radius'; config.json "
            "records one");

  // Buckets: a plan whose grid keeps every block global, listed first,
  // does not hide the 3D-DSA the other bucket trained; block 0 runs it
  // wherever the grid allows, so it is not recorded as global.
  exec::ExecPlan small = makePlan(defaultSpecs());
  small.grid = {1, 6, 6};
  small.values.resize(2);
  for (int64_t layer : {0, 1}) {
    int64_t q = addOp(small, exec::OpCode::Rope3d, {0}, 1, layer)[0];
    int64_t k = addOp(small, exec::OpCode::Rope3d, {1}, 1, layer)[0];
    addOp(small, exec::OpCode::Attention, {q, k, k}, 1, layer);
  }
  llvm::Expected<llvm::json::Object> both = runConfigOf({&small, &plan});
  ASSERT_TRUE(!!both) << llvm::toString(both.takeError());
  EXPECT_EQ(llvm::json::Value(std::move(*both)),
            llvm::cantFail(llvm::json::parse(
                R"({"format": 1, "attention": "dsa",
                    "grids": [[1, 6, 6], [4, 6, 6]],
                    "dsa3d": {"window": [2, 3, 3], "tile": [1, 2, 2],
                              "radius": 2, "layers": [0]},
                    "global_layers": [1]})")));
  // Buckets whose 3D-DSA differs cannot be recorded as one either.
  EXPECT_EQ(errorText(runConfigOf({&plan, &mixed}).takeError()),
            "the plan's 3D-DSA ops differ in their 'radius'; config.json "
            "records one");
}

TEST_F(WeightsTest, ShardedWithIndex) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState saved = makeState(plan, 4);
  std::string out = path("sharded");
  SaveWeightsOptions options;
  // patch_embedding.weight is 128 bytes: a tensor over the limit gets a
  // shard of its own; the rest pack up to 64 bytes per shard.
  options.maxShardBytes = 64;
  ASSERT_EQ(errorText(saveWeights(plan, saved, out, options)), "");
  EXPECT_FALSE(llvm::sys::fs::exists(out + "/" + kWeightsFile.str()));
  auto index = llvm::json::parse(readAll(out + "/" + kWeightsIndexFile.str()));
  ASSERT_TRUE(!!index);
  const llvm::json::Object *root = index->getAsObject();
  EXPECT_EQ(root->getObject("metadata")->getInteger("total_size"),
            (32 + 4 + 16 + 24 + 12 + 1 + 0) * 4);
  const llvm::json::Object *map = root->getObject("weight_map");
  ASSERT_NE(map, nullptr);
  EXPECT_EQ(map->size(), 7u);
  // Bytes in plan order, one shard each: 128 (over the limit, alone) | 16
  // (q would overflow) | 64 | 96 | 48 + 4 + 0.
  EXPECT_EQ(map->getString("patch_embedding.weight"),
            "diffusion_pytorch_model-00001-of-00005.safetensors");
  EXPECT_EQ(map->getString("patch_embedding.bias"),
            "diffusion_pytorch_model-00002-of-00005.safetensors");
  EXPECT_EQ(map->getString("blocks.0.attn1.to_q.weight"),
            "diffusion_pytorch_model-00003-of-00005.safetensors");
  EXPECT_EQ(map->getString("blocks.0.scale_shift_table"),
            "diffusion_pytorch_model-00004-of-00005.safetensors");
  EXPECT_EQ(map->getString("pos_embed"),
            "diffusion_pytorch_model-00005-of-00005.safetensors");
  EXPECT_EQ(map->getString("scalar"),
            "diffusion_pytorch_model-00005-of-00005.safetensors");
  EXPECT_EQ(map->getString("empty"),
            "diffusion_pytorch_model-00005-of-00005.safetensors");

  HostState loaded = makeState(plan, 5);
  ASSERT_EQ(errorText(loadWeights(out, loaded)), "");
  for (const HostTensor &t : saved.tensors) {
    if (t.param->role != "moment") {
      EXPECT_TRUE(bitEqual(get(loaded, t.param->name).data, t.data))
          << t.param->name;
    }
  }

  // Saving unsharded into the same directory removes the old shards and
  // index, which would otherwise take precedence.
  std::ofstream(out + "/keep-me.txt") << "user file";
  ASSERT_EQ(errorText(saveWeights(plan, loaded, out)), "");
  EXPECT_FALSE(llvm::sys::fs::exists(out + "/" + kWeightsIndexFile.str()));
  EXPECT_FALSE(llvm::sys::fs::exists(
      out + "/diffusion_pytorch_model-00001-of-00005.safetensors"));
  EXPECT_TRUE(llvm::sys::fs::exists(out + "/keep-me.txt"));
  std::error_code ec;
  for (llvm::sys::fs::directory_iterator it(out, ec), end; it != end && !ec;
       it.increment(ec))
    EXPECT_FALSE(llvm::sys::path::filename(it->path()).starts_with("."))
        << it->path();
}

TEST_F(WeightsTest, IndexErrors) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 6);
  std::string out = path("idx");
  SaveWeightsOptions options;
  options.maxShardBytes = 64;
  ASSERT_EQ(errorText(saveWeights(plan, state, out, options)), "");
  std::string indexPath = out + "/" + kWeightsIndexFile.str();
  std::string original = readAll(indexPath);

  auto withIndex = [&](StringRef from, StringRef to) {
    std::string text = original;
    size_t at = text.find(from.str());
    EXPECT_NE(at, std::string::npos) << from.str();
    text.replace(at, from.size(), to.str());
    writeAll(indexPath, text);
    return errorText(loadWeights(out, state));
  };
  std::string e =
      withIndex("diffusion_pytorch_model-00001-of-00005.safetensors",
                "../escape.safetensors");
  EXPECT_NE(e.find("not a file of the directory"), std::string::npos) << e;
  e = withIndex("\"patch_embedding.bias\": "
                "\"diffusion_pytorch_model-00002-of-00005.safetensors\"",
                "\"patch_embedding.bias\": "
                "\"diffusion_pytorch_model-00003-of-00005.safetensors\"");
  EXPECT_NE(e.find("maps tensor 'patch_embedding.bias'"), std::string::npos)
      << e;
  e = withIndex("\"weight_map\"", "\"weights\"");
  EXPECT_NE(e.find("no 'weight_map'"), std::string::npos) << e;
  writeAll(indexPath, original);
  llvm::sys::fs::remove(out +
                        "/diffusion_pytorch_model-00004-of-00005.safetensors");
  e = errorText(loadWeights(out, state));
  EXPECT_NE(e.find("00004-of-00005.safetensors"), std::string::npos) << e;

  std::string empty = path("empty-dir");
  llvm::sys::fs::create_directories(empty + "/transformer");
  e = errorText(loadWeights(empty, state));
  EXPECT_NE(e.find("has neither"), std::string::npos) << e;
  EXPECT_NE(e.find("'transformer' subdirectory"), std::string::npos) << e;
}

TEST_F(WeightsTest, MismatchListsEverythingAtOnce) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 7);
  std::string out = path("mismatch");
  ASSERT_EQ(errorText(saveWeights(plan, state, out)), "");

  // The model the weights are loaded into: one tensor renamed, one
  // reshaped, eight new ones.
  std::vector<ParamSpec> other = defaultSpecs();
  other[2].name = "blocks.0.attn1.to_k.weight";
  other[3].shape = {1, 4, 6};
  for (int i = 0; i < 8; ++i)
    other.push_back({"extra." + std::to_string(i), {2}});
  exec::ExecPlan otherPlan = makePlan(other);
  HostState target = makeState(otherPlan, 8);
  HostState before = makeState(otherPlan, 8);
  std::string e = errorText(loadWeights(out, target));
  EXPECT_NE(e.find("'" + out +
                   "' does not match the model (15 tensors "
                   "expected)"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("9 missing: blocks.0.attn1.to_k.weight, extra.0, extra.1, "
                   "extra.2, extra.3, ... (4 more)"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("1 unexpected (not in the model): "
                   "blocks.0.attn1.to_q.weight"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("1 with a different shape: blocks.0.scale_shift_table "
                   "(file [1, 6, 4], model [1, 4, 6])"),
            std::string::npos)
      << e;
  // Nothing was loaded.
  for (const HostTensor &t : target.tensors)
    EXPECT_TRUE(bitEqual(t.data, get(before, t.param->name).data));

  // A checkpoint's moments are not weights.
  std::vector<float> m(4);
  ASSERT_EQ(errorText(writeSafetensors(
                path("moments.safetensors"),
                {{"patch_embedding.bias.exp_avg", {4}, m.data()}})),
            "");
  e = errorText(loadWeights(path("moments.safetensors"), state));
  EXPECT_NE(e.find("unexpected (not in the model): "
                   "patch_embedding.bias.exp_avg"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("7 missing"), std::string::npos) << e;
}

TEST_F(WeightsTest, SaveFailureLeavesDirectory) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 9);
  writeAll(path("file"), "not a directory");
  std::string e = errorText(saveWeights(plan, state, path("file/sub")));
  EXPECT_NE(e.find("file/sub"), std::string::npos) << e;
  SaveWeightsOptions options;
  options.dtype = StDType::F16;
  EXPECT_NE(errorText(saveWeights(plan, state, path("x"), options)).find("F16"),
            std::string::npos);
}

TEST_F(WeightsTest, IndexIsBounded) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 4);
  std::string index = path(kWeightsIndexFile);
  writeSparse(index, "{", kMaxWeightsIndexBytes + 1);
  EXPECT_EQ(errorText(loadWeights(dir, state)),
            llvm::formatv("cannot read '{0}': it is {1} bytes, over the "
                          "limit of {2} bytes",
                          index, kMaxWeightsIndexBytes + 1,
                          kMaxWeightsIndexBytes)
                .str());
  ASSERT_EQ(::unlink(index.c_str()), 0);
  ASSERT_EQ(::mkfifo(index.c_str(), 0600), 0);
  FifoWatch watch(index);
  EXPECT_EQ(errorText(loadWeights(dir, state)),
            "cannot read '" + index +
                "': it is a FIFO (named pipe), not a regular file");
  EXPECT_FALSE(watch.openedByReader()) << "a reader opened the index";
}

} // namespace
