//===- HostState.cpp - The model state in host memory ---------------------===//

#include "megaslide/runtime/host/HostState.h"

#include "megaslide/runtime/host/NvmeTier.h"

#include "megaslide/runtime/cpu/Convert.h"
#include "megaslide/runtime/cpu/HalfFloat.h"
#include "megaslide/runtime/cpu/LeanAdamW.h"
#include "megaslide/runtime/dist/Collectives.h"

#include "megaslide/runtime/train/Random.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <sys/resource.h>
#include <unistd.h>

using namespace megaslide;
using namespace megaslide::host;

HostTensor *HostState::find(llvm::StringRef name) {
  auto it = index.find(name);
  return it == index.end() ? nullptr : &tensors[it->second];
}

const HostTensor *HostState::find(llvm::StringRef name) const {
  auto it = index.find(name);
  return it == index.end() ? nullptr : &tensors[it->second];
}

HostTensor &HostState::addTensor(exec::Param param, const HostTensor *like,
                                 bool allocate) {
  ownParams.push_back(std::move(param));
  const exec::Param &p = ownParams.back();
  index[p.name] = tensors.size();
  HostTensor t;
  t.param = &p;
  if (like) {
    t.sharded = like->sharded;
    t.shardBegin = like->shardBegin;
    t.shardEnd = like->shardEnd;
  }
  if (allocate && p.type.dtype == exec::DType::BF16)
    t.bf16.assign(t.held(), 0);
  else if (allocate)
    t.data.assign(t.held(), 0.0f);
  tensors.push_back(std::move(t));
  return tensors.back();
}

void HostTensor::keep(llvm::ArrayRef<float> whole) {
  data.assign(whole.begin() + heldBegin(), whole.begin() + heldEnd());
}

bool host::shardedRole(llvm::StringRef role, int ranks) {
  return ranks > 1 && (role == "master" || role == "moment" || role == "ema");
}

llvm::Error host::gatherWhole(const HostTensor &t, exec::DType dtype, void *dst,
                              dist::Collectives &job) {
  size_t bytes = exec::dtypeBytes(dtype);
  // Casting is elementwise: the shards cast are the whole cast, so the
  // ranks move the fetch's dtype (half the bytes of fp32 for bf16).
  cpu::narrow(t.data.data(), dtype, t.held(),
              static_cast<uint8_t *>(dst) + t.shardBegin * bytes);
  return job.allGatherShards(dst, t.param->type.numElements(),
                             static_cast<int>(bytes));
}

HostTensor *HostState::expAvg(llvm::StringRef name) {
  return find((name + ".exp_avg").str());
}

HostTensor *HostState::expAvgSq(llvm::StringRef name) {
  return find((name + ".exp_avg_sq").str());
}

/// The memory limit of this process's cgroup (v2, else v1), if any.
static std::optional<uint64_t> cgroupMemoryLimit() {
  for (const char *path : {"/sys/fs/cgroup/memory.max",
                           "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::FILE *f = std::fopen(path, "re");
    if (!f)
      continue;
    char buf[64] = {};
    size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    uint64_t limit;
    // "max" (v2) or a number near 2^63 (v1) mean no limit.
    if (!llvm::StringRef(buf, n).trim().getAsInteger(10, limit) &&
        limit < (uint64_t(1) << 60))
      return limit;
  }
  return std::nullopt;
}

/// Bytes of all memory blocks the kernel knows, online or offline.
static std::optional<uint64_t> memoryBlockBytes() {
  const std::string root = "/sys/devices/system/memory";
  std::FILE *f = std::fopen((root + "/block_size_bytes").c_str(), "re");
  if (!f)
    return std::nullopt;
  char buf[32] = {};
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  uint64_t blockSize;
  if (llvm::StringRef(buf, n).trim().getAsInteger(16, blockSize))
    return std::nullopt;
  std::error_code ec;
  uint64_t blocks = 0;
  for (llvm::sys::fs::directory_iterator it(root, ec), end; !ec && it != end;
       it.increment(ec))
    blocks += llvm::sys::path::filename(it->path()).starts_with("memory");
  if (ec || !blocks)
    return std::nullopt;
  return blocks * blockSize;
}

uint64_t host::residentBytes() {
  // VmHWM is this program's own peak: getrusage's maxrss also takes in the
  // peak of the process that forked it (the kernel keeps it across exec),
  // so a run launched by a large parent (Python, an IDE) would report the
  // parent's.
  if (FILE *status = std::fopen("/proc/self/status", "r")) {
    char line[256];
    unsigned long long kib = 0;
    bool found = false;
    while (!found && std::fgets(line, sizeof(line), status))
      found = std::sscanf(line, "VmHWM: %llu kB", &kib) == 1;
    std::fclose(status);
    if (found)
      return static_cast<uint64_t>(kib) * 1024;
  }
  struct rusage usage = {};
  if (getrusage(RUSAGE_SELF, &usage))
    return 0;
  return static_cast<uint64_t>(usage.ru_maxrss) * 1024; // KiB on Linux
}

HostMemoryReadings host::readHostMemory() {
  HostMemoryReadings r;
  r.physicalBytes = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
                    static_cast<uint64_t>(sysconf(_SC_PAGE_SIZE));
  r.blockBytes = memoryBlockBytes();
  r.cgroupLimit = cgroupMemoryLimit();
  if (const char *env = std::getenv("MEGASLIDE_HOST_MEMORY"); env && *env)
    r.override = env;
  return r;
}

llvm::Expected<uint64_t>
host::usableHostMemoryBytes(const HostMemoryReadings &r) {
  if (r.override) {
    llvm::StringRef text = llvm::StringRef(*r.override).trim(), digits = text;
    uint64_t unit = 1;
    for (auto [suffix, bytes] :
         {std::pair<const char *, uint64_t>{"KiB", 1ull << 10},
          {"MiB", 1ull << 20},
          {"GiB", 1ull << 30},
          {"TiB", 1ull << 40},
          {"KB", 1000ull},
          {"MB", 1000000ull},
          {"GB", 1000000000ull},
          {"TB", 1000000000000ull}})
      if (text.ends_with(suffix)) {
        digits = text.drop_back(llvm::StringRef(suffix).size()).rtrim();
        unit = bytes;
        break;
      }
    double value;
    if (digits.getAsDouble(value) || !(value * unit >= 1) ||
        value * unit >= 0x1p64)
      return llvm::createStringError(
          "MEGASLIDE_HOST_MEMORY='" + *r.override +
          "' is not a size (bytes, or a number with KiB, MiB, GiB, TiB, KB, "
          "MB, GB or TB)");
    return static_cast<uint64_t>(value * unit);
  }
  uint64_t machine = std::max(r.physicalBytes, r.blockBytes.value_or(0));
  return r.cgroupLimit ? std::min(machine, *r.cgroupLimit) : machine;
}

llvm::Expected<uint64_t> host::usableHostMemoryBytes() {
  return usableHostMemoryBytes(readHostMemory());
}

bool host::tieredRole(const exec::ExecPlan &plan, llvm::StringRef role) {
  return llvm::is_contained(plan.tierRoles, role);
}

llvm::Expected<std::vector<float>> host::heldValues(const HostTensor &t) {
  if (t.lean())
    return momentValues(t);
  std::vector<float> values(t.held());
  if (t.tier) {
    if (t.param->type.dtype != exec::DType::BF16) {
      if (llvm::Error e = t.tier->read(t.tierId, 0, t.held(), values.data()))
        return std::move(e);
      return values;
    }
    std::vector<uint16_t> bf16(t.held());
    if (llvm::Error e = t.tier->read(t.tierId, 0, t.held(), bf16.data()))
      return std::move(e);
    for (size_t i = 0; i < bf16.size(); ++i)
      values[i] = cpu::bf16ToFloat(bf16[i]);
    return values;
  }
  if (!t.bf16.empty()) {
    for (size_t i = 0; i < t.bf16.size(); ++i)
      values[i] = cpu::bf16ToFloat(t.bf16[i]);
    return values;
  }
  return t.data;
}

llvm::Error host::attachTier(HostState &state, const exec::ExecPlan &plan,
                             const NvmeTierOptions &options) {
  if (plan.tierRoles.empty())
    return llvm::Error::success();
  std::vector<NvmeTier::TensorSpec> specs;
  std::vector<HostTensor *> tiered;
  if (plan.hasLeanMoments() && tieredRole(plan, "moment"))
    return llvm::createStringError(
        "the NVMe tier holds fp32 and bf16 tensors, not " + plan.hostState +
        " moments: plan them in RAM (megaslide-plan does)");
  for (HostTensor &t : state.tensors)
    if (tieredRole(plan, t.param->role) && t.held() > 0) {
      // Kept in the tier as in RAM: bf16 moments (bf16-moments) and a bf16
      // EMA in bf16.
      bool bf16 = t.param->type.dtype == exec::DType::BF16;
      specs.push_back({t.param->name, t.held(), bf16 ? 2 : 4});
      tiered.push_back(&t);
    }
  llvm::Expected<std::unique_ptr<NvmeTier>> tier =
      NvmeTier::create(options, specs);
  if (!tier)
    return tier.takeError();
  state.tier = std::move(*tier);
  for (auto [id, t] : llvm::enumerate(tiered)) {
    const void *values = t->bf16.empty()
                             ? static_cast<const void *>(t->data.data())
                             : t->bf16.data();
    if (!t->data.empty() || !t->bf16.empty())
      if (llvm::Error e = state.tier->write(int64_t(id), 0, t->held(), values))
        return e;
    t->tier = state.tier.get();
    t->tierId = int64_t(id);
    t->data = {};
    t->bf16 = {};
  }
  return state.tier->drain();
}

uint64_t HostState::bytes() const {
  uint64_t total = 0;
  for (const HostTensor &t : tensors)
    total += (t.data.size() + t.absmax.size() + t.rowStat.size() +
              t.colStat.size()) *
                 sizeof(float) +
             t.bf16.size() * sizeof(uint16_t) + t.codes.size();
  return total;
}

/// How a tensor starts out (docs/Runtime.md, "Initialisation").
static void initTensor(const exec::Param &p, uint64_t seed,
                       std::vector<float> &data) {
  llvm::StringRef name = p.name;
  if (p.role == "moment" || name.ends_with(".bias"))
    return; // zeros
  if (name.contains("norm") && name.ends_with(".weight")) {
    std::fill(data.begin(), data.end(), 1.0f);
    return;
  }
  // Per-tensor streams keyed by name: the values do not depend on the
  // order or number of other tensors.
  train::Random rng(seed ^ train::hashName(name));
  float stddev = 0.02f;
  if (name.contains("scale_shift_table") && !p.type.shape.empty())
    stddev = 1.0f / std::sqrt(static_cast<float>(p.type.shape.back()));
  for (float &x : data)
    x = stddev * rng.normal();
}

/// Bytes per element the host keeps of `p`: fp32, but moments of
/// bf16-moments, which stay bf16.
static uint64_t hostElementBytes(const exec::Param &p) {
  return p.role == "moment" && p.type.dtype == exec::DType::BF16 ? 2 : 4;
}

/// Whether the host state holds parameter `p` (initHostState).
static bool inHostState(const exec::Param &p) {
  return p.role == "master" || p.role == "moment" || p.role == "frozen";
}

/// The elements of `p` rank `rank` of `ranks` holds.
static dist::ShardRange heldRange(const exec::Param &p, int rank, int ranks) {
  int64_t count = p.type.numElements();
  return shardedRole(p.role, ranks) ? dist::shardRange(count, rank, ranks)
                                    : dist::ShardRange{0, count};
}

/// Whether `p` is an exp_avg_sq (else an exp_avg), of role moment.
static bool secondMoment(const exec::Param &p) {
  return llvm::StringRef(p.name).ends_with(".exp_avg_sq");
}

/// factored-moments' view of a parameter: [shape[0], rest] when rank >= 2.
static std::optional<cpu::FactoredShape> factoredShape(const exec::Param &p) {
  if (p.type.shape.size() < 2 || p.type.shape[0] == 0)
    return std::nullopt;
  return cpu::FactoredShape{p.type.shape[0],
                            p.type.numElements() / p.type.shape[0]};
}

uint64_t host::momentBytes(const exec::ExecPlan &plan,
                           const exec::Param &moment) {
  uint64_t n = moment.type.numElements();
  if (plan.hostState == exec::kInt8Moments && n >= cpu::kQuantMinSize)
    return n + sizeof(float) * cpu::quantBlocks(n);
  if (plan.hostState == exec::kFactoredMoments)
    if (std::optional<cpu::FactoredShape> f = factoredShape(moment))
      return secondMoment(moment) ? sizeof(float) * (f->rows + f->cols)
                                  : sizeof(uint16_t) * n;
  return sizeof(float) * n;
}

uint64_t host::stateBytes(const exec::ExecPlan &plan, int ranks) {
  uint64_t bytes = 0;
  for (const exec::Param &p : plan.params)
    if (p.role == "moment" && plan.hasLeanMoments())
      bytes += momentBytes(plan, p); // such plans are of one rank
    else if (inHostState(p) && !tieredRole(plan, p.role))
      bytes += heldRange(p, 0, ranks).size() * hostElementBytes(p);
  return bytes;
}

/// Keeps moment `t` as `hostState` says (zeros): int8 codes and absmax, or
/// a factored matrix's bf16 m and row/column statistics. False for the
/// moments that stay fp32: of a vector under factored-moments, of fewer
/// than cpu::kQuantMinSize elements under int8-moments.
static bool keepLean(HostTensor &t, llvm::StringRef hostState) {
  const exec::Param &p = *t.param;
  int64_t n = p.type.numElements();
  if (hostState == exec::kInt8Moments) {
    if (n < cpu::kQuantMinSize)
      return false;
    bool isSigned = !secondMoment(p);
    t.codes.assign(n, cpu::quantizeCode(cpu::dynamicMap(isSigned), 0.0f));
    t.absmax.assign(cpu::quantBlocks(n), 0.0f);
  } else if (std::optional<cpu::FactoredShape> f = factoredShape(p)) {
    if (secondMoment(p)) {
      t.rowStat.assign(f->rows, 0.0f);
      t.colStat.assign(f->cols, 0.0f);
    } else {
      t.bf16.assign(n, 0);
    }
  } else {
    return false;
  }
  return true;
}

std::vector<float> host::momentValues(const HostTensor &t) {
  std::vector<float> values(t.held());
  int64_t n = t.held();
  if (!t.codes.empty()) {
    cpu::dequantizeBlockwise(t.codes.data(), t.absmax.data(), n,
                             !secondMoment(*t.param), values.data());
  } else if (!t.rowStat.empty()) {
    cpu::FactoredShape f = *factoredShape(*t.param);
    double total = cpu::factoredRowTotal(f, t.rowStat.data());
    for (int64_t e = 0; e < n; ++e)
      values[e] = static_cast<float>(double(t.rowStat[e / f.cols]) *
                                     double(t.colStat[e % f.cols]) / total);
  } else if (!t.bf16.empty()) {
    for (int64_t e = 0; e < n; ++e)
      values[e] = cpu::bf16ToFloat(t.bf16[e]);
  } else {
    values = t.data;
  }
  return values;
}

HostState host::initHostState(const exec::ExecPlan &plan, uint64_t seed,
                              int rank, int ranks) {
  HostState state;
  state.hostState = plan.hostState;
  state.tensors.reserve(plan.params.size());
  for (const exec::Param &p : plan.params) {
    if (!inHostState(p))
      continue;
    HostTensor t;
    t.param = &p;
    dist::ShardRange held = heldRange(p, rank, ranks);
    if ((t.sharded = shardedRole(p.role, ranks))) {
      t.shardBegin = held.begin;
      t.shardEnd = held.end;
    }
    // Drawn whole, one tensor at a time: a shard's values do not depend on
    // the job's size. The tier's zeros are its fresh files.
    bool inTier = p.role == "moment" && tieredRole(plan, p.role);
    if (p.role == "moment" && plan.hasLeanMoments() && ranks == 1) {
      // Zeros, kept as the plan says.
      if (!keepLean(t, plan.hostState))
        t.data.assign(p.type.numElements(), 0.0f);
    } else if (!inTier && hostElementBytes(p) == 2) {
      t.bf16.assign(t.held(), 0); // bf16 moments start at zero
    } else if (!inTier) {
      std::vector<float> whole(p.type.numElements(), 0.0f);
      initTensor(p, seed, whole);
      t.keep(whole);
    }
    state.index[p.name] = state.tensors.size();
    state.tensors.push_back(std::move(t));
  }
  return state;
}
