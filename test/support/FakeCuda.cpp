//===- FakeCuda.cpp - An asynchronous fake CUDA device for tests ----------===//

#include "megaslide/Testing/FakeCuda.h"

#include "megaslide/runtime/cpu/Dsa3d.h"
#include "megaslide/runtime/cpu/GraphKernels.h"
#include "megaslide/runtime/cpu/HalfFloat.h"
#include "megaslide/runtime/cuda/Nvrtc.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/SmallVector.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/xxhash.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <tuple>
#include <utility>

namespace megaslide::cuda::fake {

using exec::DType;

float loadAs(const void *p, DType t, int64_t i) {
  switch (t) {
  case DType::BF16:
    return cpu::bf16ToFloat(static_cast<const uint16_t *>(p)[i]);
  case DType::F16: {
    _Float16 h;
    std::memcpy(&h, static_cast<const uint16_t *>(p) + i, 2);
    return static_cast<float>(h);
  }
  case DType::F32:
    return static_cast<const float *>(p)[i];
  case DType::I32:
    return static_cast<float>(static_cast<const int32_t *>(p)[i]);
  case DType::I64:
    return static_cast<float>(static_cast<const int64_t *>(p)[i]);
  }
  return 0;
}

void storeAs(void *p, DType t, int64_t i, float v) {
  switch (t) {
  case DType::BF16:
    static_cast<uint16_t *>(p)[i] = cpu::floatToBf16(v);
    return;
  case DType::F16: {
    _Float16 h = static_cast<_Float16>(v);
    std::memcpy(static_cast<uint16_t *>(p) + i, &h, 2);
    return;
  }
  case DType::F32:
    static_cast<float *>(p)[i] = v;
    return;
  case DType::I32:
    static_cast<int32_t *>(p)[i] = static_cast<int32_t>(v);
    return;
  case DType::I64:
    static_cast<int64_t *>(p)[i] = static_cast<int64_t>(v);
    return;
  }
}

void naiveGemm(const GemmCall &g, const void *A, const void *B, void *D,
               const void *bias) {
  // Rows of op(A) and columns of op(B) as contiguous floats first: the
  // whole-plan tests run thousands of these.
  std::vector<float> a(g.m * g.k), b(g.n * g.k);
  for (int64_t i = 0; i < g.m; ++i)
    for (int64_t p = 0; p < g.k; ++p)
      a[i * g.k + p] =
          loadAs(A, g.abType, g.transA ? p + i * g.lda : i + p * g.lda);
  for (int64_t j = 0; j < g.n; ++j)
    for (int64_t p = 0; p < g.k; ++p)
      b[j * g.k + p] =
          loadAs(B, g.abType, g.transB ? j + p * g.ldb : p + j * g.ldb);
  for (int64_t j = 0; j < g.n; ++j)
    for (int64_t i = 0; i < g.m; ++i) {
      const float *x = &a[i * g.k], *y = &b[j * g.k];
      double acc = 0;
      for (int64_t p = 0; p < g.k; ++p)
        acc += double(x[p]) * y[p];
      if (g.hasBias)
        acc += loadAs(bias, g.dType, i);
      storeAs(D, g.dType, i + j * g.ldd, static_cast<float>(acc));
    }
}

namespace {

//===----------------------------------------------------------------------===//
// Kernels on the host
//===----------------------------------------------------------------------===//

/// The element types of a kernel from its name's suffix (ms_<kind>_<types>).
std::vector<DType> typesOf(llvm::StringRef name, size_t count) {
  llvm::SmallVector<llvm::StringRef> parts;
  name.split(parts, '_');
  std::vector<DType> types;
  for (llvm::StringRef p : llvm::ArrayRef(parts).take_back(count))
    types.push_back(exec::parseDType(p).value_or(DType::F32));
  return types;
}

/// Global attention as host loops with the kernels' argument lists and
/// contracts (lse and delta between the two backward kernels). Emulating a
/// 320-token attention lane by lane would take minutes; the CUDA kernels
/// themselves are checked by CudaDenseEmulationTest on small shapes.
struct HostAttention {
  std::vector<DType> t;
  int kind; // 0 fwd, 1 bwd_dq, 2 bwd_dkv
  void run(void **args) const {
    auto ptr = [&](int i) { return *reinterpret_cast<void **>(args[i]); };
    auto i64 = [&](int i) { return *reinterpret_cast<long long *>(args[i]); };
    int base = kind == 0 ? 5 : 8;
    long long B = i64(base), Nq = i64(base + 1), Nk = i64(base + 2),
              H = i64(base + 3), Dh = i64(base + 4);
    float scale = *reinterpret_cast<float *>(args[base + 5]);
    void *q = ptr(0), *k = ptr(1), *v = ptr(2);
    auto row = [&](long long b, long long n, long long N, long long h) {
      return ((b * N + n) * H + h) * Dh;
    };
    auto dot = [&](void *x, DType tx, long long xr, void *y, DType ty,
                   long long yr) {
      float s = 0;
      for (long long d = 0; d < Dh; ++d)
        s += loadAs(x, tx, xr + d) * loadAs(y, ty, yr + d);
      return s;
    };
    for (long long b = 0; b < B; ++b)
      for (long long h = 0; h < H; ++h) {
        long long outer = kind == 2 ? Nk : Nq;
        for (long long i = 0; i < outer; ++i) {
          if (kind == 0 || kind == 1) {
            long long qr = row(b, i, Nq, h);
            std::vector<float> s(Nk);
            float m = -INFINITY, l = 0;
            for (long long j = 0; j < Nk; ++j) {
              s[j] = scale * dot(q, t[0], qr, k, t[1], row(b, j, Nk, h));
              m = std::max(m, s[j]);
            }
            for (long long j = 0; j < Nk; ++j)
              l += std::exp(s[j] - m);
            float L = m + std::log(l);
            long long w = (b * H + h) * Nq + i;
            if (kind == 0) {
              for (long long d = 0; d < Dh; ++d) {
                float acc = 0;
                for (long long j = 0; j < Nk; ++j)
                  acc += std::exp(s[j] - L) *
                         loadAs(v, t[2], row(b, j, Nk, h) + d);
                storeAs(ptr(3), t[3], qr + d, acc);
              }
              if (float *lse = static_cast<float *>(ptr(4)))
                lse[w] = L;
              continue;
            }
            void *o = ptr(3), *dout = ptr(4);
            float dl = dot(dout, t[4], qr, o, t[3], qr);
            std::vector<float> dq(Dh, 0.0f);
            for (long long j = 0; j < Nk; ++j) {
              long long kr = row(b, j, Nk, h);
              float ds =
                  std::exp(s[j] - L) * (dot(dout, t[4], qr, v, t[2], kr) - dl);
              for (long long d = 0; d < Dh; ++d)
                dq[d] += ds * loadAs(k, t[1], kr + d);
            }
            for (long long d = 0; d < Dh; ++d)
              storeAs(ptr(5), t[5], qr + d, dq[d] * scale);
            static_cast<float *>(ptr(6))[w] = L;
            static_cast<float *>(ptr(7))[w] = dl;
          } else {
            long long kr = row(b, i, Nk, h);
            void *dout = ptr(3);
            const float *lse = static_cast<const float *>(ptr(6)),
                        *delta = static_cast<const float *>(ptr(7));
            std::vector<float> dk(Dh, 0.0f), dv(Dh, 0.0f);
            for (long long j = 0; j < Nq; ++j) {
              long long qr = row(b, j, Nq, h), w = (b * H + h) * Nq + j;
              float p =
                  std::exp(scale * dot(q, t[0], qr, k, t[1], kr) - lse[w]);
              float ds = p * (dot(dout, t[3], qr, v, t[2], kr) - delta[w]);
              for (long long d = 0; d < Dh; ++d) {
                dv[d] += p * loadAs(dout, t[3], qr + d);
                dk[d] += ds * loadAs(q, t[0], qr + d);
              }
            }
            for (long long d = 0; d < Dh; ++d) {
              storeAs(ptr(4), t[4], kr + d, dk[d] * scale);
              storeAs(ptr(5), t[5], kr + d, dv[d]);
            }
          }
        }
      }
  }
};
/// A generated 3D-DSA kernel (named configName + _fwd/_bwd/_bwd_keys/
/// _offsets) as the cpu reference with the kernels' argument lists and
/// contracts: the backward writes dQ and the fp32 row sums Delta =
/// rowsum(dO * O) [B, H, N], the dK/dV kernel reads Delta and writes dK
/// and dV. Their CUDA versions are checked by DsaKernelEmulationTest
/// and, on a GPU, scripts/dsa_gpu_check.py; this checks how the backend
/// binds them.
struct HostDsa {
  cpu::Dsa3dConfig cfg;
  DType elem = DType::BF16;
  int64_t radius = 0;
  std::string kind;

  static std::optional<HostDsa> parse(const char *name) {
    HostDsa d;
    long long g[3], w[3], t[3], h, hd, r;
    char elem[8] = {}, kind[32] = {};
    if (std::sscanf(name,
                    "dsa3d_g%lldx%lldx%lld_w%lldx%lldx%lld_t%lldx%lldx%lld_h%"
                    "lld_d%lld_%7[a-z0-9]_r%lld_%31s",
                    &g[0], &g[1], &g[2], &w[0], &w[1], &w[2], &t[0], &t[1],
                    &t[2], &h, &hd, elem, &r, kind) != 14)
      return std::nullopt;
    d.cfg.T = g[0];
    d.cfg.Y = g[1];
    d.cfg.X = g[2];
    d.cfg.window = {w[0], w[1], w[2]};
    d.cfg.tile = {t[0], t[1], t[2]};
    d.cfg.heads = h;
    d.cfg.headDim = hd;
    d.elem = std::string(elem) == "f16" ? DType::F16 : DType::BF16;
    d.radius = r;
    d.kind = kind;
    return d;
  }

  void run(unsigned gz, void **args) const {
    auto ptr = [&](int i) { return *reinterpret_cast<void **>(args[i]); };
    cpu::Dsa3dConfig c = cfg;
    c.batch = gz;
    int64_t n = c.batch * c.tokens() * c.heads * c.headDim;
    auto wide = [&](int i) {
      std::vector<float> v(n);
      for (int64_t e = 0; e < n; ++e)
        v[e] = loadAs(ptr(i), elem, e);
      return v;
    };
    auto view = [&](float *p) { return cpu::dsa3dGraphLayout(p, c); };
    auto cview = [&](const float *p) { return cpu::dsa3dGraphLayout(p, c); };
    std::vector<float> q = wide(0), k = wide(1);
    if (kind == "offsets") {
      // Block matching ignores the softmax scale, but dsa3dOffsets requires
      // a valid configuration, scale included (as the cpu backend sets it).
      c.scale = 1.0;
      cpu::dsa3dOffsets(c, cview(q.data()), cview(k.data()), radius,
                        static_cast<int32_t *>(ptr(2)));
      return;
    }
    const int32_t *offsets = static_cast<const int32_t *>(ptr(3));
    std::vector<float> v = wide(2);
    if (kind == "fwd") {
      c.scale = *reinterpret_cast<float *>(args[6]);
      std::vector<float> out(n);
      cpu::dsa3dForward(c, cview(q.data()), cview(k.data()), cview(v.data()),
                        offsets, view(out.data()),
                        static_cast<float *>(ptr(5)));
      for (int64_t e = 0; e < n; ++e)
        storeAs(ptr(4), elem, e, out[e]);
      return;
    }
    if (kind == "bwd_keys") {
      // (q, k, v, offsets, dout, lse, delta, dk, dv, scale): dK and dV
      // from Delta as the backward stored it (not recomputed from o).
      c.scale = *reinterpret_cast<float *>(args[9]);
      std::vector<float> dout = wide(4), dq(n), dk(n), dv(n);
      const float *lse = static_cast<const float *>(ptr(5));
      const float *delta = static_cast<const float *>(ptr(6));
      cpu::dsa3dBackwardFromDelta(c, cview(q.data()), cview(k.data()),
                                  cview(v.data()), offsets, cview(dout.data()),
                                  lse, delta, view(dq.data()), view(dk.data()),
                                  view(dv.data()));
      for (int64_t e = 0; e < n; ++e) {
        storeAs(ptr(7), elem, e, dk[e]);
        storeAs(ptr(8), elem, e, dv[e]);
      }
      return;
    }
    // bwd: (q, k, v, offsets, o, dout, lse, dq, delta, scale)
    c.scale = *reinterpret_cast<float *>(args[9]);
    std::vector<float> o = wide(4), dout = wide(5), dq(n), dk(n), dv(n);
    cpu::dsa3dBackward(c, cview(q.data()), cview(k.data()), cview(v.data()),
                       offsets, cview(o.data()), cview(dout.data()),
                       static_cast<const float *>(ptr(6)), view(dq.data()),
                       view(dk.data()), view(dv.data()));
    for (int64_t e = 0; e < n; ++e)
      storeAs(ptr(7), elem, e, dq[e]);
    cpu::dsa3dRowDot(c, cview(o.data()), cview(dout.data()),
                     static_cast<float *>(ptr(8)));
  }
};

/// A kernel function: a dense kernel's host build (global attention as
/// host loops), or a 3D-DSA kernel.
struct Function {
  std::string name;
  HostKernel host;
  std::optional<HostAttention> attention;
  std::optional<HostDsa> dsa;

  size_t params() const {
    if (!dsa)
      return host.params;
    return dsa->kind == "offsets"    ? 3
           : dsa->kind == "fwd"      ? 7
           : dsa->kind == "bwd"      ? 10
           : dsa->kind == "bwd_keys" ? 10
                                     : 0;
  }
};

//===----------------------------------------------------------------------===//
// Device state
//===----------------------------------------------------------------------===//

constexpr int kMaxStreams = 8; // slot 0: the NULL stream
/// Per stream slot, the last operation (its sequence number on that
/// stream) ordered before a point.
using VClock = std::array<int64_t, kMaxStreams>;
constexpr int64_t kNever = -1;    // block tag: nothing wrote it
constexpr int64_t kHost = 0;      // block tag: written by the host
constexpr uint8_t kPoison = 0xff; // NaN in bf16, f16 and f32
constexpr size_t kMaxErrors = 20;
constexpr CUresult kInvalidValue = 1, kInvalidDevice = 101,
                   kInvalidHandle = 400, kNotReady = 600;

void merge(VClock &into, const VClock &from) {
  for (int s = 0; s < kMaxStreams; ++s)
    into[s] = std::max(into[s], from[s]);
}

struct Alloc {
  uintptr_t base = 0;
  size_t size = 0;
  bool pinned = false, arena = false;
  /// A device allocation checked as the arena is (a device set up without
  /// a plan).
  bool checked = false;
  int index = 0; ///< in allocation order, for messages
  /// Per block (tracked allocations only): the writer in issue order and
  /// the writer whose operation has run; per stream the last reader.
  std::vector<int64_t> writer, done;
  std::array<std::vector<int64_t>, kMaxStreams> lastRead;

  bool tracked() const { return pinned || arena || checked; }
  std::string name() const {
    return arena    ? std::string("the arena")
           : pinned ? llvm::formatv("pinned allocation #{0}", index).str()
                    : llvm::formatv("device allocation #{0}", index).str();
  }
};

/// A tracked byte range an operation reads or writes.
struct Access {
  Alloc *alloc = nullptr;
  uintptr_t lo = 0;
  size_t bytes = 0;
  int64_t first = 0, last = 0;   ///< blocks
  std::vector<int64_t> expected; ///< reads: each block's writer at the call
  std::optional<uint64_t> hash;  ///< reads of host-written bytes
};

struct Completion {
  bool done = false;
  int64_t micros = 0;
};

/// An operation as messages name it.
struct OpInfo {
  int stream = 0;
  int64_t seq = 0;
  int64_t instruction = -1;
  std::string call;
};

struct Op {
  enum Kind { Work, Record, Wait } kind = Work;
  int64_t id = 0;
  /// A sticky fault (Fault::sticky): running it breaks the context.
  CUresult fault = CUDA_SUCCESS;
  std::vector<Access> reads, writes;
  std::function<void()> run;
  /// Filled with NaN before the delay: a destination is undefined until
  /// its operation completes.
  std::vector<std::pair<void *, size_t>> poison;
  std::shared_ptr<Completion> completion; ///< Record: completes; Wait: awaits
  /// A collective runs even when its inputs are not ready: the other ranks
  /// wait for it.
  bool mustRun = false;
};

struct Device;

struct Stream {
  Device *device = nullptr;
  int slot = 0;
  std::deque<Op> queue; ///< the front one runs; it leaves when done
  bool stop = false;
  VClock clock{};
  int64_t seq = 0;
  std::mt19937_64 rng;
  std::thread thread;
};

struct Event {
  Device *device = nullptr; ///< where it was made
  unsigned flags = 0;
  std::shared_ptr<Completion> latest; ///< the most recent record
  VClock clock{};                     ///< its stream's clock then
};

/// An operation of the plan as the backend issues it: the instruction,
/// the arguments (a launch's slots; the addresses of other calls) and,
/// for launches, the arena ranges the kernel reads and writes.
struct Candidate {
  enum Kind { Launch, Gemm, Memset, Copy, H2D, D2H, NumKinds } kind = Launch;
  int64_t instruction = -1;
  std::string kernel;
  struct Slot {
    enum { Any, Arena, Exact } kind = Any;
    uint64_t v = 0;
    bool operator==(const Slot &o) const { return kind == o.kind && v == o.v; }
  };
  std::vector<Slot> slots;
  int64_t bytes = -1; ///< copies and memsets
  std::vector<std::pair<int64_t, int64_t>> reads, writes;
  /// Options::referenceKernels: does nothing, or runs the instruction.
  enum Exec { Run, Skip, Reference } exec = Run;
  bool used = false;

  static Candidate of(Kind kind, std::vector<Slot> slots, int64_t bytes = -1,
                      std::string kernel = "") {
    Candidate c;
    c.kind = kind;
    c.slots = std::move(slots);
    c.bytes = bytes;
    c.kernel = std::move(kernel);
    return c;
  }
};

struct Device {
  std::mutex mu;
  std::condition_variable cv;
  const exec::ExecPlan *plan = nullptr;
  KernelLookup kernels;
  Options options;
  int64_t block = 256;
  std::map<uintptr_t, std::unique_ptr<Alloc>> allocs;
  int allocCount = 0;
  Alloc *arena = nullptr;
  std::array<std::unique_ptr<Stream>, kMaxStreams> streams;
  std::vector<OpInfo> ops{OpInfo{}}; ///< by id; 0 is the host
  VClock host{}; ///< what host threads have synchronised with
  int64_t stepStart = 1;
  std::vector<std::string> errors;
  int64_t moreErrors = 0;
  Stats stats;
  bool faultFired = false;
  /// A sticky fault's call was made: its operation (the next enqueued)
  /// carries it.
  CUresult armed = CUDA_SUCCESS;
  /// The result every later call returns once a sticky fault has run.
  CUresult broken = CUDA_SUCCESS;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  std::vector<int64_t> offsets;      ///< arena offset per value (-1: none)
  std::vector<Candidate> candidates; ///< program order
  std::array<std::vector<size_t>, Candidate::NumKinds> byKind;
  std::array<size_t, Candidate::NumKinds> cursor{};
  /// setUp without a plan: every device allocation is checked.
  bool checkAll = false;

  ~Device() {
    std::unique_lock<std::mutex> lock(mu);
    for (auto &s : streams)
      if (s) {
        s->stop = true;
        cv.notify_all();
        lock.unlock();
        s->thread.join();
        lock.lock();
      }
  }
};

/// The fake devices, and the device of each stream and allocation: a call
/// that names one goes to its device from any host thread.
struct Registry {
  std::mutex mu;
  std::vector<std::unique_ptr<Device>> devices;
  std::map<CUstream, Device *> streams;
  std::map<uintptr_t, Device *> allocs;
};

Registry &registry() {
  static Registry r;
  return r;
}

/// The calling thread's device (useDevice, cuCtxSetCurrent); null: 0.
thread_local Device *current = nullptr;

Device &deviceAt(int index) {
  Registry &r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  while (r.devices.size() <= static_cast<size_t>(index))
    r.devices.push_back(std::make_unique<Device>());
  return *r.devices[index];
}

Device &dev() { return current ? *current : deviceAt(0); }

/// The devices made so far (useDevice), at least 1: ordinal r is device r.
int deviceCount() {
  Registry &r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return std::max<int>(1, static_cast<int>(r.devices.size()));
}

/// The device of stream `s`: the current one for the NULL stream or a
/// handle no device knows (which streamOf then refuses).
Device &deviceOf(CUstream s) {
  Registry &r = registry();
  std::unique_lock<std::mutex> lock(r.mu);
  auto it = r.streams.find(s);
  if (it != r.streams.end())
    return *it->second;
  lock.unlock();
  return dev();
}

/// The device of event `e` (the current one for none).
Device &deviceOf(CUevent e) {
  return e ? *reinterpret_cast<Event *>(e)->device : dev();
}

/// The device of the allocation at `p` (the current one for none).
Device &deviceOfAlloc(const void *p) {
  Registry &r = registry();
  std::unique_lock<std::mutex> lock(r.mu);
  auto it = r.allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it != r.allocs.end())
    return *it->second;
  lock.unlock();
  return dev();
}

/// The dense kernels' host build has global state.
std::mutex kernelMu;

void error(Device &d, std::string msg) {
  if (d.errors.size() < kMaxErrors)
    d.errors.push_back(std::move(msg));
  else
    ++d.moreErrors;
}

std::string describe(const Device &d, int64_t op) {
  if (op == kHost)
    return "the host";
  const OpInfo &o = d.ops[op];
  std::string what = o.call + " on stream #" + std::to_string(o.stream);
  if (o.instruction < 0)
    return what + " (the backend's own)";
  const exec::Instruction &inst = d.plan->instructions[o.instruction];
  return "instruction #" + std::to_string(o.instruction) + " ('" +
         exec::spanName(inst) + "'): " + what;
}

std::string bytesOf(const Access &a) {
  return llvm::formatv("{0} bytes [{1}, {2})", a.alloc->name(),
                       a.lo - a.alloc->base, a.lo - a.alloc->base + a.bytes)
      .str();
}

/// Whether a broken context fails `call` at once: not the calls that free
/// or destroy (the backend's cleanup), nor the synchronisations, which
/// first wait for the work before them, then report it.
bool failsWhenBroken(llvm::StringRef call) {
  for (const char *spared : {"Destroy", "Free", "Unload", "Release",
                             "cuCtxSetCurrent", "Synchronize"})
    if (call.contains(spared))
      return false;
  return true;
}

/// The fault check every entry point starts with: the injected result, the
/// broken context's, or success.
CUresult enter(Device &d, const char *call) {
  std::lock_guard<std::mutex> lock(d.mu);
  int64_t n = ++d.stats.calls[call];
  if (d.broken && failsWhenBroken(call))
    return d.broken;
  const std::optional<Fault> &f = d.options.fault;
  if (!f || f->call != call || f->nth != n)
    return CUDA_SUCCESS;
  if (f->sticky) {
    d.armed = f->result;
    return CUDA_SUCCESS;
  }
  d.faultFired = true;
  d.cv.notify_all();
  return f->result;
}
#define ENTER(device, name)                                                    \
  if (CUresult r_ = enter(device, name))                                       \
  return r_

int64_t micros(const Device &d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now() - d.t0)
      .count();
}

/// The allocation holding [p, p + n), or null.
Alloc *findAlloc(Device &d, uintptr_t p, size_t n) {
  auto it = d.allocs.upper_bound(p);
  if (it == d.allocs.begin())
    return nullptr;
  Alloc *a = std::prev(it)->second.get();
  return p + n <= a->base + a->size ? a : nullptr;
}

/// A device range of a call: inside a device allocation, else an error.
bool deviceRange(Device &d, uintptr_t p, size_t n, const char *call) {
  Alloc *a = findAlloc(d, p, std::max<size_t>(n, 1));
  if (a && !a->pinned)
    return true;
  error(d, llvm::formatv("{0}: [{1:x}, +{2}) is not inside device memory", call,
                         p, n)
               .str());
  return false;
}

/// The access of [p, p + n) where it lies in a tracked allocation.
std::optional<Access> access(Device &d, uintptr_t p, size_t n) {
  Alloc *a = findAlloc(d, p, n);
  if (!a || !a->tracked() || n == 0)
    return std::nullopt;
  Access x;
  x.alloc = a;
  x.lo = p;
  x.bytes = n;
  x.first = static_cast<int64_t>((p - a->base) / d.block);
  x.last = static_cast<int64_t>((p + n - 1 - a->base) / d.block);
  return x;
}

std::vector<int64_t> &lastReadOf(Alloc &a, int slot) {
  std::vector<int64_t> &v = a.lastRead[slot];
  if (v.empty())
    v.assign(a.writer.size(), kHost);
  return v;
}

/// Whether operation `op` is ordered before the current point of stream
/// `st`.
bool ordered(const Device &d, int64_t op, const Stream &st) {
  const OpInfo &o = d.ops[op];
  return o.stream == st.slot || st.clock[o.stream] >= o.seq;
}

/// Gives `op` its place on `st` and checks its ordering against every
/// earlier access of its bytes, in issue order (program order).
void order(Device &d, Stream &st, Op &op, int64_t instruction,
           std::string call) {
  merge(st.clock, d.host);
  st.clock[st.slot] = ++st.seq;
  op.id = static_cast<int64_t>(d.ops.size());
  d.ops.push_back({st.slot, st.seq, instruction, std::move(call)});
  for (Access &a : op.reads) {
    Alloc &al = *a.alloc;
    std::vector<int64_t> &readers = lastReadOf(al, st.slot);
    bool reported = false, hostWritten = true;
    for (int64_t b = a.first; b <= a.last; ++b) {
      int64_t w = al.writer[b];
      a.expected.push_back(w);
      hostWritten &= w == kHost;
      readers[b] = op.id;
      if (reported)
        continue;
      if (w == kNever || (al.arena && w < d.stepStart)) {
        error(d, describe(d, op.id) + " reads " + bytesOf(a) +
                     ", which no operation of this step wrote");
        reported = true;
      } else if (w != kHost && !ordered(d, w, st)) {
        error(d, describe(d, op.id) + " reads " + bytesOf(a) + " that " +
                     describe(d, w) +
                     " writes, and no event orders that write before it (a "
                     "missing wait)");
        reported = true;
      }
    }
    if (hostWritten)
      a.hash = llvm::xxh3_64bits(
          llvm::ArrayRef(reinterpret_cast<const uint8_t *>(a.lo), a.bytes));
  }
  for (Access &a : op.writes) {
    Alloc &al = *a.alloc;
    bool reported = false;
    for (int64_t b = a.first; b <= a.last; ++b) {
      int64_t w = al.writer[b];
      al.writer[b] = op.id;
      if (reported)
        continue;
      if (w > kHost && !ordered(d, w, st)) {
        error(d, describe(d, op.id) + " writes " + bytesOf(a) + " that " +
                     describe(d, w) + " writes too, unordered with it");
        reported = true;
        continue;
      }
      for (int t = 0; t < kMaxStreams && !reported; ++t) {
        if (t == st.slot || al.lastRead[t].empty())
          continue;
        int64_t r = al.lastRead[t][b];
        if (r > kHost && !ordered(d, r, st)) {
          error(d, describe(d, op.id) + " overwrites " + bytesOf(a) + " that " +
                       describe(d, r) +
                       " reads, and no event orders that read before it (a "
                       "missing write-after-read wait)");
          reported = true;
        }
      }
    }
  }
}

/// At run time, whether the bytes `op` reads hold what its writers wrote
/// (under the lock; reports the first that does not).
bool inputsReady(Device &d, const Op &op) {
  for (const Access &a : op.reads)
    for (int64_t b = a.first; b <= a.last; ++b) {
      int64_t want = a.expected[b - a.first], got = a.alloc->done[b];
      if (got == want || want == kNever)
        continue;
      error(d, describe(d, op.id) + " ran on " + bytesOf(a) +
                   (got < want
                        ? " before " + describe(d, want) + " had written"
                        : " after " + describe(d, got) + " had overwritten") +
                   " them");
      return false;
    }
  for (const Access &a : op.reads)
    if (a.hash &&
        *a.hash != llvm::xxh3_64bits(llvm::ArrayRef(
                       reinterpret_cast<const uint8_t *>(a.lo), a.bytes))) {
      error(d, describe(d, op.id) + " copies " + bytesOf(a) +
                   ", which the host changed after the call (the host must "
                   "wait for the copy's event before reusing its source)");
      return false;
    }
  return true;
}

void runStream(Stream *st) {
  Device &d = *st->device;
  std::unique_lock<std::mutex> lock(d.mu);
  for (;;) {
    d.cv.wait(lock, [&] { return st->stop || !st->queue.empty(); });
    if (st->queue.empty())
      return;
    Op &op = st->queue.front();
    if (op.kind == Op::Wait) {
      d.cv.wait(lock, [&] { return op.completion->done; });
    } else if (op.kind == Op::Record) {
      op.completion->done = true;
      op.completion->micros = micros(d);
    } else if (d.broken || op.fault) {
      // A broken context runs nothing; a sticky fault breaks it.
      if (op.fault && !d.broken) {
        d.broken = op.fault;
        d.faultFired = true;
      }
    } else {
      bool ready = inputsReady(d, op);
      int delay =
          d.options.maxDelayMicros > 0
              ? static_cast<int>(st->rng() % (d.options.maxDelayMicros + 1))
              : 0;
      lock.unlock();
      for (auto [p, n] : op.poison)
        std::memset(p, kPoison, n);
      if (delay)
        std::this_thread::sleep_for(std::chrono::microseconds(delay));
      if (ready || op.mustRun)
        op.run();
      lock.lock();
      for (const Access &a : op.writes)
        for (int64_t b = a.first; b <= a.last; ++b)
          a.alloc->done[b] = op.id;
    }
    st->queue.pop_front();
    d.cv.notify_all();
  }
}

Stream *newStream(Device &d, int slot) {
  auto st = std::make_unique<Stream>();
  st->device = &d;
  st->slot = slot;
  st->rng.seed(slot);
  st->thread = std::thread(runStream, st.get());
  {
    Registry &r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.streams[reinterpret_cast<CUstream>(st.get())] = &d;
  }
  d.streams[slot] = std::move(st);
  return d.streams[slot].get();
}

/// The stream of a handle (the NULL stream made on first use), or null.
Stream *streamOf(Device &d, CUstream s) {
  if (!s)
    return d.streams[0] ? d.streams[0].get() : newStream(d, 0);
  for (auto &st : d.streams)
    if (st && reinterpret_cast<CUstream>(st.get()) == s)
      return st.get();
  return nullptr;
}

bool idle(const Device &d) {
  return llvm::all_of(d.streams, [](const std::unique_ptr<Stream> &s) {
    return !s || s->queue.empty();
  });
}

/// The first unused candidate of `kind` matching the call, marked used.
const Candidate *match(Device &d, Candidate::Kind kind, llvm::StringRef kernel,
                       llvm::ArrayRef<uint64_t> values, int64_t bytes) {
  const std::vector<size_t> &list = d.byKind[kind];
  size_t &cursor = d.cursor[kind];
  while (cursor < list.size() && d.candidates[list[cursor]].used)
    ++cursor;
  for (size_t j = cursor; j < list.size(); ++j) {
    Candidate &c = d.candidates[list[j]];
    if (c.used || c.kernel != kernel || c.slots.size() != values.size() ||
        (bytes >= 0 && c.bytes != bytes))
      continue;
    bool same = true;
    for (size_t k = 0; k < values.size() && same; ++k) {
      const Candidate::Slot &s = c.slots[k];
      same = s.kind == Candidate::Slot::Any ||
             (s.kind == Candidate::Slot::Exact && s.v == values[k]) ||
             (s.kind == Candidate::Slot::Arena && d.arena &&
              values[k] == d.arena->base + s.v);
    }
    if (same) {
      c.used = true;
      return &c;
    }
  }
  return nullptr;
}

/// Arena accesses of [lo, hi) offsets.
std::optional<Access> arenaAccess(Device &d, std::pair<int64_t, int64_t> r) {
  if (!d.arena || r.first < 0)
    return std::nullopt;
  return access(d, d.arena->base + r.first, r.second - r.first);
}

/// Instruction `i` as the cpu backend computes it: fp32 copies of the
/// float operands, integers in place, results rounded to their dtype.
void runReference(Device &d, uint8_t *arena, int64_t i) {
  const exec::Instruction &inst = d.plan->instructions[i];
  std::vector<std::vector<float>> wide;
  wide.reserve(inst.operands.size() + inst.results.size());
  std::vector<cpu::OpTensor> operands, results;
  auto bind = [&](int64_t id, bool read) {
    const exec::Value &v = d.plan->values[id];
    uint8_t *p = arena + d.offsets[id];
    cpu::OpTensor t;
    t.type = v.type;
    if (v.type.dtype == DType::I32) {
      t.i32 = reinterpret_cast<int32_t *>(p);
    } else if (v.type.dtype == DType::I64) {
      t.i64 = reinterpret_cast<int64_t *>(p);
    } else {
      std::vector<float> &w = wide.emplace_back(v.type.numElements());
      if (read)
        for (size_t e = 0; e < w.size(); ++e)
          w[e] = loadAs(p, v.type.dtype, e);
      t.f32 = w.data();
    }
    return t;
  };
  for (int64_t id : inst.operands)
    operands.push_back(bind(id, true));
  for (int64_t id : inst.results)
    results.push_back(bind(id, false));
  if (llvm::Error e = cpu::findGraphKernel(inst.op)(inst, operands, results)) {
    std::lock_guard<std::mutex> lock(d.mu);
    error(d, "instruction #" + std::to_string(i) +
                 ": the cpu kernel: " + llvm::toString(std::move(e)));
    return;
  }
  for (size_t k = 0; k < results.size(); ++k)
    if (const float *f = results[k].f32)
      for (int64_t e = 0; e < results[k].type.numElements(); ++e)
        storeAs(arena + d.offsets[inst.results[k]], results[k].type.dtype, e,
                f[e]);
}

/// The work of a matched operation under Options::referenceKernels.
void applyExec(Device &d, const Candidate &c, Op &op) {
  if (c.exec == Candidate::Run)
    return;
  op.poison.clear();
  if (c.exec == Candidate::Skip) {
    op.run = [] {};
    return;
  }
  op.reads.clear();
  op.writes.clear();
  for (auto r : c.reads)
    if (auto a = arenaAccess(d, r))
      op.reads.push_back(std::move(*a));
  for (auto r : c.writes)
    if (auto a = arenaAccess(d, r))
      op.writes.push_back(std::move(*a));
  uint8_t *arena = reinterpret_cast<uint8_t *>(d.arena->base);
  int64_t i = c.instruction;
  op.run = [&d, arena, i] { runReference(d, arena, i); };
}

/// Queues work on `s`: ordered and checked now, run by the stream later.
CUresult enqueue(CUstream s, Op op, int64_t instruction, std::string call) {
  Device &d = deviceOf(s);
  std::lock_guard<std::mutex> lock(d.mu);
  Stream *st = streamOf(d, s);
  if (!st)
    return kInvalidHandle;
  op.fault = std::exchange(d.armed, CUDA_SUCCESS);
  order(d, *st, op, instruction, std::move(call));
  st->queue.push_back(std::move(op));
  d.cv.notify_all();
  return CUDA_SUCCESS;
}

/// A copy or memset: reads `src` (if any), writes `dst`, poisoned first.
CUresult enqueueTransfer(CUstream s, const char *call, Candidate::Kind kind,
                         uintptr_t dst, uintptr_t src, size_t n,
                         std::function<void()> run) {
  Device &d = deviceOf(s);
  Op op;
  op.run = std::move(run);
  int64_t instruction = -1;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    bool srcDevice = kind == Candidate::D2H || kind == Candidate::Copy;
    bool dstDevice = kind != Candidate::D2H;
    if ((src && srcDevice && !deviceRange(d, src, n, call)) ||
        (dstDevice && !deviceRange(d, dst, n, call)))
      return kInvalidValue;
    if (kind == Candidate::H2D || kind == Candidate::D2H) {
      uintptr_t host = kind == Candidate::H2D ? src : dst;
      Alloc *a = findAlloc(d, host, std::max<size_t>(n, 1));
      if (!a || !a->pinned)
        error(d, llvm::formatv("{0}: the host bytes [{1:x}, +{2}) are not "
                               "pinned (on a GPU the copy is synchronous: "
                               "the issuing thread waits for it)",
                               call, host, n)
                     .str());
    }
    if (src)
      if (auto a = access(d, src, n))
        op.reads.push_back(std::move(*a));
    if (auto a = access(d, dst, n))
      op.writes.push_back(std::move(*a));
    if (src && (dst + n <= src || src + n <= dst))
      op.poison.push_back({reinterpret_cast<void *>(dst), n});
    llvm::SmallVector<uint64_t, 2> values;
    if (kind == Candidate::D2H || kind == Candidate::Copy)
      values.push_back(src);
    if (kind != Candidate::D2H)
      values.push_back(dst);
    if (const Candidate *c =
            match(d, kind, "", values, static_cast<int64_t>(n))) {
      instruction = c->instruction;
      applyExec(d, *c, op);
    }
  }
  return enqueue(s, std::move(op), instruction, call);
}

void *allocAligned(size_t n) {
  size_t bytes = (std::max<size_t>(n, 1) + 255) / 256 * 256;
  void *p = std::aligned_alloc(256, bytes);
  if (p)
    std::memset(p, kPoison, bytes);
  return p;
}

CUresult addAlloc(Device &d, void *p, size_t n, bool pinned) {
  if (!p)
    return 2; // CUDA_ERROR_OUT_OF_MEMORY
  std::lock_guard<std::mutex> lock(d.mu);
  auto a = std::make_unique<Alloc>();
  a->base = reinterpret_cast<uintptr_t>(p);
  a->size = n;
  a->pinned = pinned;
  a->index = d.allocCount++;
  // The first device allocation of the arena's size is the arena.
  if (!pinned && !d.arena && d.plan &&
      n == static_cast<size_t>(std::max<int64_t>(d.plan->arenaBytes, 256))) {
    a->arena = true;
    d.arena = a.get();
  }
  a->checked = !pinned && d.checkAll;
  if (a->tracked()) {
    size_t blocks = (n + d.block - 1) / d.block;
    a->writer.assign(blocks, pinned ? kHost : kNever);
    a->done = a->writer;
  }
  {
    Registry &r = registry();
    std::lock_guard<std::mutex> registryLock(r.mu);
    r.allocs[a->base] = &d;
  }
  d.allocs[a->base] = std::move(a);
  return CUDA_SUCCESS;
}

CUresult freeAlloc(Device &d, void *p, const char *call) {
  std::lock_guard<std::mutex> lock(d.mu);
  auto it = d.allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == d.allocs.end())
    return kInvalidValue;
  {
    Registry &r = registry();
    std::lock_guard<std::mutex> registryLock(r.mu);
    r.allocs.erase(it->first);
  }
  if (!idle(d))
    error(d, std::string(call) + " of " + it->second->name() +
                 " while streams still have work in flight");
  if (d.arena == it->second.get())
    d.arena = nullptr;
  d.allocs.erase(it);
  std::free(p);
  return CUDA_SUCCESS;
}

/// The launches, GEMMs, memsets and copies of instruction `i`, as the
/// backend issues them (CudaBackend.cpp, buildCommands; CudaStep.cpp).
void addCandidates(Device &d, const exec::ExecPlan &plan,
                   const PreparedPlan &prep, size_t i) {
  using Slot = Candidate::Slot;
  const exec::Instruction &inst = plan.instructions[i];
  const PreparedInstruction &pi = prep.instructions[i];
  auto offsetOf = [&](int64_t id) { return d.offsets[id]; };
  auto rangeOf = [&](int64_t id) {
    int64_t o = offsetOf(id);
    return std::pair(o, o + plan.values[id].type.bytes());
  };
  auto arena = [](int64_t offset) {
    return Slot{Slot::Arena, static_cast<uint64_t>(offset)};
  };
  auto add = [&](Candidate c) {
    c.instruction = static_cast<int64_t>(i);
    d.byKind[c.kind].push_back(d.candidates.size());
    d.candidates.push_back(std::move(c));
  };
  if (inst.op == exec::OpCode::Fetch || inst.op == exec::OpCode::HostToDevice) {
    add(Candidate::of(Candidate::H2D, {arena(offsetOf(inst.results[0]))},
                      plan.values[inst.results[0]].type.bytes()));
    return;
  }
  if (inst.op == exec::OpCode::DeviceToHost) {
    add(Candidate::of(Candidate::D2H, {arena(offsetOf(inst.operands[0]))},
                      plan.values[inst.results[0]].type.bytes()));
    return;
  }
  auto valueOf = [&](const BufferRef &r) -> int64_t {
    if (r.kind == BufferRef::Operand)
      return inst.operands[r.index];
    if (r.kind == BufferRef::Result)
      return inst.results[r.index];
    return -1;
  };
  auto slotOf = [&](const BufferRef &r) {
    int64_t id = valueOf(r);
    return id < 0 ? Slot{Slot::Any, static_cast<uint64_t>(r.index)}
                  : arena(offsetOf(id) + r.offset);
  };
  if (pi.lowered) {
    size_t first = d.candidates.size();
    for (const LoweredStep &s : pi.lowered->steps) {
      if (auto *l = std::get_if<KernelLaunch>(&s)) {
        Candidate c =
            Candidate::of(Candidate::Launch, {}, -1, l->kernel.name());
        for (const KernelArg &a : l->args) {
          uint64_t bits = 0;
          switch (a.kind) {
          case KernelArg::Buffer: {
            int64_t id = valueOf(a.buffer);
            c.slots.push_back(id < 0 ? Slot{}
                                     : arena(offsetOf(id) + a.buffer.offset));
            if (id >= 0)
              (a.buffer.kind == BufferRef::Operand ? c.reads : c.writes)
                  .push_back(rangeOf(id));
            continue;
          }
          case KernelArg::Null:
            break;
          case KernelArg::I64:
            bits = static_cast<uint64_t>(a.i);
            break;
          case KernelArg::F32: {
            float f = static_cast<float>(a.f);
            std::memcpy(&bits, &f, sizeof(f));
            break;
          }
          case KernelArg::F64:
            std::memcpy(&bits, &a.f, sizeof(a.f));
            break;
          }
          c.slots.push_back({Slot::Exact, bits});
        }
        add(std::move(c));
      } else if (auto *g = std::get_if<GemmCall>(&s)) {
        add(Candidate::of(Candidate::Gemm,
                          {slotOf(g->a), slotOf(g->b), slotOf(g->d)}));
      } else if (auto *m = std::get_if<MemsetCall>(&s)) {
        add(Candidate::of(Candidate::Memset, {slotOf(m->dst)}, m->bytes));
      } else if (auto *c = std::get_if<CopyCall>(&s)) {
        // The backend skips copies onto themselves.
        Slot src = slotOf(c->src), dst = slotOf(c->dst);
        if (c->bytes && !(src == dst))
          add(Candidate::of(Candidate::Copy, {src, dst}, c->bytes));
      }
    }
    bool launches = llvm::any_of(pi.lowered->steps, [](const LoweredStep &s) {
      return std::holds_alternative<KernelLaunch>(s);
    });
    if (d.options.referenceKernels && launches) {
      for (size_t k = first; k < d.candidates.size(); ++k)
        d.candidates[k].exec = Candidate::Skip;
      Candidate &last = d.candidates.back();
      last.exec = Candidate::Reference;
      last.reads.clear();
      last.writes.clear();
      for (int64_t id : inst.operands)
        last.reads.push_back(rangeOf(id));
      for (int64_t id : inst.results)
        last.writes.push_back(rangeOf(id));
    }
    return;
  }
  if (pi.dsaModule < 0)
    return;
  const DsaModuleSpec &spec = prep.dsaModules[pi.dsaModule];
  auto op = [&](size_t k) { return arena(offsetOf(inst.operands[k])); };
  auto res = [&](size_t k) { return arena(offsetOf(inst.results[k])); };
  // dsa3d_grad's fp32 Delta [B, H, N], where it is in the arena.
  const exec::TensorType &qt = plan.values[inst.operands[0]].type;
  int64_t accBytes = qt.shape[0] * qt.shape[1] * qt.shape[2] * 4;
  std::vector<std::pair<int64_t, int64_t>> acc;
  if (pi.deltaOffset >= 0)
    acc.push_back({pi.deltaOffset, pi.deltaOffset + accBytes});
  auto launch = [&](const char *kind, std::vector<Slot> slots,
                    std::vector<size_t> reads, std::vector<size_t> writes,
                    bool readsAcc = false, bool writesAcc = false) {
    Candidate c = Candidate::of(Candidate::Launch, std::move(slots), -1,
                                spec.kernels.at(kind).name);
    for (size_t k : reads)
      c.reads.push_back(rangeOf(inst.operands[k]));
    for (size_t k : writes)
      c.writes.push_back(rangeOf(inst.results[k]));
    if (readsAcc)
      c.reads.insert(c.reads.end(), acc.begin(), acc.end());
    if (writesAcc)
      c.writes.insert(c.writes.end(), acc.begin(), acc.end());
    add(std::move(c));
  };
  if (inst.op == exec::OpCode::Dsa3dOffsets) {
    launch("offsets", {op(0), op(1), res(0)}, {0, 1}, {0});
  } else if (inst.op == exec::OpCode::Dsa3d) {
    launch("forward", {op(0), op(1), op(2), op(3), res(0), res(1), Slot{}},
           {0, 1, 2, 3}, {0, 1});
  } else {
    Slot delta = pi.deltaOffset >= 0 ? arena(pi.deltaOffset) : Slot{};
    // (q, k, v, offsets, o, lse, dout) -> the kernel's (..., o, dout, lse).
    launch("backward",
           {op(0), op(1), op(2), op(3), op(4), op(6), op(5), res(0), delta,
            Slot{}},
           {0, 1, 2, 3, 4, 5, 6}, {0}, false, true);
    launch("backward_keys",
           {op(0), op(1), op(2), op(3), op(6), op(5), delta, res(1), res(2),
            Slot{}},
           {0, 1, 2, 3, 5, 6}, {1, 2}, true);
  }
}

//===----------------------------------------------------------------------===//
// cuBLASLt objects
//===----------------------------------------------------------------------===//

struct Desc {
  int32_t transA = 0, transB = 0;
  uint32_t epilogue = 1;
  const void *bias = nullptr;
};
struct Layout {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
};
constexpr cublasStatus_t kInvalid = 7; // CUBLAS_STATUS_INVALID_VALUE

DType dtypeOf(cudaDataType_t t) {
  return t == CUDA_R_16BF  ? DType::BF16
         : t == CUDA_R_16F ? DType::F16
                           : DType::F32;
}

/// op(A) m x k, op(B) k x n, D m x n, as cuBLASLt reads the layouts.
bool shapesAgree(const Desc &d, const Layout &a, const Layout &b,
                 const Layout &c) {
  uint64_t m = c.rows, n = c.cols, k = d.transA ? a.rows : a.cols;
  return (d.transA ? a.cols : a.rows) == m &&
         (d.transB ? b.cols : b.rows) == k &&
         (d.transB ? b.rows : b.cols) == n && a.type == b.type;
}

/// The bytes a column-major matrix spans.
size_t spanOf(const Layout &l) {
  return ((l.cols - 1) * l.ld + l.rows) * exec::dtypeBytes(dtypeOf(l.type));
}

//===----------------------------------------------------------------------===//
// The entry points
//===----------------------------------------------------------------------===//

CudaDriverApi makeDriver() {
  CudaDriverApi d;
  d.library = "fake";
  d.cuGetErrorString = [](CUresult, const char **s) {
    *s = "fake driver error";
    return CUresult(0);
  };
  d.cuGetErrorName = [](CUresult r, const char **s) {
    *s = r ? "FAKE_ERROR" : "CUDA_SUCCESS";
    return CUresult(0);
  };
  d.cuInit = [](unsigned) {
    ENTER(dev(), "cuInit");
    return CUresult(0);
  };
  d.cuDriverGetVersion = [](int *v) {
    ENTER(dev(), "cuDriverGetVersion");
    *v = 13000;
    return CUresult(0);
  };
  d.cuDeviceGetCount = [](int *n) {
    ENTER(dev(), "cuDeviceGetCount");
    *n = deviceCount();
    return CUresult(0);
  };
  d.cuDeviceGet = [](CUdevice *device, int ordinal) {
    ENTER(dev(), "cuDeviceGet");
    if (ordinal < 0 || ordinal >= deviceCount())
      return kInvalidDevice;
    *device = ordinal;
    return CUresult(0);
  };
  d.cuDeviceGetAttribute = [](int *v, int attr, CUdevice) {
    ENTER(dev(), "cuDeviceGetAttribute");
    // An H100/H200: sm_90, 132 SMs of 2048 threads.
    *v = attr == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR         ? 9
         : attr == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR       ? 0
         : attr == CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR ? 2048
                                                                      : 132;
    return CUresult(0);
  };
  d.cuDeviceGetName = [](char *s, int n, CUdevice) {
    ENTER(dev(), "cuDeviceGetName");
    std::snprintf(s, n, "fake device");
    return CUresult(0);
  };
  d.cuDevicePrimaryCtxRetain = [](CUcontext *c, CUdevice device) {
    ENTER(dev(), "cuDevicePrimaryCtxRetain");
    if (device < 0 || device >= deviceCount())
      return kInvalidDevice;
    *c = reinterpret_cast<CUcontext>(&deviceAt(device));
    return CUresult(0);
  };
  d.cuDevicePrimaryCtxRelease_v2 = [](CUdevice) {
    ENTER(dev(), "cuDevicePrimaryCtxRelease_v2");
    return CUresult(0);
  };
  d.cuCtxSetCurrent = [](CUcontext c) {
    ENTER(dev(), "cuCtxSetCurrent");
    if (c)
      current = reinterpret_cast<Device *>(c);
    return CUresult(0);
  };
  d.cuMemGetInfo_v2 = [](size_t *f, size_t *t) {
    Device &d = dev();
    ENTER(d, "cuMemGetInfo_v2");
    *t = size_t(1) << 36;
    *f = d.options.freeBytes.value_or(*t);
    return CUresult(0);
  };
  d.cuMemAlloc_v2 = [](CUdeviceptr *p, size_t n) {
    Device &d = dev();
    ENTER(d, "cuMemAlloc_v2");
    void *q = allocAligned(n);
    *p = reinterpret_cast<CUdeviceptr>(q);
    return addAlloc(d, q, n, false);
  };
  d.cuMemFree_v2 = [](CUdeviceptr p) {
    void *q = reinterpret_cast<void *>(p);
    Device &d = deviceOfAlloc(q);
    ENTER(d, "cuMemFree_v2");
    return freeAlloc(d, q, "cuMemFree");
  };
  d.cuMemHostAlloc = [](void **p, size_t n, unsigned) {
    Device &d = dev();
    ENTER(d, "cuMemHostAlloc");
    *p = allocAligned(n);
    return addAlloc(d, *p, n, true);
  };
  d.cuMemFreeHost = [](void *p) {
    Device &d = deviceOfAlloc(p);
    ENTER(d, "cuMemFreeHost");
    return freeAlloc(d, p, "cuMemFreeHost");
  };
  d.cuMemcpyHtoDAsync_v2 = [](CUdeviceptr dst, const void *src, size_t n,
                              CUstream s) {
    ENTER(deviceOf(s), "cuMemcpyHtoDAsync_v2");
    return enqueueTransfer(s, "cuMemcpyHtoDAsync", Candidate::H2D, dst,
                           reinterpret_cast<uintptr_t>(src), n, [=] {
                             std::memcpy(reinterpret_cast<void *>(dst), src, n);
                           });
  };
  d.cuMemcpyDtoHAsync_v2 = [](void *dst, CUdeviceptr src, size_t n,
                              CUstream s) {
    ENTER(deviceOf(s), "cuMemcpyDtoHAsync_v2");
    return enqueueTransfer(
        s, "cuMemcpyDtoHAsync", Candidate::D2H,
        reinterpret_cast<uintptr_t>(dst), src, n,
        [=] { std::memcpy(dst, reinterpret_cast<const void *>(src), n); });
  };
  d.cuMemcpyDtoDAsync_v2 = [](CUdeviceptr dst, CUdeviceptr src, size_t n,
                              CUstream s) {
    ENTER(deviceOf(s), "cuMemcpyDtoDAsync_v2");
    return enqueueTransfer(
        s, "cuMemcpyDtoDAsync", Candidate::Copy, dst, src, n, [=] {
          std::memmove(reinterpret_cast<void *>(dst),
                       reinterpret_cast<const void *>(src), n);
        });
  };
  d.cuMemsetD8Async = [](CUdeviceptr dst, unsigned char v, size_t n,
                         CUstream s) {
    ENTER(deviceOf(s), "cuMemsetD8Async");
    return enqueueTransfer(
        s, "cuMemsetD8Async", Candidate::Memset, dst, 0, n,
        [=] { std::memset(reinterpret_cast<void *>(dst), v, n); });
  };
  d.cuStreamCreate = [](CUstream *s, unsigned flags) {
    Device &d = dev();
    ENTER(d, "cuStreamCreate");
    std::lock_guard<std::mutex> lock(d.mu);
    // The legacy NULL stream's implicit synchronisation with blocking
    // streams is not modelled: the backend makes non-blocking ones.
    if (flags != CU_STREAM_NON_BLOCKING) {
      error(d, "cuStreamCreate: only non-blocking streams are modelled");
      return kInvalidValue;
    }
    for (int slot = 1; slot < kMaxStreams; ++slot)
      if (!d.streams[slot]) {
        *s = reinterpret_cast<CUstream>(newStream(d, slot));
        return CUresult(0);
      }
    return CUresult(2);
  };
  d.cuStreamDestroy_v2 = [](CUstream s) {
    Device &d = deviceOf(s);
    ENTER(d, "cuStreamDestroy_v2");
    std::unique_lock<std::mutex> lock(d.mu);
    Stream *st = s ? streamOf(d, s) : nullptr;
    if (!st)
      return kInvalidHandle;
    // Work already queued completes first, as with CUDA.
    st->stop = true;
    d.cv.notify_all();
    lock.unlock();
    st->thread.join();
    {
      Registry &r = registry();
      std::lock_guard<std::mutex> registryLock(r.mu);
      r.streams.erase(s);
    }
    lock.lock();
    d.streams[st->slot].reset();
    return CUresult(0);
  };
  d.cuStreamSynchronize = [](CUstream s) {
    Device &d = deviceOf(s);
    ENTER(d, "cuStreamSynchronize");
    std::unique_lock<std::mutex> lock(d.mu);
    Stream *st = streamOf(d, s);
    if (!st)
      return kInvalidHandle;
    if (!st->queue.empty())
      ++d.stats.spinningWaits;
    d.cv.wait(lock, [&] { return st->queue.empty(); });
    merge(d.host, st->clock);
    return d.broken;
  };
  d.cuStreamWaitEvent = [](CUstream s, CUevent e, unsigned flags) {
    Device &d = deviceOf(s);
    ENTER(d, "cuStreamWaitEvent");
    std::lock_guard<std::mutex> lock(d.mu);
    Stream *st = streamOf(d, s);
    if (!st || !e)
      return kInvalidHandle;
    if (flags)
      return kInvalidValue;
    Event &ev = *reinterpret_cast<Event *>(e);
    // Vector clocks are per device: waits across devices are not modelled.
    if (ev.device != &d) {
      error(d, "cuStreamWaitEvent: the event belongs to another device");
      return kInvalidHandle;
    }
    // The record current now; none: nothing to wait for.
    if (!ev.latest)
      return CUresult(0);
    merge(st->clock, ev.clock);
    Op op;
    op.kind = Op::Wait;
    op.completion = ev.latest;
    st->queue.push_back(std::move(op));
    d.cv.notify_all();
    return CUresult(0);
  };
  d.cuEventCreate = [](CUevent *e, unsigned flags) {
    Device &d = dev();
    ENTER(d, "cuEventCreate");
    auto *ev = new Event;
    ev->device = &d;
    ev->flags = flags;
    *e = reinterpret_cast<CUevent>(ev);
    return CUresult(0);
  };
  d.cuEventDestroy_v2 = [](CUevent e) {
    Device &d = deviceOf(e);
    ENTER(d, "cuEventDestroy_v2");
    std::lock_guard<std::mutex> lock(d.mu);
    // Pending records and waits hold the completion, not the event.
    delete reinterpret_cast<Event *>(e);
    return CUresult(0);
  };
  d.cuEventRecord = [](CUevent e, CUstream s) {
    Device &d = deviceOf(s);
    ENTER(d, "cuEventRecord");
    std::lock_guard<std::mutex> lock(d.mu);
    Stream *st = streamOf(d, s);
    if (!st || !e)
      return kInvalidHandle;
    Event &ev = *reinterpret_cast<Event *>(e);
    if (ev.device != &d) {
      error(d, "cuEventRecord: the event belongs to another device");
      return kInvalidHandle;
    }
    merge(st->clock, d.host);
    ev.latest = std::make_shared<Completion>();
    ev.clock = st->clock;
    Op op;
    op.kind = Op::Record;
    op.completion = ev.latest;
    st->queue.push_back(std::move(op));
    d.cv.notify_all();
    return CUresult(0);
  };
  d.cuEventSynchronize = [](CUevent e) {
    Device &d = deviceOf(e);
    ENTER(d, "cuEventSynchronize");
    std::unique_lock<std::mutex> lock(d.mu);
    if (!e)
      return kInvalidHandle;
    Event &ev = *reinterpret_cast<Event *>(e);
    if (!ev.latest)
      return d.broken;
    if (!(ev.flags & CU_EVENT_BLOCKING_SYNC))
      ++d.stats.spinningWaits;
    std::shared_ptr<Completion> c = ev.latest;
    VClock clock = ev.clock;
    d.cv.wait(lock, [&] { return c->done; });
    merge(d.host, clock);
    return d.broken;
  };
  d.cuEventQuery = [](CUevent e) {
    Device &d = deviceOf(e);
    ENTER(d, "cuEventQuery");
    std::lock_guard<std::mutex> lock(d.mu);
    if (!e)
      return kInvalidHandle;
    const Event &ev = *reinterpret_cast<Event *>(e);
    if (d.broken)
      return d.broken;
    // Orders nothing: a watchdog's look must not hide a missing wait of
    // the backend's (host threads count as one).
    return !ev.latest || ev.latest->done ? CUresult(0) : kNotReady;
  };
  d.cuEventElapsedTime = [](float *ms, CUevent a, CUevent b) {
    Device &d = deviceOf(a);
    ENTER(d, "cuEventElapsedTime");
    std::lock_guard<std::mutex> lock(d.mu);
    const Event &x = *reinterpret_cast<Event *>(a),
                &y = *reinterpret_cast<Event *>(b);
    if ((x.flags | y.flags) & CU_EVENT_DISABLE_TIMING)
      return kInvalidHandle;
    if (!x.latest || !y.latest || !x.latest->done || !y.latest->done)
      return kNotReady;
    *ms = float(y.latest->micros - x.latest->micros) * 1e-3f;
    return CUresult(0);
  };
  d.cuModuleLoadData = [](CUmodule *m, const void *image) {
    ENTER(dev(), "cuModuleLoadData");
    // A cubin is an ELF file.
    if (std::memcmp(image,
                    "\x7f"
                    "ELF",
                    4) != 0)
      return CUresult(200); // CUDA_ERROR_INVALID_IMAGE
    *m = reinterpret_cast<CUmodule>(new char);
    return CUresult(0);
  };
  d.cuModuleUnload = [](CUmodule m) {
    ENTER(dev(), "cuModuleUnload");
    delete reinterpret_cast<char *>(m);
    return CUresult(0);
  };
  d.cuModuleGetFunction = [](CUfunction *f, CUmodule, const char *name) {
    ENTER(dev(), "cuModuleGetFunction");
    Function fn;
    fn.name = name;
    if (const KernelLookup &kernels = dev().kernels)
      fn.host = kernels(name);
    fn.dsa = HostDsa::parse(name);
    if (!fn.host.entry && !fn.dsa)
      return CUresult(500); // CUDA_ERROR_NOT_FOUND
    llvm::StringRef n(name);
    // The prefixes cover the tensor-core kernels too (ms_attention_fwd_tc64_
    // ...): same argument lists and contracts, the head dim in the kind.
    for (auto [prefix, kind, types] :
         {std::tuple<const char *, int, size_t>{"ms_attention_fwd_", 0, 4},
          {"ms_attention_bwd_dq_", 1, 6},
          {"ms_attention_bwd_dkv_", 2, 6}})
      if (n.starts_with(prefix))
        fn.attention = HostAttention{typesOf(n, types), kind};
    static std::mutex mu;
    static std::vector<std::unique_ptr<Function>> owned;
    std::lock_guard<std::mutex> lock(mu);
    owned.push_back(std::make_unique<Function>(std::move(fn)));
    *f = reinterpret_cast<CUfunction>(owned.back().get());
    return CUresult(0);
  };
  d.cuFuncSetAttribute = [](CUfunction, int, int) {
    ENTER(dev(), "cuFuncSetAttribute");
    return CUresult(0);
  };
  d.cuLaunchKernel = [](CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                        unsigned bx, unsigned by, unsigned bz, unsigned smem,
                        CUstream s, void **params, void **extra) {
    ENTER(deviceOf(s), "cuLaunchKernel");
    const Function &fn = *reinterpret_cast<Function *>(f);
    if (!gx || !gy || !gz || !bx || by != 1 || bz != 1 || extra)
      return kInvalidValue;
    if (!fn.dsa && (bx != kernelBlockThreads(fn.name) || smem))
      return kInvalidValue;
    // Arguments are copied at the launch.
    std::vector<uint64_t> slots(fn.params());
    for (size_t i = 0; i < slots.size(); ++i)
      std::memcpy(&slots[i], params[i], sizeof(uint64_t));
    Op op;
    op.run = [&fn, gx, gy, gz, slots]() mutable {
      std::vector<void *> args;
      for (uint64_t &slot : slots)
        args.push_back(&slot);
      if (fn.dsa) {
        fn.dsa->run(gz, args.data());
      } else if (fn.attention) {
        fn.attention->run(args.data());
      } else {
        std::lock_guard<std::mutex> lock(kernelMu);
        fn.host.entry(gx, gy, gz, args.data());
      }
    };
    Device &d = deviceOf(s);
    int64_t instruction = -1;
    {
      std::lock_guard<std::mutex> lock(d.mu);
      ++d.stats.launches;
      if (const Candidate *c =
              match(d, Candidate::Launch, fn.name, slots, -1)) {
        instruction = c->instruction;
        for (auto r : c->reads)
          if (auto a = arenaAccess(d, r))
            op.reads.push_back(std::move(*a));
        for (auto r : c->writes)
          if (auto a = arenaAccess(d, r))
            op.writes.push_back(std::move(*a));
        applyExec(d, *c, op);
      } else {
        error(d, "cuLaunchKernel (" + fn.name +
                     "): no instruction of the plan launches it with these "
                     "arguments");
      }
    }
    return enqueue(s, std::move(op), instruction, "cuLaunchKernel " + fn.name);
  };
  return d;
}

CublasLtApi makeCublasLt() {
  CublasLtApi l;
  l.library = "fake";
  l.cublasLtCreate = [](cublasLtHandle_t *h) {
    *h = reinterpret_cast<cublasLtHandle_t>(new char);
    return cublasStatus_t(0);
  };
  l.cublasLtDestroy = [](cublasLtHandle_t h) {
    delete reinterpret_cast<char *>(h);
    return cublasStatus_t(0);
  };
  l.cublasLtGetVersion = []() { return size_t(130000); };
  l.cublasLtGetStatusName = [](cublasStatus_t) { return "FAKE_STATUS"; };
  l.cublasLtMatmulDescCreate = [](cublasLtMatmulDesc_t *d,
                                  cublasComputeType_t compute,
                                  cudaDataType_t scale) {
    if (compute != CUBLAS_COMPUTE_32F || scale != CUDA_R_32F)
      return kInvalid;
    *d = reinterpret_cast<cublasLtMatmulDesc_t>(new Desc);
    return cublasStatus_t(0);
  };
  l.cublasLtMatmulDescDestroy = [](cublasLtMatmulDesc_t d) {
    delete reinterpret_cast<Desc *>(d);
    return cublasStatus_t(0);
  };
  l.cublasLtMatmulDescSetAttribute = [](cublasLtMatmulDesc_t dd,
                                        cublasLtMatmulDescAttributes_t attr,
                                        const void *buf, size_t size) {
    Desc &d = *reinterpret_cast<Desc *>(dd);
    if ((attr == CUBLASLT_MATMUL_DESC_TRANSA ||
         attr == CUBLASLT_MATMUL_DESC_TRANSB ||
         attr == CUBLASLT_MATMUL_DESC_EPILOGUE) &&
        size != 4)
      return kInvalid;
    if (attr == CUBLASLT_MATMUL_DESC_TRANSA)
      std::memcpy(&d.transA, buf, 4);
    else if (attr == CUBLASLT_MATMUL_DESC_TRANSB)
      std::memcpy(&d.transB, buf, 4);
    else if (attr == CUBLASLT_MATMUL_DESC_EPILOGUE)
      std::memcpy(&d.epilogue, buf, 4);
    else if (attr == CUBLASLT_MATMUL_DESC_BIAS_POINTER &&
             size == sizeof(void *))
      std::memcpy(&d.bias, buf, sizeof(void *));
    else
      return kInvalid;
    return cublasStatus_t(0);
  };
  l.cublasLtMatrixLayoutCreate = [](cublasLtMatrixLayout_t *out,
                                    cudaDataType_t type, uint64_t rows,
                                    uint64_t cols, int64_t ld) {
    if (ld < static_cast<int64_t>(rows) || ld < 1)
      return kInvalid;
    *out = reinterpret_cast<cublasLtMatrixLayout_t>(
        new Layout{type, rows, cols, ld});
    return cublasStatus_t(0);
  };
  l.cublasLtMatrixLayoutDestroy = [](cublasLtMatrixLayout_t x) {
    delete reinterpret_cast<Layout *>(x);
    return cublasStatus_t(0);
  };
  l.cublasLtMatmulPreferenceCreate = [](cublasLtMatmulPreference_t *p) {
    *p = reinterpret_cast<cublasLtMatmulPreference_t>(new char);
    return cublasStatus_t(0);
  };
  l.cublasLtMatmulPreferenceDestroy = [](cublasLtMatmulPreference_t p) {
    delete reinterpret_cast<char *>(p);
    return cublasStatus_t(0);
  };
  l.cublasLtMatmulPreferenceSetAttribute =
      [](cublasLtMatmulPreference_t, cublasLtMatmulPreferenceAttributes_t attr,
         const void *buf, size_t size) {
        if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES)
          return size == 8 ? cublasStatus_t(0) : kInvalid;
        if (attr >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES &&
            attr <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES + 3)
          return size == 4 ? cublasStatus_t(0) : kInvalid;
        return kInvalid;
      };
  l.cublasLtMatmulAlgoGetHeuristic =
      [](cublasLtHandle_t, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a,
         cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
         cublasLtMatrixLayout_t dd, cublasLtMatmulPreference_t, int requested,
         cublasLtMatmulHeuristicResult_t *results, int *found) {
        *found = 0;
        if (requested < 1 || c != dd ||
            !shapesAgree(
                *reinterpret_cast<Desc *>(d), *reinterpret_cast<Layout *>(a),
                *reinterpret_cast<Layout *>(b), *reinterpret_cast<Layout *>(c)))
          return cublasStatus_t(0);
        results[0] = {};
        *found = 1;
        return cublasStatus_t(0);
      };
  l.cublasLtMatmul = [](cublasLtHandle_t, cublasLtMatmulDesc_t dd,
                        const void *alpha, const void *A,
                        cublasLtMatrixLayout_t al, const void *B,
                        cublasLtMatrixLayout_t bl, const void *beta,
                        const void *C, cublasLtMatrixLayout_t cl, void *D,
                        cublasLtMatrixLayout_t dl, const cublasLtMatmulAlgo_t *,
                        void *, size_t, CUstream s) {
    Device &dv = deviceOf(s);
    if (enter(dv, "cublasLtMatmul"))
      return kInvalid;
    const Desc &d = *reinterpret_cast<const Desc *>(dd);
    const Layout &a = *reinterpret_cast<Layout *>(al),
                 &b = *reinterpret_cast<Layout *>(bl),
                 &o = *reinterpret_cast<Layout *>(dl);
    if (*static_cast<const float *>(alpha) != 1.0f ||
        *static_cast<const float *>(beta) != 0.0f || C != D || cl != dl ||
        !shapesAgree(d, a, b, o))
      return kInvalid;
    GemmCall g;
    g.transA = d.transA;
    g.transB = d.transB;
    g.m = o.rows;
    g.n = o.cols;
    g.k = d.transA ? a.rows : a.cols;
    g.lda = a.ld;
    g.ldb = b.ld;
    g.ldd = o.ld;
    g.abType = dtypeOf(a.type);
    g.dType = dtypeOf(o.type);
    g.hasBias = d.epilogue == CUBLASLT_EPILOGUE_BIAS;
    if (g.hasBias && !d.bias)
      return kInvalid;
    const void *bias = d.bias;
    Op op;
    op.run = [=] { naiveGemm(g, A, B, D, bias); };
    int64_t instruction = -1;
    {
      std::lock_guard<std::mutex> lock(dv.mu);
      auto at = [](const void *p) { return reinterpret_cast<uintptr_t>(p); };
      size_t biasBytes = g.m * exec::dtypeBytes(g.dType);
      if (!deviceRange(dv, at(A), spanOf(a), "cublasLtMatmul (A)") ||
          !deviceRange(dv, at(B), spanOf(b), "cublasLtMatmul (B)") ||
          !deviceRange(dv, at(D), spanOf(o), "cublasLtMatmul (D)") ||
          (g.hasBias &&
           !deviceRange(dv, at(d.bias), biasBytes, "cublasLtMatmul (bias)")))
        return kInvalid;
      for (auto [p, n] :
           {std::pair(at(A), spanOf(a)), std::pair(at(B), spanOf(b)),
            std::pair(g.hasBias ? at(d.bias) : 0, biasBytes)})
        if (p)
          if (auto x = access(dv, p, n))
            op.reads.push_back(std::move(*x));
      if (auto x = access(dv, at(D), spanOf(o)))
        op.writes.push_back(std::move(*x));
      ++dv.stats.gemms;
      if (const Candidate *c =
              match(dv, Candidate::Gemm, "", {at(A), at(B), at(D)}, -1)) {
        instruction = c->instruction;
        applyExec(dv, *c, op);
      }
    }
    return enqueue(s, std::move(op), instruction, "cublasLtMatmul")
               ? kInvalid
               : cublasStatus_t(0);
  };
  return l;
}

//===----------------------------------------------------------------------===//
// NCCL
//===----------------------------------------------------------------------===//

constexpr ncclResult_t kNcclSystemError = 2, kNcclInvalidArgument = 4,
                       kNcclInvalidUsage = 5, kNcclRemoteError = 6;

/// One collective call as a rank issues it.
struct NcclCall {
  enum Kind { Broadcast, Reduce, AllReduce } kind = Broadcast;
  uintptr_t send = 0, recv = 0;
  size_t count = 0;
  DType type = DType::F32;
  int root = 0; ///< Broadcast and Reduce

  /// A call of `kind` as NCCL's entry points take it.
  static NcclCall of(Kind kind, const void *send, void *recv, size_t count,
                     int root = 0) {
    NcclCall call;
    call.kind = kind;
    call.send = reinterpret_cast<uintptr_t>(send);
    call.recv = reinterpret_cast<uintptr_t>(recv);
    call.count = count;
    call.root = root;
    return call;
  }

  const char *name() const {
    return kind == Broadcast ? "ncclBroadcast"
           : kind == Reduce  ? "ncclReduce"
                             : "ncclAllReduce";
  }
  std::string describe() const {
    std::string what =
        llvm::formatv("{0} of {1} {2}", name(), count, exec::dtypeName(type));
    if (kind == Broadcast)
      return what + " from root " + std::to_string(root);
    if (kind == Reduce)
      return what + " to root " + std::to_string(root);
    return what;
  }
  /// Whether this rank (`rank`) reads its send bytes and writes its
  /// receive bytes.
  bool reads(int rank) const { return kind != Broadcast || rank == root; }
  bool writes(int rank) const { return kind != Reduce || rank == root; }
};

std::optional<DType> dtypeOfNccl(ncclDataType_t t) {
  if (t == ncclBfloat16)
    return DType::BF16;
  if (t == ncclFloat16)
    return DType::F16;
  if (t == ncclFloat32)
    return DType::F32;
  return std::nullopt;
}

/// One collective (a call, or a group's calls on one communicator) as the
/// ranks' stream operations reach it.
struct Collective {
  std::vector<std::optional<std::vector<NcclCall>>> calls; ///< by rank
  int arrived = 0, left = 0;
  bool done = false;
  std::string problem; ///< once done: why it moved nothing
};

/// What the ranks of one ncclUniqueId share.
struct Clique {
  int size = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<bool> joined;                  ///< by rank
  std::map<int64_t, Collective> collectives; ///< by sequence number
  int aborted = -1; ///< the first rank that called ncclCommAbort
};

struct Comm {
  std::shared_ptr<Clique> clique;
  int rank = 0;
  Device *device = nullptr;
  int64_t issued = 0; ///< collectives issued: the next one's number - 1
};

/// The cliques still being joined, by id.
struct Ids {
  std::mutex mu;
  int64_t made = 0;
  std::map<std::string, std::shared_ptr<Clique>> joining;
};

Ids &ids() {
  static Ids i;
  return i;
}

/// Why the ranks' calls of `c` differ (naming two of them), or empty.
std::string disagreement(const Collective &c) {
  const std::vector<NcclCall> &first = *c.calls[0];
  for (size_t r = 1; r < c.calls.size(); ++r) {
    const std::vector<NcclCall> &other = *c.calls[r];
    if (other.size() != first.size())
      return llvm::formatv("rank 0 issued a group of {0} calls, rank {1} one "
                           "of {2}",
                           first.size(), r, other.size());
    for (size_t j = 0; j < first.size(); ++j) {
      const NcclCall &a = first[j], &b = other[j];
      if (a.kind == b.kind && a.count == b.count && a.type == b.type &&
          (a.kind == NcclCall::AllReduce || a.root == b.root))
        continue;
      std::string which =
          first.size() > 1
              ? llvm::formatv(" (call {0} of the group)", j + 1).str()
              : "";
      return llvm::formatv("rank 0 issued {0}, rank {1} {2}{3}", a.describe(),
                           r, b.describe(), which);
    }
  }
  return "";
}

/// Moves and sums the bytes of every rank's calls: sums in fp32 in rank
/// order, rounded to the element type.
void runCollective(const Collective &c) {
  auto at = [](uintptr_t p) { return reinterpret_cast<void *>(p); };
  for (size_t j = 0; j < c.calls[0]->size(); ++j) {
    auto call = [&](size_t r) -> const NcclCall & { return (*c.calls[r])[j]; };
    const NcclCall &first = call(0);
    if (first.kind == NcclCall::Broadcast) {
      uintptr_t src = call(first.root).send;
      for (size_t r = 0; r < c.calls.size(); ++r)
        if (call(r).recv != src)
          std::memcpy(at(call(r).recv), at(src),
                      first.count * exec::dtypeBytes(first.type));
      continue;
    }
    for (size_t i = 0; i < first.count; ++i) {
      float sum = 0;
      for (size_t r = 0; r < c.calls.size(); ++r)
        sum += loadAs(at(call(r).send), first.type, i);
      for (size_t r = 0; r < c.calls.size(); ++r)
        if (call(r).writes(static_cast<int>(r)))
          storeAs(at(call(r).recv), first.type, i, sum);
    }
  }
}

/// A rank's operation of collective `seq` when its stream reaches it:
/// waits for every rank's, then the last to arrive checks and runs it.
void rendezvous(Clique &q, int rank, int64_t seq,
                const std::vector<NcclCall> &calls, Device &d,
                const std::string &label) {
  std::string problem;
  {
    std::unique_lock<std::mutex> lock(q.mu);
    Collective &c = q.collectives[seq];
    if (c.calls.empty())
      c.calls.resize(q.size);
    c.calls[rank] = calls;
    if (++c.arrived == q.size) {
      c.problem = q.aborted >= 0 ? llvm::formatv("rank {0} aborted its "
                                                 "communicator",
                                                 q.aborted)
                                       .str()
                                 : disagreement(c);
      if (c.problem.empty())
        runCollective(c);
      c.done = true;
      q.cv.notify_all();
    } else {
      q.cv.wait_for(lock, kNcclTimeout,
                    [&] { return c.done || q.aborted >= 0; });
    }
    if (c.done) {
      problem = c.problem;
      if (++c.left == q.size)
        q.collectives.erase(seq);
    } else if (q.aborted >= 0) {
      problem = llvm::formatv("rank {0} aborted its communicator", q.aborted);
    } else {
      problem = llvm::formatv("no other rank issued it within {0} s (missing:",
                              kNcclTimeout.count());
      for (size_t r = 0; r < c.calls.size(); ++r)
        if (!c.calls[r])
          problem += " rank " + std::to_string(r);
      problem += ")";
    }
  }
  if (!problem.empty()) {
    std::lock_guard<std::mutex> lock(d.mu);
    error(d, label + ": " + problem);
  }
}

/// Queues rank `c`'s next collective (`calls`) on `s`: ordered and checked
/// like a copy, it reads the bytes it sends and writes those it receives.
ncclResult_t issue(Comm &c, CUstream s, std::vector<NcclCall> calls) {
  Device &d = deviceOf(s);
  // A call refused below takes no number, as NCCL's refused calls match
  // nothing.
  int64_t seq = c.issued + 1;
  std::string label = calls[0].name();
  if (calls.size() > 1) {
    bool same = llvm::all_of(
        calls, [&](const NcclCall &x) { return x.kind == calls[0].kind; });
    label = llvm::formatv("a group of {0} {1}", calls.size(),
                          same ? label : "collective calls");
  }
  label += llvm::formatv(" (collective #{0} of rank {1})", seq, c.rank).str();
  Op op;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (&d != c.device) {
      error(d, label + ": the stream is not on the communicator's device");
      return kNcclInvalidArgument;
    }
    for (const NcclCall &call : calls) {
      size_t bytes = call.count * exec::dtypeBytes(call.type);
      if (!bytes)
        continue;
      bool reads = call.reads(c.rank), writes = call.writes(c.rank);
      if ((reads && !deviceRange(d, call.send, bytes, call.name())) ||
          (writes && !deviceRange(d, call.recv, bytes, call.name())))
        return kNcclInvalidArgument;
      if (reads)
        if (auto a = access(d, call.send, bytes))
          op.reads.push_back(std::move(*a));
      if (writes) {
        if (auto a = access(d, call.recv, bytes))
          op.writes.push_back(std::move(*a));
        if (!reads || call.recv + bytes <= call.send ||
            call.send + bytes <= call.recv)
          op.poison.push_back({reinterpret_cast<void *>(call.recv), bytes});
      }
    }
  }
  c.issued = seq;
  op.run = [clique = c.clique, rank = c.rank, seq, calls, &d, label] {
    rendezvous(*clique, rank, seq, calls, d, label);
  };
  op.mustRun = true;
  return enqueue(s, std::move(op), -1, label) ? kNcclInvalidArgument
                                              : ncclSuccess;
}

/// The calls of the open group (ncclGroupStart) of this thread.
struct Grouped {
  Comm *comm;
  CUstream stream;
  NcclCall call;
};
thread_local int groupDepth = 0;
thread_local std::vector<Grouped> grouped;

ncclResult_t collective(NcclCall call, ncclDataType_t type, ncclRedOp_t op,
                        ncclComm_t comm, CUstream s) {
  std::optional<DType> t = dtypeOfNccl(type);
  if (!comm || !t || op != ncclSum)
    return kNcclInvalidArgument;
  Comm &c = *reinterpret_cast<Comm *>(comm);
  call.type = *t;
  if (call.kind != NcclCall::AllReduce &&
      (call.root < 0 || call.root >= c.clique->size))
    return kNcclInvalidArgument;
  if (groupDepth > 0) {
    grouped.push_back({&c, s, call});
    return ncclSuccess;
  }
  return issue(c, s, {call});
}

NcclApi makeNccl() {
  NcclApi n;
  n.library = "fake";
  n.ncclGetVersion = [](int *v) {
    *v = 22800;
    return ncclSuccess;
  };
  n.ncclGetErrorString = [](ncclResult_t r) -> const char * {
    switch (r) {
    case ncclSuccess:
      return "no error";
    case kNcclSystemError:
      return "unhandled system error";
    case kNcclInvalidArgument:
      return "invalid argument";
    case kNcclInvalidUsage:
      return "invalid usage";
    case kNcclRemoteError:
      return "remote process exited or there was a network error";
    default:
      return "fake NCCL error";
    }
  };
  n.ncclGetUniqueId = [](ncclUniqueId *id) {
    Ids &i = ids();
    std::lock_guard<std::mutex> lock(i.mu);
    *id = {};
    std::snprintf(id->internal, sizeof(id->internal), "fake-nccl-%lld",
                  static_cast<long long>(++i.made));
    return ncclSuccess;
  };
  n.ncclCommInitRank = [](ncclComm_t *comm, int nranks, ncclUniqueId id,
                          int rank) {
    if (!comm || nranks < 1 || rank < 0 || rank >= nranks)
      return kNcclInvalidArgument;
    std::string key(id.internal, sizeof(id.internal));
    std::shared_ptr<Clique> q;
    {
      Ids &i = ids();
      std::lock_guard<std::mutex> lock(i.mu);
      std::shared_ptr<Clique> &slot = i.joining[key];
      if (!slot) {
        slot = std::make_shared<Clique>();
        slot->size = nranks;
        slot->joined.assign(nranks, false);
      }
      q = slot;
    }
    std::unique_lock<std::mutex> lock(q->mu);
    if (q->size != nranks || q->joined[rank])
      return kNcclInvalidUsage;
    q->joined[rank] = true;
    q->cv.notify_all();
    // As NCCL's: returns once every rank has joined.
    if (!q->cv.wait_for(lock, kNcclTimeout, [&] {
          return llvm::all_of(q->joined, [](bool j) { return j; });
        }))
      return kNcclSystemError;
    lock.unlock();
    {
      Ids &i = ids();
      std::lock_guard<std::mutex> idsLock(i.mu);
      i.joining.erase(key);
    }
    *comm = reinterpret_cast<ncclComm_t>(new Comm{q, rank, &dev()});
    return ncclSuccess;
  };
  n.ncclCommDestroy = [](ncclComm_t comm) {
    // Queued operations hold the clique, not the communicator.
    delete reinterpret_cast<Comm *>(comm);
    return ncclSuccess;
  };
  n.ncclCommAbort = [](ncclComm_t comm) {
    Comm *c = reinterpret_cast<Comm *>(comm);
    {
      std::lock_guard<std::mutex> lock(c->clique->mu);
      if (c->clique->aborted < 0)
        c->clique->aborted = c->rank;
      c->clique->cv.notify_all();
    }
    delete c;
    return ncclSuccess;
  };
  n.ncclCommGetAsyncError = [](ncclComm_t comm, ncclResult_t *r) {
    Comm &c = *reinterpret_cast<Comm *>(comm);
    std::lock_guard<std::mutex> lock(c.clique->mu);
    *r = c.clique->aborted >= 0 ? kNcclRemoteError : ncclSuccess;
    return ncclSuccess;
  };
  n.ncclGroupStart = [] {
    ++groupDepth;
    return ncclSuccess;
  };
  n.ncclGroupEnd = [] {
    if (groupDepth == 0)
      return kNcclInvalidUsage;
    if (--groupDepth > 0)
      return ncclSuccess;
    std::vector<Grouped> calls = std::move(grouped);
    grouped.clear();
    // One collective per communicator, in the order of their first calls.
    std::vector<Comm *> comms;
    for (const Grouped &g : calls)
      if (!llvm::is_contained(comms, g.comm))
        comms.push_back(g.comm);
    ncclResult_t result = ncclSuccess;
    for (Comm *comm : comms) {
      std::vector<NcclCall> mine;
      CUstream stream = nullptr;
      bool oneStream = true;
      for (const Grouped &g : calls)
        if (g.comm == comm) {
          oneStream &= mine.empty() || g.stream == stream;
          stream = g.stream;
          mine.push_back(g.call);
        }
      ncclResult_t r =
          oneStream ? issue(*comm, stream, std::move(mine)) : kNcclInvalidUsage;
      if (result == ncclSuccess)
        result = r;
    }
    return result;
  };
  n.ncclBroadcast = [](const void *send, void *recv, size_t count,
                       ncclDataType_t type, int root, ncclComm_t comm,
                       CUstream s) {
    return collective(
        NcclCall::of(NcclCall::Broadcast, send, recv, count, root), type,
        ncclSum, comm, s);
  };
  n.ncclReduce = [](const void *send, void *recv, size_t count,
                    ncclDataType_t type, ncclRedOp_t op, int root,
                    ncclComm_t comm, CUstream s) {
    return collective(NcclCall::of(NcclCall::Reduce, send, recv, count, root),
                      type, op, comm, s);
  };
  n.ncclAllReduce = [](const void *send, void *recv, size_t count,
                       ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                       CUstream s) {
    return collective(NcclCall::of(NcclCall::AllReduce, send, recv, count),
                      type, op, comm, s);
  };
  return n;
}

} // namespace

//===----------------------------------------------------------------------===//
// The interface
//===----------------------------------------------------------------------===//

namespace {

/// The calling thread's device, prepared for setUp: the pinned blocks
/// destroyed backends kept are freed first (which makes their context
/// current), and everything from before forgotten.
Device &resetDevice(const exec::ExecPlan *plan, KernelLookup kernels,
                    const Options &options) {
  Device &d = dev();
  releasePinnedPools();
  current = &d;
  std::lock_guard<std::mutex> lock(d.mu);
  d.plan = plan;
  d.kernels = std::move(kernels);
  d.options = options;
  d.block = plan ? std::max<int64_t>(plan->alignment, 1) : 256;
  d.checkAll = !plan;
  d.arena = nullptr;
  d.allocCount = 0;
  d.ops.assign(1, OpInfo{});
  d.host = VClock{};
  d.stepStart = 1;
  d.errors.clear();
  d.moreErrors = 0;
  d.stats = Stats{};
  d.faultFired = false;
  d.armed = d.broken = CUDA_SUCCESS;
  d.candidates.clear();
  for (auto &k : d.byKind)
    k.clear();
  d.cursor = {};
  d.offsets.clear();
  if (!d.allocs.empty() ||
      llvm::any_of(d.streams, [](auto &s) { return s && s->slot > 0; }))
    error(d, "setUp: a backend of an earlier setUp is still alive");
  return d;
}

} // namespace

void setUp(const exec::ExecPlan &plan, const PreparedPlan &prep,
           KernelLookup kernels, const Options &options) {
  Device &d = resetDevice(&plan, std::move(kernels), options);
  std::lock_guard<std::mutex> lock(d.mu);
  d.offsets.assign(plan.values.size(), -1);
  for (size_t id = 0; id < plan.values.size(); ++id) {
    int64_t v = static_cast<int64_t>(id);
    for (int guard = 0;
         guard < 64 && plan.values[v].offset < 0 && plan.values[v].viewOf;
         ++guard)
      v = *plan.values[v].viewOf;
    d.offsets[id] = plan.values[v].offset;
  }
  for (size_t i = 0; i < plan.instructions.size(); ++i)
    addCandidates(d, plan, prep, i);
}

void setUp(const Options &options) { resetDevice(nullptr, nullptr, options); }

void useDevice(int index) { current = &deviceAt(index); }

void beginStep(uint64_t seed) {
  Device &d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  if (!idle(d))
    error(d, "work of the last step is still in flight");
  for (auto &s : d.streams)
    if (s)
      s->rng.seed(seed * kMaxStreams + s->slot);
  d.stepStart = static_cast<int64_t>(d.ops.size());
  for (Candidate &c : d.candidates)
    c.used = false;
  d.cursor = {};
}

std::vector<std::string> endStep() {
  Device &d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  if (!idle(d))
    error(d, "the step returned with work still in flight");
  std::vector<std::string> e = d.errors;
  if (d.moreErrors)
    e.push_back("... and " + std::to_string(d.moreErrors) + " more");
  return e;
}

Stats stats() {
  Device &d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.stats;
}

bool waitForFault(std::chrono::milliseconds timeout) {
  Device &d = dev();
  std::unique_lock<std::mutex> lock(d.mu);
  return d.cv.wait_for(lock, timeout, [&] { return d.faultFired; });
}

const CudaDriverApi &driver() {
  static const CudaDriverApi d = makeDriver();
  return d;
}

const CublasLtApi &cublasLt() {
  static const CublasLtApi l = makeCublasLt();
  return l;
}

const NcclApi &nccl() {
  static const NcclApi n = makeNccl();
  return n;
}

CudaOptions backendOptions() {
  CudaOptions options;
  options.driver = &driver();
  options.cublasLt = &cublasLt();
  options.nccl = &nccl();
  return options;
}

bool setUpReference(const exec::ExecPlan &plan, const PreparedPlan &prep,
                    std::string &why, Options options) {
  if (!nvrtcAvailable(&why))
    return false;
  options.referenceKernels = true;
  std::map<std::string, size_t> params;
  for (const KernelInstance &k : prep.kernels)
    params[k.name()] = kernelParameterTypes(k).size();
  setUp(
      plan, prep,
      [params](const std::string &name) {
        auto it = params.find(name);
        if (it == params.end())
          return HostKernel{};
        // Never called: referenceKernels runs the cpu kernel instead.
        return HostKernel{[](unsigned, unsigned, unsigned, void **) {},
                          it->second};
      },
      options);
  return true;
}

} // namespace megaslide::cuda::fake
