//===- Weights.cpp - diffusers-format model weights -----------------------===//

#include "megaslide/runtime/host/Weights.h"

#include "megaslide/runtime/dist/Collectives.h"

#include "megaslide/runtime/cpu/Finite.h"
#include "megaslide/runtime/host/Files.h"
#include "megaslide/runtime/support/AtomicFile.h"
#include "megaslide/runtime/support/Json.h"
#include "megaslide/runtime/support/ReadFile.h"
#include "megaslide/runtime/support/Shape.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringSet.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Regex.h"
#include "llvm/Support/raw_ostream.h"

#include <set>

using namespace megaslide;
using namespace megaslide::host;
using llvm::Error;
using llvm::StringRef;

namespace {

const HostTensor *lookup(const HostState &state, StringRef name) {
  auto it = state.index.find(name);
  return it == state.index.end() ? nullptr : &state.tensors[it->second];
}

/// "3 missing: a, b, c" with at most `kListed` names and "(N more)".
constexpr size_t kListed = 5;
void appendList(std::string &out, StringRef what,
                const std::vector<std::string> &items) {
  if (items.empty())
    return;
  out += llvm::formatv("\n  {0} {1}: ", items.size(), what).str();
  for (size_t i = 0; i < items.size() && i < kListed; ++i)
    out += (i ? ", " : "") + items[i];
  if (items.size() > kListed)
    out += llvm::formatv(", ... ({0} more)", items.size() - kListed).str();
}

/// The weight shard names diffusers writes and reads.
bool isWeightsFileName(StringRef name) {
  static const llvm::Regex re("^diffusion_pytorch_model(-[0-9]{5}-of-[0-9]{5})"
                              "?\\.safetensors(\\.index\\.json)?$");
  return re.match(name);
}

} // namespace

bool host::isWeightParam(const exec::Param &param) {
  return param.role == "master" || param.role == "frozen";
}

Error host::checkTensorSet(
    StringRef source, const llvm::StringMap<FoundTensor> &found,
    const HostState &state,
    llvm::function_ref<bool(const exec::Param &)> wanted) {
  std::vector<std::string> missing, unexpected, mismatched, unreadable;
  size_t expected = 0;
  for (const HostTensor &t : state.tensors) {
    if (!t.param || !wanted(*t.param))
      continue;
    ++expected;
    auto it = found.find(t.param->name);
    if (it == found.end()) {
      missing.push_back(t.param->name);
      continue;
    }
    const StTensorInfo &info = *it->second.info;
    if (info.shape != t.param->type.shape)
      mismatched.push_back(llvm::formatv("{0} (file {1}, model {2})",
                                         t.param->name, shapeString(info.shape),
                                         shapeString(t.param->type.shape)));
    else if (info.dtype != StDType::F32 && info.dtype != StDType::BF16 &&
             info.dtype != StDType::F16)
      unreadable.push_back(t.param->name + " (" + stDTypeName(info.dtype) +
                           ")");
  }
  for (const auto &kv : found) {
    const HostTensor *t = lookup(state, kv.first());
    if (!t || !t->param || !wanted(*t->param))
      unexpected.push_back(kv.first().str());
  }
  if (missing.empty() && unexpected.empty() && mismatched.empty() &&
      unreadable.empty())
    return Error::success();
  // Name order, so that messages are stable.
  llvm::sort(missing);
  llvm::sort(unexpected);
  llvm::sort(mismatched);
  llvm::sort(unreadable);
  std::string message =
      llvm::formatv("'{0}' does not match the model ({1} tensors expected):",
                    source, expected)
          .str();
  appendList(message, "missing", missing);
  appendList(message, "unexpected (not in the model)", unexpected);
  appendList(message, "with a different shape", mismatched);
  appendList(message, "with a dtype other than F32/BF16/F16", unreadable);
  return error(message);
}

//===----------------------------------------------------------------------===//
// Saving
//===----------------------------------------------------------------------===//

llvm::Expected<llvm::json::Object>
host::runConfigOf(llvm::ArrayRef<const exec::ExecPlan *> plans) {
  using exec::OpCode;
  std::set<int64_t> dsaLayers, globalLayers;
  const exec::Instruction *first = nullptr;
  for (const exec::ExecPlan *planPtr : plans) {
    const exec::ExecPlan &plan = *planPtr;
    std::vector<int64_t> def(plan.values.size(), -1);
    for (size_t i = 0; i < plan.instructions.size(); ++i)
      for (int64_t r : plan.instructions[i].results)
        if (r >= 0 && r < static_cast<int64_t>(def.size()))
          def[r] = static_cast<int64_t>(i);
    // The op that made a value, looking through views and copies.
    auto producer = [&](int64_t id) -> const exec::Instruction * {
      while (id >= 0 && id < static_cast<int64_t>(def.size()) &&
             def[id] >= 0) {
        const exec::Instruction &inst = plan.instructions[def[id]];
        if ((inst.op != OpCode::Reshape && inst.op != OpCode::HostToDevice &&
             inst.op != OpCode::DeviceToHost) ||
            inst.operands.size() != 1)
          return &inst;
        id = inst.operands[0];
      }
      return nullptr;
    };
    auto isRope = [&](int64_t id) {
      const exec::Instruction *p = producer(id);
      return p && p->op == OpCode::Rope3d;
    };
    for (const exec::Instruction &inst : plan.instructions) {
      if (inst.op == OpCode::Attention && inst.operands.size() >= 2 &&
          isRope(inst.operands[0]) && isRope(inst.operands[1]) && inst.layer)
        globalLayers.insert(*inst.layer);
      if (inst.op != OpCode::Dsa3dOffsets)
        continue;
      if (inst.layer)
        dsaLayers.insert(*inst.layer);
      if (!first) {
        first = &inst;
        continue;
      }
      for (StringRef key : {"window", "tile"})
        if (inst.intsAttr(key) != first->intsAttr(key))
          return error(llvm::formatv("the plan's 3D-DSA ops differ in their "
                                     "'{0}'; config.json records one",
                                     key));
      if (inst.intAttr("radius") != first->intAttr("radius"))
        return error("the plan's 3D-DSA ops differ in their 'radius'; "
                     "config.json records one");
    }
  }
  // A block global in one bucket (a grid under the window) and 3D-DSA in
  // another runs 3D-DSA wherever the grid allows: the processor applies
  // the planner's rule per forward.
  for (int64_t l : dsaLayers)
    globalLayers.erase(l);
  auto ints = [](const auto &values) {
    llvm::json::Array a;
    for (int64_t v : values)
      a.push_back(v);
    return a;
  };
  llvm::json::Object record{{"format", 1},
                            {"attention", first ? "dsa" : "global"},
                            {"global_layers", ints(globalLayers)}};
  if (plans.size() == 1) {
    record["grid"] = ints(plans[0]->grid);
  } else {
    llvm::json::Array grids;
    for (const exec::ExecPlan *plan : plans)
      grids.push_back(ints(plan->grid));
    record["grids"] = std::move(grids);
  }
  if (first) {
    std::optional<std::vector<int64_t>> window = first->intsAttr("window"),
                                        tile = first->intsAttr("tile");
    std::optional<int64_t> radius = first->intAttr("radius");
    if (!window || !tile || !radius)
      return error("the plan's dsa3d_offsets op lacks its window, tile or "
                   "radius");
    record["dsa3d"] = llvm::json::Object{{"window", ints(*window)},
                                         {"tile", ints(*tile)},
                                         {"radius", *radius},
                                         {"layers", ints(dsaLayers)}};
  }
  return record;
}

Error host::saveWeights(const exec::ExecPlan &plan, const HostState &state,
                        StringRef dir, const SaveWeightsOptions &options) {
  if (options.dtype != StDType::F32 && options.dtype != StDType::BF16)
    return error(llvm::Twine("cannot save weights as ") +
                 stDTypeName(options.dtype) + ": F32 or BF16");
  if (options.maxShardBytes == 0)
    return error("cannot save weights: the shard size limit must be positive");

  // Shard as huggingface_hub does: in order, a new shard when the next
  // tensor would overflow the current one.
  std::vector<std::vector<StTensorToWrite>> shards(1);
  std::vector<std::vector<const HostTensor *>> sources(1);
  std::vector<uint64_t> shardBytes(1, 0);
  uint64_t totalBytes = 0;
  for (const HostTensor &t : state.tensors) {
    if (!t.param || !isWeightParam(*t.param))
      continue;
    int64_t elements = t.param->type.numElements();
    if (static_cast<int64_t>(t.data.size()) != t.held())
      return error(llvm::formatv("cannot save weights: tensor '{0}' holds "
                                 "{1} values, its shape {2} needs {3}",
                                 t.param->name, t.data.size(),
                                 shapeString(t.param->type.shape), t.held()));
    uint64_t bytes = static_cast<uint64_t>(elements) *
                     static_cast<uint64_t>(stDTypeBytes(options.dtype));
    if (!shards.back().empty() &&
        shardBytes.back() + bytes > options.maxShardBytes) {
      shards.emplace_back();
      sources.emplace_back();
      shardBytes.push_back(0);
    }
    shards.back().push_back(
        {t.param->name, t.param->type.shape, t.data.data(), options.dtype});
    sources.back().push_back(&t);
    shardBytes.back() += bytes;
    totalBytes += bytes;
  }

  // A job's sharded tensors are gathered to rank 0 one file at a time, as
  // it writes them: no rank ever holds the whole model.
  dist::Collectives *job = options.job;
  std::vector<std::vector<float>> gathered;
  auto gatherFile = [&](size_t i) -> Error {
    gathered.clear();
    bool root = job->rank() == 0;
    for (size_t k = 0; k < shards[i].size(); ++k) {
      const HostTensor &t = *sources[i][k];
      if (!t.sharded)
        continue;
      gathered.emplace_back(root ? t.param->type.numElements() : 0);
      if (Error e = job->gatherShardsToRank0(
              t.data, t.param->type.numElements(), gathered.back().data()))
        return e;
      shards[i][k].data = gathered.back().data();
    }
    return Error::success();
  };
  if (job && job->rank() != 0) { // rank 0 writes
    for (size_t i = 0; i < shards.size(); ++i)
      if (Error e = gatherFile(i))
        return e;
    return Error::success();
  }

  std::vector<std::string> created;
  if (Error e = prepareOutputDirectory(dir, &created))
    return e;
  // Every file is written and synced under a temporary name first and
  // replaces its destination only once all of them are complete, so a full
  // disk leaves the files of `dir` as they were; the folders this call
  // created go again.
  std::vector<std::string> finals;
  std::vector<std::unique_ptr<AtomicFile>> files;
  auto fail = [&](Error e) {
    files.clear(); // removes the temporaries
    removeCreatedDirectories(created);
    return e;
  };
  auto openOutput = [&](StringRef name) -> llvm::Expected<AtomicFile *> {
    llvm::Expected<std::unique_ptr<AtomicFile>> file =
        AtomicFile::create(joinPath(dir, name));
    if (!file)
      return file.takeError();
    finals.push_back(name.str());
    files.push_back(std::move(*file));
    return files.back().get();
  };

  llvm::Expected<llvm::json::Value> parsed =
      parseJson(plan.modelConfig.empty() ? "{}" : plan.modelConfig);
  if (!parsed)
    return error("cannot save weights: the plan's model config is not JSON: " +
                 llvm::toString(parsed.takeError()));
  llvm::json::Object *configObject = parsed->getAsObject();
  if (!configObject)
    return error("cannot save weights: the plan's model config is not a "
                 "JSON object");
  std::vector<const exec::ExecPlan *> runPlans = options.runPlans;
  if (runPlans.empty())
    runPlans.push_back(&plan);
  llvm::Expected<llvm::json::Object> record = runConfigOf(runPlans);
  if (!record)
    return error("cannot save weights: " + llvm::toString(record.takeError()));
  (*configObject)[kRunConfigKey] = std::move(*record);
  std::string config =
      llvm::formatv("{0:2}", llvm::json::Value(std::move(*parsed))).str() +
      "\n";
  llvm::Expected<AtomicFile *> configFile = openOutput(kWeightsConfigFile);
  if (!configFile)
    return fail(configFile.takeError());
  if (Error e = (*configFile)->write(config.data(), config.size()))
    return fail(std::move(e));

  SafetensorsWriteOptions writeOptions;
  writeOptions.metadata["format"] = "pt"; // what diffusers/transformers write
  size_t n = shards.size();
  llvm::json::Object weightMap;
  for (size_t i = 0; i < n; ++i) {
    std::string name =
        n == 1 ? kWeightsFile.str()
               : llvm::formatv("diffusion_pytorch_model-{0:d5}-of-{1:d5}"
                               ".safetensors",
                               i + 1, n)
                     .str();
    for (const StTensorToWrite &t : shards[i])
      weightMap[t.name] = name;
    llvm::Expected<AtomicFile *> shard = openOutput(name);
    if (!shard)
      return fail(shard.takeError());
    if (job)
      if (Error e = gatherFile(i))
        return fail(std::move(e));
    if (Error e = writeSafetensors(**shard, shards[i], writeOptions))
      return fail(std::move(e));
    gathered.clear();
  }
  if (n > 1) {
    llvm::json::Object index{
        {"metadata",
         llvm::json::Object{{"total_size", static_cast<int64_t>(totalBytes)}}},
        {"weight_map", std::move(weightMap)}};
    std::string text =
        llvm::formatv("{0:2}", llvm::json::Value(std::move(index))).str() +
        "\n";
    llvm::Expected<AtomicFile *> indexFile = openOutput(kWeightsIndexFile);
    if (!indexFile)
      return fail(indexFile.takeError());
    if (Error e = (*indexFile)->write(text.data(), text.size()))
      return fail(std::move(e));
  }

  for (std::unique_ptr<AtomicFile> &file : files)
    if (Error e = file->finish())
      return fail(std::move(e));
  for (std::unique_ptr<AtomicFile> &file : files)
    if (Error e = file->commit())
      return fail(std::move(e));

  // Weight files of an earlier save that this one replaces (diffusers'
  // save_pretrained does the same): a stale index next to a new single
  // file, or shards of another count, would be loaded instead of ours.
  std::error_code ec;
  std::vector<std::string> stale;
  for (llvm::sys::fs::directory_iterator it(dir, ec), end; it != end && !ec;
       it.increment(ec)) {
    StringRef name = llvm::sys::path::filename(it->path());
    if (isWeightsFileName(name) && !llvm::is_contained(finals, name))
      stale.push_back(it->path());
  }
  for (const std::string &path : stale)
    if (std::error_code rm = llvm::sys::fs::remove(path))
      return error("cannot remove stale weights file '" + path +
                   "': " + rm.message());
  return Error::success();
}

//===----------------------------------------------------------------------===//
// Loading
//===----------------------------------------------------------------------===//

namespace {

/// The shard files an index names, checked; `weightMap` receives it.
llvm::Expected<std::vector<std::string>>
readIndex(StringRef indexPath,
          std::vector<std::pair<std::string, std::string>> &weightMap) {
  llvm::Expected<std::string> text =
      readBoundedFile(indexPath, kMaxWeightsIndexBytes, "");
  if (!text)
    return text.takeError();
  auto bad = [&](const llvm::Twine &what) {
    return error("'" + indexPath + "': " + what);
  };
  llvm::Expected<llvm::json::Value> json = parseJson(*text);
  if (!json)
    return bad("not valid JSON: " + llvm::toString(json.takeError()));
  const llvm::json::Object *root = json->getAsObject();
  const llvm::json::Object *map =
      root ? root->getObject("weight_map") : nullptr;
  if (!map)
    return bad("no 'weight_map' object");
  llvm::StringSet<> files;
  for (const auto &kv : *map) {
    std::optional<StringRef> file = kv.second.getAsString();
    if (!file)
      return bad("weight_map entry '" + kv.first.str() +
                 "' is not a file name");
    // A file name, not a path: an index must not reach outside its folder.
    if (file->empty() || *file == "." || *file == ".." || file->contains('/') ||
        file->contains('\\'))
      return bad("weight_map entry '" + kv.first.str() + "' names '" + *file +
                 "', not a file of the directory");
    weightMap.emplace_back(kv.first.str(), file->str());
    files.insert(*file);
  }
  std::vector<std::string> result;
  for (const auto &f : files)
    result.push_back(f.getKey().str());
  llvm::sort(result);
  llvm::sort(weightMap);
  return result;
}

} // namespace

llvm::ArrayRef<llvm::StringLiteral> host::architectureKeys() {
  static const llvm::StringLiteral keys[] = {
      "num_layers",      "num_attention_heads", "attention_head_dim",
      "ffn_dim",         "text_dim",            "freq_dim",
      "in_channels",     "out_channels",        "patch_size",
      "qk_norm",         "cross_attn_norm",     "image_dim",
      "added_kv_proj_dim", "pos_embed_seq_len"};
  return keys;
}

namespace {

/// The weights folder's config.json against the plan's model config: the
/// architecture keys both give must agree.
Error checkArchitecture(StringRef dir, const exec::ExecPlan &plan) {
  std::string path = joinPath(dir, kWeightsConfigFile);
  if (!llvm::sys::fs::is_regular_file(path))
    return Error::success(); // no record to check against
  llvm::Expected<std::string> text =
      readBoundedFile(path, int64_t(16) << 20, "weights config");
  if (!text)
    return text.takeError();
  llvm::Expected<llvm::json::Value> theirs = parseJson(*text);
  if (!theirs || !theirs->getAsObject()) {
    if (!theirs)
      llvm::consumeError(theirs.takeError());
    return error("weights config '" + path + "' is not a JSON object");
  }
  llvm::Expected<llvm::json::Value> ours =
      parseJson(plan.modelConfig.empty() ? "{}" : plan.modelConfig);
  if (!ours || !ours->getAsObject()) {
    if (!ours)
      llvm::consumeError(ours.takeError());
    return Error::success(); // a hand-made plan without a config
  }
  std::string differences;
  auto show = [](const llvm::json::Value &v) {
    return llvm::formatv("{0}", v).str();
  };
  for (llvm::StringRef key : architectureKeys()) {
    const llvm::json::Value *a = theirs->getAsObject()->get(key);
    const llvm::json::Value *b = ours->getAsObject()->get(key);
    if (!a || !b || *a == *b)
      continue;
    // 4 and 4.0 are one value.
    if (a->getAsNumber() && b->getAsNumber() &&
        *a->getAsNumber() == *b->getAsNumber())
      continue;
    differences += "\n  " + key.str() + ": weights " + show(*a) + ", model " +
                   show(*b);
  }
  if (differences.empty())
    return Error::success();
  return error("weights '" + dir + "' are of another model (" + path +
               "):" + differences +
               "\nload weights of the planned model, or plan the weights' "
               "model (--model " +
               path + ")");
}

} // namespace

Error host::loadWeights(StringRef path, HostState &state,
                        const exec::ExecPlan *plan) {
  if (plan && llvm::sys::fs::is_directory(path))
    if (Error e = checkArchitecture(path, *plan))
      return e;
  std::vector<std::unique_ptr<SafetensorsReader>> files;
  auto openFile = [&](StringRef file) -> Error {
    llvm::Expected<std::unique_ptr<SafetensorsReader>> reader =
        SafetensorsReader::open(file);
    if (!reader)
      return reader.takeError();
    files.push_back(std::move(*reader));
    return Error::success();
  };

  std::vector<std::pair<std::string, std::string>> weightMap;
  bool indexed = false;
  std::string indexPath;
  if (!llvm::sys::fs::is_directory(path)) {
    if (!llvm::sys::fs::exists(path))
      return error("weights '" + path + "' do not exist");
    if (Error e = openFile(path))
      return e;
  } else {
    indexPath = joinPath(path, kWeightsIndexFile);
    std::string single = joinPath(path, kWeightsFile);
    if (llvm::sys::fs::exists(indexPath)) {
      indexed = true;
      llvm::Expected<std::vector<std::string>> shardNames =
          readIndex(indexPath, weightMap);
      if (!shardNames)
        return shardNames.takeError();
      for (const std::string &name : *shardNames)
        if (Error e = openFile(joinPath(path, name)))
          return e;
    } else if (llvm::sys::fs::exists(single)) {
      if (Error e = openFile(single))
        return e;
    } else {
      std::string hint;
      if (llvm::sys::fs::is_directory(joinPath(path, "transformer")))
        hint = "; for a diffusers pipeline pass its 'transformer' "
               "subdirectory";
      return error("'" + path + "' has neither " + kWeightsFile + " nor " +
                   kWeightsIndexFile + hint);
    }
  }

  llvm::StringMap<FoundTensor> found;
  llvm::StringMap<const SafetensorsReader *> fileByName;
  for (const auto &file : files) {
    fileByName[llvm::sys::path::filename(file->path())] = file.get();
    for (const StTensorInfo &info : file->tensors()) {
      auto [it, inserted] =
          found.try_emplace(info.name, FoundTensor{file.get(), &info});
      if (!inserted)
        return error("tensor '" + info.name + "' is in both '" +
                     it->second.file->path() + "' and '" + file->path() + "'");
    }
  }
  if (indexed) {
    // The index and the shards must agree, or loading would depend on
    // which one a reader trusts.
    llvm::StringSet<> listed;
    for (const auto &[name, file] : weightMap) {
      listed.insert(name);
      auto it = found.find(name);
      if (it == found.end() ||
          llvm::sys::path::filename(it->second.file->path()) != file)
        return error("'" + indexPath + "' maps tensor '" + name + "' to '" +
                     file + "', which does not hold it");
    }
    for (const auto &kv : found)
      if (!listed.contains(kv.first()))
        return error("tensor '" + kv.first() + "' of '" +
                     kv.second.file->path() + "' is not in '" + indexPath +
                     "'");
  }

  if (Error e = checkTensorSet(path, found, state, isWeightParam))
    return e;

  // File by file in data order: sequential reads.
  for (const auto &file : files) {
    for (const StTensorInfo &info : file->tensors()) {
      HostTensor &t = state.tensors[state.index.find(info.name)->second];
      // A rank of a job keeps its shard: one tensor whole at a time.
      std::vector<float> whole;
      std::vector<float> &values = t.sharded ? whole : t.data;
      values.resize(static_cast<size_t>(info.numElements()));
      if (Error e = file->readF32(info, values))
        return e;
      if (std::optional<int64_t> bad =
              cpu::firstNonFinite(values.data(), values.size()))
        return error(llvm::formatv("'{0}': tensor '{1}' holds {2} at element "
                                   "{3}; weights must be finite",
                                   file->path(), info.name, values[*bad],
                                   *bad));
      if (t.sharded)
        t.keep(whole);
    }
  }
  return Error::success();
}
