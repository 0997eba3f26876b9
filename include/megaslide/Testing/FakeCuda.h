//===- FakeCuda.h - An asynchronous fake CUDA device for tests --*- C++ -*-===//
//
// The driver and cuBLASLt entry points of cuda/CudaApi.h as host code, so
// the cuda backend runs whole plans without a GPU. Device memory is host
// memory; every CUstream is a thread that runs its queue in order (copies,
// memsets, kernels, GEMMs, event records, waits), with a random delay
// before each copy, memset, kernel and GEMM, so the streams interleave
// differently under every seed. Events complete when their stream reaches
// them; cuStreamWaitEvent waits for the event's record current at the
// call; cuEventSynchronize and cuStreamSynchronize block the caller;
// cuEventElapsedTime measures completion times. Kernels run on the host:
// the dense ones on a host build of the generated CUDA C++ (given by the
// test), global attention and 3D-DSA as host loops with the kernels'
// argument lists, GEMMs naively as cuBLASLt's documentation defines the
// descriptors.
//
// What it checks, each failure an error naming the instruction, the call
// and the bytes (endStep()):
//  * ordering, deterministically: every operation is given the vector
//    clock of its stream at the call (program order on a stream, the
//    clocks of the events it waits for, what host threads had synchronised
//    with). A read of bytes whose last writer in issue order is not ordered
//    before it is a missing wait (read after write); so is a write not
//    ordered after every earlier read and write of its bytes on another
//    stream (write after read or write). Timing plays no part: a missing
//    wait is found under every seed;
//  * liveness: a read of arena bytes that no operation of this step wrote
//    (never written, or last written in an earlier step);
//  * the execution itself: when an operation runs, its input bytes must
//    hold what the writer it was ordered after wrote (a check of the
//    fake's own streams, and what a broken wait looks like at run time);
//    a copy from pinned memory written by the host must see the same bytes
//    as at the call (the host overwrote an in-flight source);
//  * host reads of pinned memory: a device-to-host copy first fills its
//    destination with NaN, waits, then copies, so the host reading a
//    result before waiting for its copy's event reads NaN or stale bytes,
//    and the numbers (or the backend's finite checks) fail;
//  * asynchronous copies from or to host memory that is not pinned (on a
//    GPU they are synchronous: the issuing thread waits for them);
//  * launches and GEMMs match the plan: arguments as the instruction's
//    lowering gives them, shapes and descriptors as cuBLASLt reads them,
//    ranges inside their allocations;
//  * host waits that would spin a core on a real GPU (stats()).
//
// Several fake devices can live in one process, one per rank of a job run
// as threads (useDevice), and a fake NCCL (nccl()) runs the collectives
// between them: each collective is an operation on its rank's stream,
// ordered and checked like a copy, that waits for the same collective of
// every rank when it runs; the ranks must agree on it (op, count, element
// type, root), and it moves or sums the bytes (sums in fp32 in rank
// order, rounded to the element type). Vector clocks are per device:
// an event recorded or waited for on another device's stream is an error.
//
// The granularity is the plan's alignment (256 bytes): every buffer of the
// arena and of the pinned pools starts on such a block, so a block belongs
// to one buffer at a time. What a kernel reads and writes is known from
// the plan: its operands and results (arena ranges of the values). What
// it cannot see: accesses of kernels to scratch memory (untracked), host
// writes to pinned memory (only their effect on an in-flight copy), host
// reads (only through the numbers), and orderings the backend makes
// between its own host threads: host threads count as one, so a wait one
// thread made orders the later calls of all of them. Whether bytes hold
// the right value at all (the memory plan) is exec::validate's.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TEST_UNIT_FAKECUDA_H
#define MEGASLIDE_TEST_UNIT_FAKECUDA_H

#include "megaslide/runtime/cuda/CudaApi.h"
#include "megaslide/runtime/cuda/CudaBackend.h"
#include "megaslide/runtime/cuda/ElementwiseKernels.h"
#include "megaslide/runtime/cuda/GraphOpLowering.h"
#include "megaslide/runtime/plan/ExecPlan.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace megaslide::cuda::fake {

/// The host build of one generated kernel: entry(grid x, y, z, argument
/// pointers) and how many arguments it takes.
struct HostKernel {
  void (*entry)(unsigned, unsigned, unsigned, void **) = nullptr;
  size_t params = 0;
};
/// The host build of the kernel named `name`; no entry when there is none.
using KernelLookup = std::function<HostKernel(const std::string &name)>;

/// The `nth` call (counting from setUp, 1-based) of the entry point named
/// `call` fails with `result` and does nothing. A sticky fault is a GPU
/// fault instead (an illegal address in a kernel): the call succeeds, and
/// once its operation runs on its stream the context is broken as CUDA's
/// is after one: every later call returns `result` (the synchronisations
/// once the work before them has drained), except those that free or
/// destroy, and nothing more runs.
struct Fault {
  std::string call;
  int64_t nth = 1;
  CUresult result = 999; // CUDA_ERROR_UNKNOWN
  bool sticky = false;
};

struct Options {
  /// Up to this many microseconds before every copy, memset, kernel and
  /// GEMM.
  int maxDelayMicros = 200;
  /// Graph ops whose lowering launches dense kernels run as the cpu
  /// backend's kernel instead, at the instruction's last operation, the
  /// others doing nothing (still ordered and checked as the backend issues
  /// them). The host build of the CUDA kernels takes seconds per step of a
  /// tiny plan; this is for many steps where the orderings matter, not the
  /// kernels.
  bool referenceKernels = false;
  std::optional<Fault> fault;
  /// What cuMemGetInfo reports free (unset: 64 GiB).
  std::optional<size_t> freeBytes;
};

struct Stats {
  int64_t launches = 0, gemms = 0;
  /// Host waits that spin a core on a real GPU with the default context
  /// scheduling: cuEventSynchronize on an event made without
  /// CU_EVENT_BLOCKING_SYNC, cuStreamSynchronize while the stream works.
  int64_t spinningWaits = 0;
  /// Calls per entry point.
  std::map<std::string, int64_t> calls;
};

/// Makes fake device `index` (made, with those below it, at first use) the
/// calling thread's, as cuCtxSetCurrent makes a context current. Device
/// ordinal r is fake device r (cuDeviceGetCount counts those made), and
/// cuCtxSetCurrent of its primary context selects it, so a backend made
/// for ordinal r, and its own threads, use device r. Every thread starts
/// on device 0. The functions below and the calls that name no handle
/// (allocations, stream and event creation, cuMemGetInfo, the NULL stream,
/// ncclCommInitRank) go to the current device; calls naming a stream, an
/// event or memory go to its device, from any thread.
void useDevice(int index);

/// Prepares the current device for one backend running `plan` (prepared
/// as `prep`): forgets errors, counts and faults, and frees the pinned
/// blocks destroyed backends kept (cuda::releasePinnedPools). Every
/// backend of an earlier setUp must be gone.
void setUp(const exec::ExecPlan &plan, const PreparedPlan &prep,
           KernelLookup kernels, const Options &options = {});
/// The same for a test that drives the device without a plan: every device
/// allocation is checked as the arena is ("device allocation #N"), and no
/// launch or GEMM is expected.
void setUp(const Options &options = {});
/// Call before each step: seeds the delays and starts the step's checks.
void beginStep(uint64_t seed);
/// Call after each step (also a failed one): checks that no work is in
/// flight; returns what the checks found since setUp (the first 20, then a
/// count).
std::vector<std::string> endStep();
Stats stats();
/// Until the injected fault has fired or `timeout` passed; whether it has.
bool waitForFault(std::chrono::milliseconds timeout);

/// The entry points. Valid between setUp and the next setUp.
const CudaDriverApi &driver();
const CublasLtApi &cublasLt();
/// NCCL on the fake devices. A communicator belongs to the device current
/// at ncclCommInitRank, which waits for every rank of the id. A group
/// (ncclGroupStart/End) is one collective per communicator; its calls must
/// use one stream. Collective calls: ncclBroadcast, ncclReduce and
/// ncclAllReduce, ncclSum of ncclBfloat16, ncclFloat16 or ncclFloat32. A
/// collective that waits kNcclTimeout for a rank that never issues it, one
/// the ranks disagree on, or one whose communicator a rank aborted
/// (ncclCommAbort) moves nothing and is an error on every device it ran
/// on.
const NcclApi &nccl();
inline constexpr std::chrono::seconds kNcclTimeout{30};

/// The cuda backend's options on the fake devices: the three tables above.
CudaOptions backendOptions();
/// setUp for `plan` with every dense kernel run as the cpu reference
/// (Options::referenceKernels), so that no host build of them is needed;
/// false with `why` where the backend cannot start (no NVRTC: it compiles
/// its kernels first).
bool setUpReference(const exec::ExecPlan &plan, const PreparedPlan &prep,
                    std::string &why, Options options = {});

/// Element `i` of `p` in type `t`, as float (and back).
float loadAs(const void *p, exec::DType t, int64_t i);
void storeAs(void *p, exec::DType t, int64_t i, float v);

/// cuBLASLt's contract, naively: D = op(A) op(B) (+ bias per row),
/// column-major, fp32 accumulation.
void naiveGemm(const GemmCall &g, const void *A, const void *B, void *D,
               const void *bias);

} // namespace megaslide::cuda::fake

#endif // MEGASLIDE_TEST_UNIT_FAKECUDA_H
