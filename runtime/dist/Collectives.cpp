//===- Collectives.cpp - A job of several processes -----------------------===//

#include "megaslide/runtime/dist/Collectives.h"

#include "megaslide/runtime/dist/MpiPlugin.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <dlfcn.h>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>
#include <unistd.h>

using namespace llvm;
using namespace megaslide;
using namespace megaslide::dist;

Collectives::~Collectives() = default;

void Collectives::endJob(const std::string &message) {
  // From a watchdog thread, while others may be inside MPI or NCCL: write
  // and leave, running nothing of the process's teardown.
  (void)!::write(STDERR_FILENO, message.data(), message.size());
  std::_Exit(5);
}

namespace {

/// An environment variable as a non-negative int; none when unset.
Expected<std::optional<int>> envInt(const char *name) {
  const char *text = std::getenv(name);
  if (!text)
    return std::nullopt;
  int value = 0;
  if (StringRef(text).getAsInteger(10, value) || value < 0)
    return createStringError(formatv("the launcher's {0}='{1}' is not a "
                                     "non-negative integer",
                                     name, text));
  return value;
}

std::string thisHost() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0)
    return "?";
  return name;
}

/// The job of one process: every collective is the identity.
class OneRank final : public Collectives {
public:
  OneRank(World w) : Collectives(std::move(w), thisHost()) {}
  Error allReduceSum(MutableArrayRef<float>) override {
    return Error::success();
  }
  Error allReduceSum(MutableArrayRef<double>) override {
    return Error::success();
  }
  Expected<std::vector<std::string>> gatherStrings(StringRef mine,
                                                   bool) override {
    return std::vector<std::string>{mine.str()};
  }
  Error barrier() override { return Error::success(); }
  Error allGatherShards(void *, int64_t, int) override {
    return Error::success();
  }
  Error reduceScatterShards(MutableArrayRef<float>) override {
    return Error::success();
  }
  Error gatherShardsToRank0(ArrayRef<float> mine, int64_t,
                            float *all) override {
    llvm::copy(mine, all);
    return Error::success();
  }
};

/// A job over MPI, through the plugin's C functions, with a watchdog on
/// every collective.
class MpiJob final : public Collectives {
public:
  MpiJob(World w, std::string host, const MegaSlideMpiApi &api)
      : Collectives(std::move(w), std::move(host)), api(api) {}
  ~MpiJob() override {
    {
      std::lock_guard<std::mutex> lock(mu);
      stopping = true;
    }
    cv.notify_all();
    if (watchdog.joinable())
      watchdog.join();
    api.finalize();
  }

  void timeoutChanged() override {
    if (!watchdog.joinable() && timeout() > 0)
      watchdog = std::thread([this] { watch(); });
  }

  Error allReduceSum(MutableArrayRef<float> data) override {
    Waiting w(*this, "allreduce");
    return check(api.allReduceSum(data.data(), data.size(), 0), "allreduce");
  }
  Error allReduceSum(MutableArrayRef<double> data) override {
    Waiting w(*this, "allreduce");
    return check(api.allReduceSum(data.data(), data.size(), 1), "allreduce");
  }
  Expected<std::vector<std::string>> gatherStrings(StringRef mine,
                                                   bool timed) override {
    std::optional<Waiting> w;
    if (timed)
      w.emplace(*this, "allgather");
    std::vector<int> lengths(size());
    if (Error e = check(
            api.allGatherLengths(static_cast<int>(mine.size()), lengths.data()),
            "allgather"))
      return std::move(e);
    size_t total = 0;
    for (int n : lengths)
      total += n;
    std::string all(total, '\0');
    if (Error e =
            check(api.allGatherBytes(mine.data(), static_cast<int>(mine.size()),
                                     lengths.data(), all.data()),
                  "allgather"))
      return std::move(e);
    std::vector<std::string> out;
    for (size_t r = 0, at = 0; r < lengths.size(); at += lengths[r++])
      out.push_back(all.substr(at, lengths[r]));
    return out;
  }
  Error barrier() override {
    Waiting w(*this, "barrier");
    return check(api.barrier(), "barrier");
  }

  Error allGatherShards(void *data, int64_t count, int elementBytes) override {
    Expected<Layout> layout = layoutOf(count);
    if (!layout)
      return layout.takeError();
    Waiting w(*this, "allgather");
    return check(api.allGatherElements(data, elementBytes,
                                       layout->counts.data(),
                                       layout->offsets.data()),
                 "allgather");
  }
  Error reduceScatterShards(MutableArrayRef<float> data) override {
    Expected<Layout> layout = layoutOf(data.size());
    if (!layout)
      return layout.takeError();
    Waiting w(*this, "reduce-scatter");
    return check(api.reduceScatterFloats(data.data(), layout->counts.data(),
                                         layout->offsets.data()),
                 "reduce-scatter");
  }
  Error gatherShardsToRank0(ArrayRef<float> mine, int64_t count,
                            float *all) override {
    Expected<Layout> layout = layoutOf(count);
    if (!layout)
      return layout.takeError();
    Waiting w(*this, "gather");
    return check(api.gatherFloats(mine.data(), all,
                                  layout->counts.data(),
                                  layout->offsets.data()),
                 "gather");
  }
  void abort(int code) override {
    std::fflush(nullptr);
    api.abort(code);
  }

private:
  /// The ranks' shards of a tensor as MPI's counts and offsets.
  struct Layout {
    std::vector<int> counts, offsets;
  };
  Expected<Layout> layoutOf(size_t count) {
    if (count > size_t(std::numeric_limits<int>::max()))
      return createStringError(formatv(
          "a tensor of {0} elements is over what one MPI collective moves",
          count));
    Layout l;
    for (int r = 0; r < size(); ++r) {
      ShardRange s = shardRange(static_cast<int64_t>(count), r, size());
      l.counts.push_back(static_cast<int>(s.size()));
      l.offsets.push_back(static_cast<int>(s.begin));
    }
    return l;
  }

  /// Marks a collective in flight for the watchdog.
  struct Waiting {
    Waiting(MpiJob &job, const char *what) : job(job) {
      job.what = what;
      job.since = std::chrono::steady_clock::now().time_since_epoch().count();
    }
    ~Waiting() { job.since = 0; }
    MpiJob &job;
  };

  /// Ends the process when a collective has waited past the timeout: MPI
  /// would wait for a hung rank for ever. Exit code 5; the launcher ends
  /// the others (Open MPI on a rank's non-zero exit).
  void watch() {
    std::unique_lock<std::mutex> lock(mu);
    while (!stopping) {
      cv.wait_for(lock, std::chrono::milliseconds(200));
      int64_t started = since;
      if (!started)
        continue;
      double waited = std::chrono::duration<double>(
                          std::chrono::steady_clock::now().time_since_epoch() -
                          std::chrono::steady_clock::duration(started))
                          .count();
      if (waited < timeout())
        continue;
      endJob(
          formatv("megaslide: error: rank {0} on {1}: the job's {2} has "
                  "waited {3:F0} s for the other ranks (--collective-timeout "
                  "{4}): a rank has hung or died; the job stops, and the "
                  "last complete checkpoint resumes it\n",
                  rank(), host(), what.load(), waited,
                  llvm::format("%g", timeout()))
              .str());
    }
  }

  Error check(int code, const char *what) {
    if (code == 0)
      return Error::success();
    char text[512] = {};
    api.errorText(code, text, sizeof(text));
    return createStringError(formatv("rank {0} on {1}: MPI {2} failed: {3}",
                                     rank(), host(), what, text));
  }
  MegaSlideMpiApi api;
  std::atomic<int64_t> since{0}; ///< steady clock ticks; 0: none in flight
  std::atomic<const char *> what{""};
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::thread watchdog;
};

} // namespace

ShardRange dist::shardRange(int64_t count, int rank, int ranks) {
  // In units of kShardAlign elements: the first (units % ranks) ranks take
  // one unit more; the last unit may be short.
  int64_t units = (count + kShardAlign - 1) / kShardAlign;
  int64_t base = units / ranks, extra = units % ranks;
  auto start = [&](int64_t r) {
    return std::min(count,
                    (r * base + std::min<int64_t>(r, extra)) * kShardAlign);
  };
  return {start(rank), start(rank + 1)};
}

Expected<World> dist::worldFromEnvironment() {
  struct Launcher {
    const char *name, *rank, *size, *localRank, *localSize;
  };
  // Open MPI first: its mpirun inside a Slurm allocation also sets
  // SLURM_* variables of the allocation.
  static const Launcher launchers[] = {
      {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
       "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"mpiexec", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
      {"srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
       "SLURM_STEP_TASKS_PER_NODE"},
  };
  for (const Launcher &l : launchers) {
    Expected<std::optional<int>> size = envInt(l.size);
    if (!size)
      return size.takeError();
    if (!*size)
      continue;
    World w;
    w.launcher = l.name;
    w.size = **size;
    Expected<std::optional<int>> rank = envInt(l.rank);
    if (!rank)
      return rank.takeError();
    if (!*rank || **rank >= w.size || w.size < 1)
      return createStringError(formatv(
          "the launcher ({0}) set {1}={2} but {3} is {4}: not a rank of the "
          "job",
          l.name, l.size, w.size, l.rank,
          *rank ? std::to_string(**rank) : std::string("unset")));
    w.rank = **rank;
    Expected<std::optional<int>> local = envInt(l.localRank);
    if (!local)
      return local.takeError();
    w.localRank = local->value_or(0);
    // Slurm gives the tasks per node as "8(x2)"; its first count is this
    // node's where nodes hold the same number.
    if (const char *n = std::getenv(l.localSize)) {
      int count = 0;
      if (!StringRef(n).take_while(isDigit).getAsInteger(10, count))
        w.localSize = count;
    }
    return w;
  }
  return World();
}

Expected<const std::vector<std::string> &> Collectives::hosts() {
  if (hostNames.empty()) {
    Expected<std::vector<std::string>> all = allGather(hostName);
    if (!all)
      return all.takeError();
    hostNames = std::move(*all);
  }
  return hostNames;
}

Error Collectives::checkSame(StringRef what, StringRef mine) {
  Expected<std::vector<std::string>> all = allGather(mine);
  if (!all)
    return all.takeError();
  Expected<const std::vector<std::string> &> hosts = this->hosts();
  if (!hosts)
    return hosts.takeError();
  std::string differ;
  for (size_t r = 1; r < all->size(); ++r)
    if ((*all)[r] != (*all)[0])
      differ += formatv("{0}rank {1} on {2}", differ.empty() ? "" : ", ", r,
                        (*hosts)[r]);
  if (differ.empty())
    return Error::success();
  return createStringError(
      formatv("the ranks of this job disagree on {0}: "
              "{1} differ{2} from rank 0 on {3}; every "
              "rank must run the same command",
              what, differ, differ.find(',') == std::string::npos ? "s" : "",
              (*hosts)[0]));
}

Expected<std::unique_ptr<Collectives>> dist::openCollectives() {
  Expected<World> world = worldFromEnvironment();
  if (!world)
    return world.takeError();
  if (world->size == 1)
    return std::make_unique<OneRank>(*world);
  // The plugin: $MEGASLIDE_MPI_PLUGIN, else lib/ beside the executable's
  // bin/, else the loader's search path.
  std::vector<std::string> candidates;
  if (const char *given = std::getenv("MEGASLIDE_MPI_PLUGIN"))
    candidates.push_back(given);
  else {
    std::string exe = sys::fs::getMainExecutable(nullptr, nullptr);
    SmallString<256> path(sys::path::parent_path(sys::path::parent_path(exe)));
    sys::path::append(path, "lib", "libMegaSlideMpi.so");
    candidates.push_back(std::string(path));
    candidates.push_back("libMegaSlideMpi.so");
  }
  std::string tried;
  for (const std::string &path : candidates) {
    void *handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (!handle) {
      tried += formatv("\n  {0}: {1}", path, ::dlerror()).str();
      continue;
    }
    auto open = reinterpret_cast<decltype(&megaslideMpiOpen)>(
        ::dlsym(handle, kMpiOpenSymbol));
    if (!open)
      return createStringError(path + " is not a MegaSlide MPI plugin");
    MegaSlideMpiApi api{};
    char host[256] = {}, error[512] = {};
    if (open(world->rank, world->size, &api, host, sizeof(host), error,
             sizeof(error)) != 0)
      return createStringError(formatv("rank {0} of {1} ({2}): MPI did not "
                                       "start: {3}",
                                       world->rank, world->size,
                                       world->launcher, error));
    return std::make_unique<MpiJob>(*world, host, api);
  }
  return createStringError(formatv(
      "launched as rank {0} of {1} by {2}, but the MPI plugin cannot be "
      "loaded (build with MPI: scripts/install-deps.sh installs Open MPI; "
      "or set MEGASLIDE_MPI_PLUGIN):{3}",
      world->rank, world->size, world->launcher, tried));
}
