//===- ElementwiseCodegenTest.cpp - What the dense kernels compile to -----===//
//
// The code NVRTC makes of the dense (non-attention) kernels of
// ElementwiseKernels.h for sm_90a, no GPU needed: no 64-bit integer
// division, no FP64 and no local memory in any of them, and the per-element
// instruction counts the cost model states (sim::elementwiseCostOf) against
// their PTX. Skips where NVRTC cannot be loaded. Also the host half of the
// kernels' fast division and the lowering's 32-bit index limit.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cuda/ElementwiseKernels.h"
#include "megaslide/runtime/cuda/GraphOpLowering.h"
#include "megaslide/runtime/cuda/Nvrtc.h"
#include "megaslide/runtime/sim/HardwareModel.h"

#include "llvm/ADT/StringRef.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

using namespace megaslide;
using namespace megaslide::cuda;
using exec::DType;

namespace {

/// n / d the way the kernels' msDiv computes it from fastDivisor(d).
uint32_t divideLikeTheKernels(uint32_t n, uint64_t packed) {
  uint32_t magic = static_cast<uint32_t>(packed), d = packed >> 32;
  uint32_t shift = d == 1 ? 0 : 32 - __builtin_clz(d - 1);
  uint32_t hi = static_cast<uint32_t>((uint64_t(n) * magic) >> 32);
  return (hi + n) >> shift;
}

TEST(ElementwiseCodegenTest, FastDivisorDividesEveryIndex) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> any(0, INT32_MAX);
  std::vector<uint32_t> divisors = {
      1, 2, 3, 7, 8, 80, 5120, 75600, 65536, (1u << 30) + 1, INT32_MAX};
  for (int i = 0; i < 200; ++i)
    divisors.push_back(std::max<uint32_t>(1, any(rng) >> (i % 31)));
  for (uint32_t d : divisors) {
    uint64_t packed = fastDivisor(d);
    ASSERT_EQ(packed >> 32, d);
    std::vector<uint32_t> ns = {0,
                                1,
                                d - 1,
                                d,
                                d + 1,
                                INT32_MAX,
                                INT32_MAX - 1,
                                INT32_MAX / d * d,
                                INT32_MAX / d * d - 1};
    for (int k = 0; k < 200; ++k)
      ns.push_back(any(rng));
    for (uint32_t n : ns) {
      if (n > INT32_MAX)
        continue;
      ASSERT_EQ(divideLikeTheKernels(n, packed), n / d) << n << " / " << d;
    }
  }
}

/// The 32-bit kernels cover at most 2^31 - 1 elements a launch: a purely
/// elementwise op beyond (the 105B FFN's GELU, 75,600 x 32,768) becomes one
/// launch per 2^30-element slice at the slices' byte offsets; an op whose
/// indices are not per element (a broadcast) is refused by name.
TEST(ElementwiseCodegenTest, LaunchesBeyondTwoToThe31ElementsAreSliced) {
  exec::Instruction grad;
  grad.op = exec::OpCode::GeluGrad;
  exec::TensorType x{DType::BF16, {75600, 32768}},
      dy{DType::F32, {75600, 32768}};
  auto lowered = lowerGraphOp(grad, {x, dy}, {x});
  ASSERT_TRUE(!!lowered) << llvm::toString(lowered.takeError());
  int64_t n = 75600 * int64_t(32768), covered = 0;
  ASSERT_EQ(lowered->steps.size(), 3u);
  for (const LoweredStep &s : lowered->steps) {
    const auto &l = std::get<KernelLaunch>(s);
    ASSERT_EQ(l.args.size(), 4u);
    EXPECT_EQ(l.args[0].buffer.offset, covered * 2);
    EXPECT_EQ(l.args[1].buffer.offset, covered * 4);
    EXPECT_EQ(l.args[2].buffer.offset, covered * 2);
    int64_t count = l.args[3].i;
    EXPECT_LE(count, int64_t(1) << 30);
    covered += count;
  }
  EXPECT_EQ(covered, n);

  exec::Instruction bias;
  bias.op = exec::OpCode::BiasAdd;
  exec::TensorType big{DType::BF16, {int64_t(1) << 16, int64_t(1) << 15}},
      b{DType::BF16, {int64_t(1) << 15}};
  auto refused = lowerGraphOp(bias, {big, b}, {big});
  ASSERT_FALSE(!!refused);
  EXPECT_EQ(llvm::toString(refused.takeError()),
            "'bias_add' on cuda: 2147483648 elements in one kernel launch; "
            "the elementwise kernels index with 32 bits and take at most "
            "2147483647");
}

/// The PTX of each .entry, by name: up to the closing brace at the start
/// of a line (a .func the PTX places after it is not its body).
std::map<std::string, std::string> ptxEntries(llvm::StringRef ptx) {
  std::map<std::string, std::string> out;
  while (true) {
    size_t at = ptx.find(".entry ");
    if (at == llvm::StringRef::npos)
      break;
    ptx = ptx.drop_front(at + 7);
    llvm::StringRef name = ptx.take_until([](char c) { return c == '('; });
    out[name.trim().str()] = ptx.take_front(ptx.find("\n}\n")).str();
  }
  return out;
}

/// The dense kernels the checks cover: every kind but global attention
/// (runtime/cuda/device/Attention.cuh and the scalar fallback, outside this
/// file's subject), bf16 and f32 instances.
std::vector<KernelInstance> denseInstances() {
  std::vector<KernelInstance> out;
  for (const KernelInstance &k : representativeKernelInstances())
    if (!llvm::StringRef(k.kind).starts_with("attention") &&
        (k.types.back() == DType::BF16 || k.types.front() == DType::F32))
      out.push_back(k);
  return out;
}

/// One compilation of denseInstances() shared by the tests below.
const CompileResult &denseCompile() {
  static const CompileResult r = compileCuda(
      emitElementwiseSource(denseInstances()), "megaslide_dense.cu", "sm_90a");
  return r;
}

TEST(ElementwiseCodegenTest, NoInt64DivisionFp64OrLocalMemory) {
  std::string why;
  if (!nvrtcAvailable(&why))
    GTEST_SKIP() << why;
  const CompileResult &r = denseCompile();
  ASSERT_TRUE(r.ok()) << r.error;
  std::map<std::string, std::string> entries = ptxEntries(r.ptx);
  std::vector<KernelInstance> kernels = denseInstances();
  ASSERT_EQ(entries.size(), kernels.size());
  std::map<std::string, int> stack;
  for (const KernelResources &k : parsePtxasLog(r.log))
    stack[k.kernel] = k.stackBytes;
  for (const KernelInstance &k : kernels) {
    SCOPED_TRACE(k.name());
    ASSERT_TRUE(entries.count(k.name()));
    const std::string &body = entries[k.name()];
    // A 64-bit division is a ~70-instruction subroutine per element.
    for (const char *op : {"div.s64", "div.u64", "rem.s64", "rem.u64"})
      EXPECT_EQ(body.find(op), std::string::npos) << op;
    // timestep_embedding keeps double on purpose (its B * width / 2
    // elements, ~10^2 a step, need the phase at time_scale ~1000, as the
    // cpu kernel); its sincos slow path is the one call and stack frame.
    if (k.kind == "timestep_embedding")
      continue;
    EXPECT_EQ(body.find(".f64"), std::string::npos);
    EXPECT_EQ(body.find(".local"), std::string::npos);
    EXPECT_EQ(body.find("call"), std::string::npos);
    EXPECT_EQ(stack.at(k.name()), 0);
  }
}

/// Instructions per element of `entry`'s main loop: the grid-stride loop
/// with 16-byte stores (8 elements a trip) when there is one, else the
/// largest loop that stores to global memory (1 element a trip). Loops
/// are the spans from a label to a branch back to it.
double loopInstructionsPerElement(llvm::StringRef entry) {
  llvm::SmallVector<llvm::StringRef> lines;
  entry.split(lines, '\n');
  std::map<std::string, size_t> labels;
  double best = 0;
  bool bestVector = false;
  for (size_t i = 0; i < lines.size(); ++i) {
    llvm::StringRef l = lines[i].trim();
    if (l.ends_with(":")) {
      labels[l.drop_back().str()] = i;
      continue;
    }
    size_t bra = l.find("bra");
    if (bra == llvm::StringRef::npos)
      continue;
    std::string target =
        l.drop_front(bra).split(' ').second.trim().rtrim(';').trim().str();
    auto it = labels.find(target);
    if (it == labels.end())
      continue;
    int count = 0;
    bool stores = false, vector = false;
    for (size_t j = it->second + 1; j <= i; ++j) {
      llvm::StringRef s = lines[j].trim();
      if (s.empty() || s.ends_with(":") || s.starts_with("//") ||
          s.starts_with("{") || s.starts_with("}") || s.starts_with("."))
        continue;
      ++count;
      stores |= s.starts_with("st.global");
      vector |= s.starts_with("st.global.v4");
    }
    if (!stores)
      continue;
    double perElement = vector ? count / 8.0 : count;
    if (vector && !bestVector)
      best = 0;
    if ((vector || !bestVector) && perElement > best) {
      best = perElement;
      bestVector = vector;
    }
  }
  return best;
}

TEST(ElementwiseCodegenTest, InstructionCountsMatchThePtx) {
  std::string why;
  if (!nvrtcAvailable(&why))
    GTEST_SKIP() << why;
  const CompileResult &r = denseCompile();
  ASSERT_TRUE(r.ok()) << r.error;
  std::map<std::string, std::string> entries = ptxEntries(r.ptx);
  int checked = 0;
  for (const sim::KernelInstructions &k :
       sim::elementwiseKernelInstructions()) {
    SCOPED_TRACE(k.kernel);
    KernelInstance bf{k.kernel, {}};
    for (const KernelKindInfo &info : elementwiseKernelKinds())
      if (llvm::StringRef(k.kernel) == info.kind)
        bf.types.assign(info.numTypes, DType::BF16);
    ASSERT_FALSE(bf.types.empty()) << "no such kernel";
    if (llvm::StringRef(k.kernel).starts_with("embedding"))
      bf.types.front() = DType::I32; // the ids
    ASSERT_TRUE(entries.count(bf.name()));
    double measured = loopInstructionsPerElement(entries[bf.name()]);
    std::printf("%-20s table %5.2f  ptx %5.2f\n", k.kernel, k.perElement,
                measured);
    // The table is what the planner prices with: it must not promise
    // fewer instructions than the PTX has, nor drift far above it.
    EXPECT_GE(k.perElement, measured * 0.999);
    EXPECT_LE(k.perElement, measured * 1.25);
    ++checked;
  }
  EXPECT_GT(checked, 10);
}

} // namespace
