//===- CpuDenseKernelsTest.cpp - cpu dense graph kernels vs references ----===//
//
// The cpu backend's dense graph kernels (runtime/cpu/kernels/Dense.cpp),
// called through findGraphKernel as the interpreter does, on fixed-seed
// random shapes. Forward ops are checked against naive double-precision
// references written here from the op descriptions in
// dialects/Graph/GraphOps.td; backward ops against central finite
// differences of those double references (loss = sum(forward * dy)) and,
// for linear, against analytic double references on shapes large enough to
// cross every blocking boundary of the GEMM. Also covered: every optional
// operand form (bias, affine, gamma), rank-1 and rank-4 inputs, aliasing
// reshape, index tensors through reshape/zeros, thread-count independence
// (bitwise) and errors for unusable attributes and shapes. Result buffers
// start as NaN (so unwritten elements fail) and are followed by guard
// values that must stay untouched.
//
// Tolerances (kernels compute in fp32, references in double from the same
// fp32 inputs):
//   linear*:            |got - ref| <= (P + 2) 2^-24 sum_p |a_p b_p| + 1e-30
//                       (the worst-case bound of a sequential fp32 sum of P
//                       products, with the bias as one more term)
//   other forwards:     |got - ref| <= 1e-6 + 1e-5 |ref|
//   finite differences: step 1e-4 on the double reference (truncation and
//                       rounding below 1e-7 here);
//                       |got - fd| <= 1e-5 + 1e-4 |fd|
//   structural ops:     exact
//   1 vs 2/3/5 threads: bitwise identical
//
//===----------------------------------------------------------------------===//

#include "megaslide/Testing/ScopedThreads.h"
#include "megaslide/runtime/cpu/GraphKernels.h"
#include "megaslide/runtime/cpu/WorkerPool.h"

#include "gtest/gtest.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

using namespace megaslide;
using namespace megaslide::cpu;

namespace {

//===----------------------------------------------------------------------===//
// Tensors and calls
//===----------------------------------------------------------------------===//

constexpr int64_t kGuard = 16;
constexpr float kGuardValue = -12345.5f;

/// A float tensor with guard elements after its data, to catch writes past
/// the end (edge tiles of the GEMM).
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> storage;

  explicit Tensor(std::vector<int64_t> s, float fill = 0.0f) : shape(s) {
    storage.assign(numel() + kGuard, fill);
    std::fill(storage.begin() + numel(), storage.end(), kGuardValue);
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape)
      n *= d;
    return n;
  }
  float *data() { return storage.data(); }
  const float *data() const { return storage.data(); }
  float &operator[](int64_t i) { return storage[i]; }
  float operator[](int64_t i) const { return storage[i]; }
  std::vector<float> values() const {
    return {storage.begin(), storage.begin() + numel()};
  }
  std::vector<double> doubles() const {
    return {storage.begin(), storage.begin() + numel()};
  }
  bool guardIntact() const {
    for (int64_t i = numel(); i < numel() + kGuard; ++i)
      if (storage[i] != kGuardValue)
        return false;
    return true;
  }
  OpTensor view() {
    OpTensor t;
    t.type.dtype = exec::DType::F32;
    t.type.shape = shape;
    t.f32 = storage.data();
    return t;
  }
};

Tensor randomTensor(std::vector<int64_t> shape, std::mt19937 &rng,
                    float lo = -1.0f, float hi = 1.0f) {
  Tensor t(std::move(shape));
  std::uniform_real_distribution<float> dist(lo, hi);
  for (int64_t i = 0; i < t.numel(); ++i)
    t[i] = dist(rng);
  return t;
}

/// A result buffer: NaN until the kernel writes it.
Tensor output(std::vector<int64_t> shape) {
  return Tensor(std::move(shape), std::numeric_limits<float>::quiet_NaN());
}

exec::Instruction makeInst(std::string op,
                           std::optional<double> eps = std::nullopt) {
  exec::Instruction inst;
  inst.op = exec::parseOpCode(op).value();
  if (eps)
    inst.attrs["eps"] = *eps;
  return inst;
}

std::string errorText(llvm::Error e) {
  return e ? llvm::toString(std::move(e)) : std::string();
}

/// Runs `inst` through the kernel table on raw OpTensors; "" on success.
std::string runViews(const exec::Instruction &inst,
                     const std::vector<OpTensor> &operands,
                     const std::vector<OpTensor> &results) {
  GraphKernel kernel = findGraphKernel(inst.op);
  if (!kernel)
    return std::string("no kernel for ") + exec::opName(inst.op);
  return errorText(kernel(inst, operands, results));
}

std::string run(const exec::Instruction &inst, std::vector<Tensor *> operands,
                std::vector<Tensor *> results) {
  std::vector<OpTensor> ops, res;
  for (Tensor *t : operands)
    ops.push_back(t->view());
  for (Tensor *t : results)
    res.push_back(t->view());
  std::string error = runViews(inst, ops, res);
  for (Tensor *t : results)
    EXPECT_TRUE(t->guardIntact())
        << exec::opName(inst.op) << " wrote past a result";
  return error;
}

/// Expects |got - ref| <= atol + rtol |ref| elementwise; reports the worst.
void expectClose(const Tensor &got, const std::vector<double> &ref, double atol,
                 double rtol, const std::string &what) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(ref.size())) << what;
  int64_t bad = 0, worst = -1;
  double worstExcess = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    double err = std::fabs(got[i] - ref[i]);
    double tol = atol + rtol * std::fabs(ref[i]);
    if (!(err <= tol)) {
      ++bad;
      double excess = std::isnan(err) ? INFINITY : err / tol;
      if (worst < 0 || excess > worstExcess) {
        worst = i;
        worstExcess = excess;
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": worst at " << worst << " got "
                    << (worst >= 0 ? got[worst] : 0.0) << " ref "
                    << (worst >= 0 ? ref[worst] : 0.0);
}

/// Expects |got - ref| <= bound elementwise (per-element bounds).
void expectWithin(const Tensor &got, const std::vector<double> &ref,
                  const std::vector<double> &bound, const std::string &what) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(ref.size())) << what;
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < ref.size(); ++i)
    if (!(std::fabs(got[i] - ref[i]) <= bound[i] + 1e-30)) {
      if (first < 0)
        first = i;
      ++bad;
    }
  EXPECT_EQ(bad, 0) << what << ": first at " << first << " got "
                    << (first >= 0 ? got[first] : 0.0) << " ref "
                    << (first >= 0 ? ref[first] : 0.0) << " bound "
                    << (first >= 0 ? bound[first] : 0.0);
}

constexpr double kFwdAtol = 1e-6, kFwdRtol = 1e-5;
constexpr double kFdAtol = 1e-5, kFdRtol = 1e-4;
constexpr double kFdStep = 1e-4;

//===----------------------------------------------------------------------===//
// Finite differences
//===----------------------------------------------------------------------===//

using Inputs = std::vector<std::vector<double>>;
using Forward = std::function<std::vector<double>(const Inputs &)>;

/// d/d inputs[which] of sum(forward(inputs) * dy), by central differences.
std::vector<double> finiteDiff(const Forward &forward, Inputs inputs,
                               size_t which, const Tensor &dy) {
  auto loss = [&] {
    std::vector<double> out = forward(inputs);
    double l = 0;
    for (size_t i = 0; i < out.size(); ++i)
      l += out[i] * dy[i];
    return l;
  };
  std::vector<double> grad(inputs[which].size());
  for (size_t i = 0; i < grad.size(); ++i) {
    double saved = inputs[which][i];
    inputs[which][i] = saved + kFdStep;
    double plus = loss();
    inputs[which][i] = saved - kFdStep;
    double minus = loss();
    inputs[which][i] = saved;
    grad[i] = (plus - minus) / (2 * kFdStep);
  }
  return grad;
}

//===----------------------------------------------------------------------===//
// Double references, from the op descriptions
//===----------------------------------------------------------------------===//

/// Value and sum of |terms| of y = x W^T + b per element.
struct LinearRef {
  std::vector<double> value, absSum;
};

LinearRef linearRef(const std::vector<double> &x, const std::vector<double> &w,
                    const std::vector<double> *b, int64_t rows, int64_t in,
                    int64_t out) {
  LinearRef ref{std::vector<double>(rows * out),
                std::vector<double>(rows * out)};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double s = b ? (*b)[o] : 0.0, a = b ? std::fabs((*b)[o]) : 0.0;
      for (int64_t k = 0; k < in; ++k) {
        s += x[r * in + k] * w[o * in + k];
        a += std::fabs(x[r * in + k] * w[o * in + k]);
      }
      ref.value[r * out + o] = s;
      ref.absSum[r * out + o] = a;
    }
  return ref;
}

/// The fp32 sequential-sum error bound of `terms` products.
std::vector<double> sumBound(const std::vector<double> &absSum, int64_t terms) {
  std::vector<double> bound(absSum.size());
  for (size_t i = 0; i < absSum.size(); ++i)
    bound[i] = (terms + 2) * std::ldexp(1.0, -24) * absSum[i];
  return bound;
}

std::vector<double> layerNormRef(const std::vector<double> &x, int64_t d,
                                 const std::vector<double> *gamma,
                                 const std::vector<double> *beta, double eps) {
  std::vector<double> y(x.size());
  for (size_t r = 0; r * d < x.size(); ++r) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < d; ++i)
      mean += x[r * d + i];
    mean /= d;
    for (int64_t i = 0; i < d; ++i)
      var += (x[r * d + i] - mean) * (x[r * d + i] - mean);
    var /= d;
    for (int64_t i = 0; i < d; ++i) {
      double v = (x[r * d + i] - mean) / std::sqrt(var + eps);
      y[r * d + i] = gamma ? v * (*gamma)[i] + (*beta)[i] : v;
    }
  }
  return y;
}

std::vector<double> rmsNormRef(const std::vector<double> &x, int64_t d,
                               const std::vector<double> *gamma, double eps) {
  std::vector<double> y(x.size());
  for (size_t r = 0; r * d < x.size(); ++r) {
    double ms = 0;
    for (int64_t i = 0; i < d; ++i)
      ms += x[r * d + i] * x[r * d + i];
    ms /= d;
    for (int64_t i = 0; i < d; ++i) {
      double v = x[r * d + i] / std::sqrt(ms + eps);
      y[r * d + i] = gamma ? v * (*gamma)[i] : v;
    }
  }
  return y;
}

/// x [B, N, D] * (1 + scale[b]) + shift[b].
std::vector<double> modulateRef(const std::vector<double> &x,
                                const std::vector<double> &shift,
                                const std::vector<double> &scale, int64_t b,
                                int64_t n, int64_t d) {
  std::vector<double> y(x.size());
  for (int64_t s = 0; s < b; ++s)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < d; ++i)
        y[(s * n + t) * d + i] =
            x[(s * n + t) * d + i] * (1 + scale[s * d + i]) + shift[s * d + i];
  return y;
}

std::vector<double> gateRef(const std::vector<double> &x,
                            const std::vector<double> &g, int64_t b, int64_t n,
                            int64_t d) {
  std::vector<double> y(x.size());
  for (int64_t s = 0; s < b; ++s)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < d; ++i)
        y[(s * n + t) * d + i] = x[(s * n + t) * d + i] * g[s * d + i];
  return y;
}

double geluRef(double x) {
  return 0.5 * x *
         (1 + std::tanh(std::sqrt(2 / 3.14159265358979323846) *
                        (x + 0.044715 * x * x * x)));
}

double siluRef(double x) { return x / (1 + std::exp(-x)); }

std::vector<double> map(const std::vector<double> &x, double (*f)(double)) {
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    y[i] = f(x[i]);
  return y;
}

//===----------------------------------------------------------------------===//
// Registration
//===----------------------------------------------------------------------===//

/// The ops kernels/Dense.cpp owns, space separated.
const char kDenseOps[] =
    "linear linear_grad_data linear_grad_params layer_norm layer_norm_grad "
    "rms_norm rms_norm_grad modulate modulate_grad gate gate_grad gelu "
    "gelu_grad silu silu_grad add bias_add bias_add_grad cast split concat "
    "zeros reshape";

TEST(CpuDenseRegistry, EveryDenseOpHasAKernel) {
  std::istringstream names(kDenseOps);
  int count = 0;
  for (std::string op; names >> op; ++count)
    EXPECT_NE(findGraphKernel(exec::parseOpCode(op).value()), nullptr) << op;
  EXPECT_EQ(count, 23);
}

//===----------------------------------------------------------------------===//
// linear
//===----------------------------------------------------------------------===//

struct LinearShape {
  std::vector<int64_t> lead; ///< leading dimensions of x
  int64_t in, out;
};

/// Shapes crossing the GEMM's blocking: rows not a multiple of the 4-row
/// tile and beyond the 64-row block, depth beyond the 256 block, columns not
/// a multiple of the 8-column panel and beyond the 512 sweep; rank-1 input.
const LinearShape kLinearShapes[] = {
    {{}, 5, 3},       {{1}, 1, 1},           {{2, 3}, 7, 9},
    {{67}, 33, 37},   {{2, 5, 13}, 300, 19}, {{3}, 40, 600},
    {{130}, 520, 70},
};

int64_t product(const std::vector<int64_t> &dims) {
  int64_t n = 1;
  for (int64_t d : dims)
    n *= d;
  return n;
}

std::vector<int64_t> append(std::vector<int64_t> lead, int64_t last) {
  lead.push_back(last);
  return lead;
}

TEST(CpuDenseLinear, ForwardMatchesReferenceWithAndWithoutBias) {
  std::mt19937 rng(1);
  for (const LinearShape &s : kLinearShapes) {
    for (bool withBias : {false, true}) {
      SCOPED_TRACE("in " + std::to_string(s.in) + " out " +
                   std::to_string(s.out) + " bias " + std::to_string(withBias));
      int64_t rows = product(s.lead);
      Tensor x = randomTensor(append(s.lead, s.in), rng);
      Tensor w = randomTensor({s.out, s.in}, rng);
      Tensor b = randomTensor({s.out}, rng);
      Tensor y = output(append(s.lead, s.out));
      std::vector<Tensor *> operands = {&x, &w};
      if (withBias)
        operands.push_back(&b);
      ASSERT_EQ(run(makeInst("linear"), operands, {&y}), "");
      std::vector<double> bd = b.doubles();
      LinearRef ref = linearRef(x.doubles(), w.doubles(),
                                withBias ? &bd : nullptr, rows, s.in, s.out);
      expectWithin(y, ref.value, sumBound(ref.absSum, s.in), "linear");
    }
  }
}

TEST(CpuDenseLinear, GradDataMatchesReference) {
  std::mt19937 rng(2);
  for (const LinearShape &s : kLinearShapes) {
    SCOPED_TRACE("in " + std::to_string(s.in) + " out " +
                 std::to_string(s.out));
    int64_t rows = product(s.lead);
    Tensor dy = randomTensor(append(s.lead, s.out), rng);
    Tensor w = randomTensor({s.out, s.in}, rng);
    Tensor dx = output(append(s.lead, s.in));
    ASSERT_EQ(run(makeInst("linear_grad_data"), {&dy, &w}, {&dx}), "");
    // dx = dy W is linear with the transposed weight: reuse linearRef.
    std::vector<double> wt(s.in * s.out);
    for (int64_t o = 0; o < s.out; ++o)
      for (int64_t k = 0; k < s.in; ++k)
        wt[k * s.out + o] = w[o * s.in + k];
    LinearRef ref = linearRef(dy.doubles(), wt, nullptr, rows, s.out, s.in);
    expectWithin(dx, ref.value, sumBound(ref.absSum, s.out),
                 "linear_grad_data");
  }
}

TEST(CpuDenseLinear, GradParamsMatchesReference) {
  std::mt19937 rng(3);
  for (const LinearShape &s : kLinearShapes) {
    for (bool withBias : {false, true}) {
      SCOPED_TRACE("in " + std::to_string(s.in) + " out " +
                   std::to_string(s.out) + " bias " + std::to_string(withBias));
      int64_t rows = product(s.lead);
      Tensor x = randomTensor(append(s.lead, s.in), rng);
      Tensor dy = randomTensor(append(s.lead, s.out), rng);
      Tensor dw = output({s.out, s.in}), db = output({s.out});
      std::vector<Tensor *> results = {&dw};
      if (withBias)
        results.push_back(&db);
      ASSERT_EQ(run(makeInst("linear_grad_params"), {&x, &dy}, results), "");
      // dW[o, k] = sum_r dy[r, o] x[r, k]: linear of dy^T with x^T.
      std::vector<double> dyT(s.out * rows), xT(s.in * rows);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t o = 0; o < s.out; ++o)
          dyT[o * rows + r] = dy[r * s.out + o];
        for (int64_t k = 0; k < s.in; ++k)
          xT[k * rows + r] = x[r * s.in + k];
      }
      LinearRef ref = linearRef(dyT, xT, nullptr, s.out, rows, s.in);
      expectWithin(dw, ref.value, sumBound(ref.absSum, rows), "weight_grad");
      if (withBias) {
        std::vector<double> dbRef(s.out, 0.0);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t o = 0; o < s.out; ++o)
            dbRef[o] += dy[r * s.out + o];
        expectClose(db, dbRef, kFwdAtol, kFwdRtol, "bias_grad");
      }
    }
  }
}

TEST(CpuDenseLinear, GradientsMatchFiniteDifferences) {
  std::mt19937 rng(4);
  std::vector<int64_t> lead = {2, 3};
  int64_t rows = 6, in = 5, out = 7;
  Tensor x = randomTensor(append(lead, in), rng);
  Tensor w = randomTensor({out, in}, rng), b = randomTensor({out}, rng);
  Tensor dy = randomTensor(append(lead, out), rng);
  Forward forward = [&](const Inputs &v) {
    return linearRef(v[0], v[1], &v[2], rows, in, out).value;
  };
  Inputs inputs = {x.doubles(), w.doubles(), b.doubles()};

  Tensor dx = output(append(lead, in));
  ASSERT_EQ(run(makeInst("linear_grad_data"), {&dy, &w}, {&dx}), "");
  expectClose(dx, finiteDiff(forward, inputs, 0, dy), kFdAtol, kFdRtol, "dx");

  Tensor dw = output({out, in}), db = output({out});
  ASSERT_EQ(run(makeInst("linear_grad_params"), {&x, &dy}, {&dw, &db}), "");
  expectClose(dw, finiteDiff(forward, inputs, 1, dy), kFdAtol, kFdRtol, "dw");
  expectClose(db, finiteDiff(forward, inputs, 2, dy), kFdAtol, kFdRtol, "db");
}

TEST(CpuDenseThreads, ResultsAreBitwiseIndependentOfThreadCount) {
  std::mt19937 rng(5);
  // Many rows (work split by rows) and few rows with wide outputs (split by
  // column panels), both above the parallel threshold.
  const LinearShape shapes[] = {{{2, 65}, 300, 70}, {{3}, 2000, 1000}};
  std::vector<std::vector<std::vector<float>>> runs;
  std::vector<Tensor> inputs;
  for (const LinearShape &s : shapes) {
    inputs.push_back(randomTensor(append(s.lead, s.in), rng));
    inputs.push_back(randomTensor({s.out, s.in}, rng));
    inputs.push_back(randomTensor({s.out}, rng));
    inputs.push_back(randomTensor(append(s.lead, s.out), rng));
  }
  // A row-parallel norm and an elementwise op with enough elements for five
  // threads' chunks.
  Tensor nx = randomTensor({4, 512, 160}, rng);
  Tensor ndy = randomTensor({4, 512, 160}, rng);
  Tensor ng = randomTensor({160}, rng), nb = randomTensor({160}, rng);
  Tensor gx = randomTensor({1 << 19}, rng);

  for (int threads : {1, 2, 3, 5}) {
    megaslide::cpu::test::ScopedThreads scoped(threads);
    EXPECT_EQ(cpuThreads(), threads);
    std::vector<std::vector<float>> outs;
    for (size_t i = 0; i < std::size(shapes); ++i) {
      const LinearShape &s = shapes[i];
      Tensor &x = inputs[4 * i], &w = inputs[4 * i + 1], &b = inputs[4 * i + 2],
             &dy = inputs[4 * i + 3];
      Tensor y = output(append(s.lead, s.out)),
             dx = output(append(s.lead, s.in));
      Tensor dw = output({s.out, s.in}), db = output({s.out});
      ASSERT_EQ(run(makeInst("linear"), {&x, &w, &b}, {&y}), "");
      ASSERT_EQ(run(makeInst("linear_grad_data"), {&dy, &w}, {&dx}), "");
      ASSERT_EQ(run(makeInst("linear_grad_params"), {&x, &dy}, {&dw, &db}), "");
      for (Tensor *t : {&y, &dx, &dw, &db})
        outs.push_back(t->values());
    }
    Tensor ny = output(nx.shape), ndx = output(nx.shape);
    Tensor ndg = output({160}), ndb = output({160});
    ASSERT_EQ(run(makeInst("layer_norm", 1e-6), {&nx, &ng, &nb}, {&ny}), "");
    ASSERT_EQ(run(makeInst("layer_norm_grad", 1e-6), {&nx, &ndy, &ng, &nb},
                  {&ndx, &ndg, &ndb}),
              "");
    Tensor gy = output(gx.shape);
    ASSERT_EQ(run(makeInst("gelu"), {&gx}, {&gy}), "");
    for (Tensor *t : {&ny, &ndx, &ndg, &ndb, &gy})
      outs.push_back(t->values());
    runs.push_back(std::move(outs));
  }
  for (size_t r = 1; r < runs.size(); ++r)
    for (size_t i = 0; i < runs[0].size(); ++i)
      EXPECT_TRUE(runs[r][i] == runs[0][i])
          << "output " << i << " differs with run " << r;
}

//===----------------------------------------------------------------------===//
// Norms
//===----------------------------------------------------------------------===//

const std::vector<int64_t> kNormShapes[] = {{7}, {3, 5, 16}, {2, 1, 1, 33}};

TEST(CpuDenseLayerNorm, ForwardMatchesReferenceInBothForms) {
  std::mt19937 rng(10);
  for (const std::vector<int64_t> &shape : kNormShapes) {
    for (double eps : {1e-6, 1e-2}) {
      for (bool affine : {false, true}) {
        int64_t d = shape.back();
        Tensor x = randomTensor(shape, rng, -2, 3);
        Tensor g = randomTensor({d}, rng), b = randomTensor({d}, rng);
        Tensor y = output(shape);
        std::vector<Tensor *> operands = {&x};
        if (affine)
          operands.insert(operands.end(), {&g, &b});
        ASSERT_EQ(run(makeInst("layer_norm", eps), operands, {&y}), "");
        std::vector<double> gd = g.doubles(), bd = b.doubles();
        expectClose(y,
                    layerNormRef(x.doubles(), d, affine ? &gd : nullptr,
                                 affine ? &bd : nullptr, eps),
                    kFwdAtol, kFwdRtol, "layer_norm");
      }
    }
  }
}

TEST(CpuDenseLayerNorm, GradMatchesFiniteDifferencesInBothForms) {
  std::mt19937 rng(11);
  for (const std::vector<int64_t> &shape : kNormShapes) {
    for (bool affine : {false, true}) {
      SCOPED_TRACE("rank " + std::to_string(shape.size()) + " affine " +
                   std::to_string(affine));
      int64_t d = shape.back();
      double eps = 1e-5;
      Tensor x = randomTensor(shape, rng), dy = randomTensor(shape, rng);
      Tensor g = randomTensor({d}, rng), b = randomTensor({d}, rng);
      Tensor dx = output(shape), dg = output({d}), db = output({d});
      std::vector<Tensor *> operands = {&x, &dy}, results = {&dx};
      if (affine) {
        operands.insert(operands.end(), {&g, &b});
        results.insert(results.end(), {&dg, &db});
      }
      ASSERT_EQ(run(makeInst("layer_norm_grad", eps), operands, results), "");
      Forward forward = [&](const Inputs &v) {
        return layerNormRef(v[0], d, affine ? &v[1] : nullptr,
                            affine ? &v[2] : nullptr, eps);
      };
      Inputs inputs = {x.doubles(), g.doubles(), b.doubles()};
      expectClose(dx, finiteDiff(forward, inputs, 0, dy), kFdAtol, kFdRtol,
                  "input_grad");
      if (affine) {
        expectClose(dg, finiteDiff(forward, inputs, 1, dy), kFdAtol, kFdRtol,
                    "gamma_grad");
        expectClose(db, finiteDiff(forward, inputs, 2, dy), kFdAtol, kFdRtol,
                    "beta_grad");
      }
    }
  }
}

TEST(CpuDenseRMSNorm, ForwardMatchesReferenceWithAndWithoutGamma) {
  std::mt19937 rng(12);
  for (const std::vector<int64_t> &shape : kNormShapes) {
    for (double eps : {1e-6, 1e-2}) {
      for (bool withGamma : {false, true}) {
        int64_t d = shape.back();
        Tensor x = randomTensor(shape, rng, -2, 3), g = randomTensor({d}, rng);
        Tensor y = output(shape);
        std::vector<Tensor *> operands = {&x};
        if (withGamma)
          operands.push_back(&g);
        ASSERT_EQ(run(makeInst("rms_norm", eps), operands, {&y}), "");
        std::vector<double> gd = g.doubles();
        expectClose(y,
                    rmsNormRef(x.doubles(), d, withGamma ? &gd : nullptr, eps),
                    kFwdAtol, kFwdRtol, "rms_norm");
      }
    }
  }
}

TEST(CpuDenseRMSNorm, GradMatchesFiniteDifferencesWithAndWithoutGamma) {
  std::mt19937 rng(13);
  for (const std::vector<int64_t> &shape : kNormShapes) {
    for (bool withGamma : {false, true}) {
      SCOPED_TRACE("rank " + std::to_string(shape.size()) + " gamma " +
                   std::to_string(withGamma));
      int64_t d = shape.back();
      double eps = 1e-5;
      Tensor x = randomTensor(shape, rng), dy = randomTensor(shape, rng);
      Tensor g = randomTensor({d}, rng);
      Tensor dx = output(shape), dg = output({d});
      std::vector<Tensor *> operands = {&x, &dy}, results = {&dx};
      if (withGamma) {
        operands.push_back(&g);
        results.push_back(&dg);
      }
      ASSERT_EQ(run(makeInst("rms_norm_grad", eps), operands, results), "");
      Forward forward = [&](const Inputs &v) {
        return rmsNormRef(v[0], d, withGamma ? &v[1] : nullptr, eps);
      };
      Inputs inputs = {x.doubles(), g.doubles()};
      expectClose(dx, finiteDiff(forward, inputs, 0, dy), kFdAtol, kFdRtol,
                  "input_grad");
      if (withGamma)
        expectClose(dg, finiteDiff(forward, inputs, 1, dy), kFdAtol, kFdRtol,
                    "gamma_grad");
    }
  }
}

//===----------------------------------------------------------------------===//
// modulate, gate
//===----------------------------------------------------------------------===//

/// [B, N, D] token tensors: one sample, several, a single token.
struct TokenShape {
  int64_t b, n, d;
};
const TokenShape kTokenShapes[] = {{1, 4, 8}, {3, 5, 6}, {2, 1, 17}};

TEST(CpuDenseModulate, ForwardAndGradMatchReference) {
  std::mt19937 rng(20);
  for (const TokenShape &shape : kTokenShapes) {
    int64_t b = shape.b, n = shape.n, d = shape.d;
    SCOPED_TRACE("B " + std::to_string(b) + " N " + std::to_string(n));
    Tensor x = randomTensor({b, n, d}, rng), dy = randomTensor({b, n, d}, rng);
    Tensor shift = randomTensor({b, d}, rng), scale = randomTensor({b, d}, rng);
    Tensor y = output({b, n, d});
    ASSERT_EQ(run(makeInst("modulate"), {&x, &shift, &scale}, {&y}), "");
    expectClose(
        y, modulateRef(x.doubles(), shift.doubles(), scale.doubles(), b, n, d),
        kFwdAtol, kFwdRtol, "modulate");

    Tensor dx = output({b, n, d}), dshift = output({b, d}),
           dscale = output({b, d});
    ASSERT_EQ(run(makeInst("modulate_grad"), {&x, &scale, &dy},
                  {&dx, &dshift, &dscale}),
              "");
    Forward forward = [&](const Inputs &v) {
      return modulateRef(v[0], v[1], v[2], b, n, d);
    };
    Inputs inputs = {x.doubles(), shift.doubles(), scale.doubles()};
    expectClose(dx, finiteDiff(forward, inputs, 0, dy), kFdAtol, kFdRtol,
                "input_grad");
    expectClose(dshift, finiteDiff(forward, inputs, 1, dy), kFdAtol, kFdRtol,
                "shift_grad");
    expectClose(dscale, finiteDiff(forward, inputs, 2, dy), kFdAtol, kFdRtol,
                "scale_grad");
  }
}

TEST(CpuDenseGate, ForwardAndGradMatchReference) {
  std::mt19937 rng(21);
  for (const TokenShape &shape : kTokenShapes) {
    int64_t b = shape.b, n = shape.n, d = shape.d;
    SCOPED_TRACE("B " + std::to_string(b) + " N " + std::to_string(n));
    Tensor x = randomTensor({b, n, d}, rng), dy = randomTensor({b, n, d}, rng);
    Tensor g = randomTensor({b, d}, rng);
    Tensor y = output({b, n, d});
    ASSERT_EQ(run(makeInst("gate"), {&x, &g}, {&y}), "");
    expectClose(y, gateRef(x.doubles(), g.doubles(), b, n, d), kFwdAtol,
                kFwdRtol, "gate");

    Tensor dx = output({b, n, d}), dg = output({b, d});
    ASSERT_EQ(run(makeInst("gate_grad"), {&x, &g, &dy}, {&dx, &dg}), "");
    Forward forward = [&](const Inputs &v) {
      return gateRef(v[0], v[1], b, n, d);
    };
    Inputs inputs = {x.doubles(), g.doubles()};
    expectClose(dx, finiteDiff(forward, inputs, 0, dy), kFdAtol, kFdRtol,
                "input_grad");
    expectClose(dg, finiteDiff(forward, inputs, 1, dy), kFdAtol, kFdRtol,
                "gate_grad");
  }
}

//===----------------------------------------------------------------------===//
// Activations
//===----------------------------------------------------------------------===//

TEST(CpuDenseActivations, ForwardMatchesReference) {
  std::mt19937 rng(30);
  Tensor x = randomTensor({3, 50}, rng, -6, 6);
  // Saturated and extreme inputs must stay finite.
  const float extremes[] = {0.0f,   -0.0f,   30.0f, -30.0f,
                            100.0f, -100.0f, 1e20f, -1e20f};
  for (size_t i = 0; i < std::size(extremes); ++i)
    x[i] = extremes[i];
  for (auto [op, ref] :
       {std::pair<const char *, double (*)(double)>{"gelu", geluRef},
        {"silu", siluRef}}) {
    Tensor y = output(x.shape);
    ASSERT_EQ(run(makeInst(op), {&x}, {&y}), "");
    expectClose(y, map(x.doubles(), ref), kFwdAtol, kFwdRtol, op);
  }
}

TEST(CpuDenseActivations, GradMatchesFiniteDifferences) {
  std::mt19937 rng(31);
  Tensor x = randomTensor({4, 30}, rng, -6, 6), dy = randomTensor({4, 30}, rng);
  for (auto [op, ref] :
       {std::pair<const char *, double (*)(double)>{"gelu_grad", geluRef},
        {"silu_grad", siluRef}}) {
    Tensor dx = output(x.shape);
    ASSERT_EQ(run(makeInst(op), {&x, &dy}, {&dx}), "");
    Forward forward = [&, f = ref](const Inputs &v) { return map(v[0], f); };
    expectClose(dx, finiteDiff(forward, {x.doubles()}, 0, dy), kFdAtol, kFdRtol,
                op);
  }
}

TEST(CpuDenseActivations, GradOfSaturatedInputsIsFinite) {
  Tensor x({6}), dy({6}, 1.0f);
  const float values[] = {1e20f, -1e20f, 100.0f, -100.0f, 1e30f, -1e30f};
  std::copy(std::begin(values), std::end(values), x.data());
  for (const char *op : {"gelu_grad", "silu_grad"}) {
    Tensor dx = output({6});
    ASSERT_EQ(run(makeInst(op), {&x, &dy}, {&dx}), "");
    for (int i = 0; i < 6; ++i) {
      // Slope 1 on the right, 0 on the left.
      EXPECT_FLOAT_EQ(dx[i], values[i] > 0 ? 1.0f : 0.0f) << op << " " << i;
    }
  }
}

//===----------------------------------------------------------------------===//
// add, bias_add
//===----------------------------------------------------------------------===//

TEST(CpuDenseAdd, AddMatchesReference) {
  std::mt19937 rng(40);
  Tensor a = randomTensor({2, 3, 5}, rng), b = randomTensor({2, 3, 5}, rng);
  Tensor y = output({2, 3, 5});
  ASSERT_EQ(run(makeInst("add"), {&a, &b}, {&y}), "");
  std::vector<double> ref(30);
  for (int i = 0; i < 30; ++i)
    ref[i] = static_cast<double>(a[i]) + b[i];
  expectClose(y, ref, kFwdAtol, kFwdRtol, "add");
}

TEST(CpuDenseAdd, BiasAddAndGradOverEverySuffix) {
  std::mt19937 rng(41);
  std::vector<int64_t> shape = {2, 3, 4, 5};
  for (size_t k = 0; k <= shape.size(); ++k) {
    std::vector<int64_t> biasShape(shape.end() - k, shape.end());
    SCOPED_TRACE("bias rank " + std::to_string(k));
    Tensor x = randomTensor(shape, rng), b = randomTensor(biasShape, rng);
    Tensor dy = randomTensor(shape, rng);
    Tensor y = output(shape);
    ASSERT_EQ(run(makeInst("bias_add"), {&x, &b}, {&y}), "");
    int64_t width = b.numel();
    Forward forward = [&](const Inputs &v) {
      std::vector<double> out(v[0].size());
      for (size_t i = 0; i < out.size(); ++i)
        out[i] = v[0][i] + v[1][i % width];
      return out;
    };
    Inputs inputs = {x.doubles(), b.doubles()};
    expectClose(y, forward(inputs), kFwdAtol, kFwdRtol, "bias_add");

    Tensor db = output(biasShape);
    ASSERT_EQ(run(makeInst("bias_add_grad"), {&dy}, {&db}), "");
    expectClose(db, finiteDiff(forward, inputs, 1, dy), kFdAtol, kFdRtol,
                "bias_add_grad");
  }
}

//===----------------------------------------------------------------------===//
// Structural ops
//===----------------------------------------------------------------------===//

TEST(CpuDenseStructural, CastCopies) {
  std::mt19937 rng(50);
  Tensor x = randomTensor({3, 7}, rng), y = output({3, 7});
  ASSERT_EQ(run(makeInst("cast"), {&x}, {&y}), "");
  EXPECT_EQ(y.values(), x.values());
}

TEST(CpuDenseStructural, ReshapeCopiesAndAliases) {
  std::mt19937 rng(51);
  Tensor x = randomTensor({2, 6}, rng), y = output({3, 2, 2});
  ASSERT_EQ(run(makeInst("reshape"), {&x}, {&y}), "");
  EXPECT_EQ(y.values(), x.values());

  // The interpreter makes reshape results views of their input.
  std::vector<float> before = x.values();
  OpTensor in = x.view(), out = x.view();
  out.type.shape = {12};
  ASSERT_EQ(runViews(makeInst("reshape"), {in}, {out}), "");
  EXPECT_EQ(x.values(), before);

  // Index tensors reshape too.
  for (bool wide : {false, true}) {
    std::vector<int32_t> i32 = {1, -2, 3, 4, 5, 6}, o32(6, 0);
    std::vector<int64_t> i64 = {1, -2, 3, 4, 5, 1ll << 40}, o64(6, 0);
    OpTensor a, b;
    a.type.dtype = b.type.dtype = wide ? exec::DType::I64 : exec::DType::I32;
    a.type.shape = {2, 3};
    b.type.shape = {6};
    if (wide) {
      a.i64 = i64.data();
      b.i64 = o64.data();
    } else {
      a.i32 = i32.data();
      b.i32 = o32.data();
    }
    ASSERT_EQ(runViews(makeInst("reshape"), {a}, {b}), "");
    if (wide)
      EXPECT_EQ(o64, i64);
    else
      EXPECT_EQ(o32, i32);
  }
}

TEST(CpuDenseStructural, SplitThenConcatRoundTrips) {
  std::mt19937 rng(52);
  for (int64_t n : {1, 2, 3}) {
    SCOPED_TRACE("chunks " + std::to_string(n));
    Tensor x = randomTensor({2, 3, 6 * n}, rng);
    std::vector<Tensor> parts;
    for (int64_t i = 0; i < n; ++i)
      parts.push_back(output({2, 3, 6}));
    std::vector<Tensor *> results;
    for (Tensor &p : parts)
      results.push_back(&p);
    ASSERT_EQ(run(makeInst("split"), {&x}, results), "");
    for (int64_t i = 0; i < n; ++i)
      for (int64_t r = 0; r < 6; ++r)
        for (int64_t c = 0; c < 6; ++c)
          ASSERT_EQ(parts[i][r * 6 + c], x[r * 6 * n + i * 6 + c]);
    Tensor y = output(x.shape);
    ASSERT_EQ(run(makeInst("concat"), results, {&y}), "");
    EXPECT_EQ(y.values(), x.values());
  }
}

TEST(CpuDenseStructural, SplitIntoUnequalWidthsUndoesConcat) {
  std::mt19937 rng(54);
  Tensor x = randomTensor({3, 8}, rng);
  Tensor a = output({3, 2}), b = output({3, 5}), c = output({3, 1});
  ASSERT_EQ(run(makeInst("split"), {&x}, {&a, &b, &c}), "");
  for (int64_t r = 0; r < 3; ++r) {
    EXPECT_EQ(a[r * 2 + 1], x[r * 8 + 1]);
    for (int64_t j = 0; j < 5; ++j)
      EXPECT_EQ(b[r * 5 + j], x[r * 8 + 2 + j]);
    EXPECT_EQ(c[r], x[r * 8 + 7]);
  }
  Tensor y = output({3, 8});
  ASSERT_EQ(run(makeInst("concat"), {&a, &b, &c}, {&y}), "");
  EXPECT_EQ(y.values(), x.values());
}

TEST(CpuDenseStructural, ConcatOfUnequalWidths) {
  std::mt19937 rng(53);
  Tensor a = randomTensor({3, 2}, rng), b = randomTensor({3, 5}, rng),
         c = randomTensor({3, 1}, rng);
  Tensor y = output({3, 8});
  ASSERT_EQ(run(makeInst("concat"), {&a, &b, &c}, {&y}), "");
  for (int64_t r = 0; r < 3; ++r) {
    EXPECT_EQ(y[r * 8 + 0], a[r * 2 + 0]);
    EXPECT_EQ(y[r * 8 + 1], a[r * 2 + 1]);
    for (int64_t j = 0; j < 5; ++j)
      EXPECT_EQ(y[r * 8 + 2 + j], b[r * 5 + j]);
    EXPECT_EQ(y[r * 8 + 7], c[r]);
  }
}

TEST(CpuDenseStructural, ZerosFills) {
  Tensor y = output({4, 5});
  ASSERT_EQ(run(makeInst("zeros"), {}, {&y}), "");
  EXPECT_EQ(y.values(), std::vector<float>(20, 0.0f));
  Tensor empty = output({0, 5});
  EXPECT_EQ(run(makeInst("zeros"), {}, {&empty}), "");
}

//===----------------------------------------------------------------------===//
// Errors
//===----------------------------------------------------------------------===//

/// Expects `error` to name `op` first and to contain `fragment`.
void expectError(const std::string &error, const std::string &op,
                 const std::string &fragment) {
  EXPECT_EQ(error.rfind("megaslide." + op + ": ", 0), 0u) << error;
  EXPECT_NE(error.find(fragment), std::string::npos)
      << "'" << error << "' lacks '" << fragment << "'";
}

TEST(CpuDenseErrors, NormsRejectUnusableEps) {
  Tensor x({2, 4}, 1.0f), y = output({2, 4});
  expectError(run(makeInst("layer_norm"), {&x}, {&y}), "layer_norm",
              "missing float attribute 'eps'");
  for (double eps : {0.0, -1.0, std::nan(""), 1e300, 1e-60}) {
    // NaN fails as not finite, the rest after rounding to fp32.
    expectError(run(makeInst("layer_norm", eps), {&x}, {&y}), "layer_norm",
                "attribute 'eps' must be");
    expectError(run(makeInst("rms_norm", eps), {&x}, {&y}), "rms_norm",
                "attribute 'eps' must be");
  }
  exec::Instruction wrongKind = makeInst("rms_norm");
  wrongKind.attrs["eps"] = std::string("small");
  expectError(run(wrongKind, {&x}, {&y}), "rms_norm", "'eps'");
}

TEST(CpuDenseErrors, OperandFormsAndShapes) {
  Tensor x({2, 3, 4}), w({5, 4}), w1({4}), b({6}), y = output({2, 3, 5});
  expectError(run(makeInst("linear"), {&x, &w1}, {&y}), "linear",
              "'weight' must have rank 2 [out, in], got [4]");
  Tensor wBad({5, 3});
  expectError(run(makeInst("linear"), {&x, &wBad}, {&y}), "linear",
              "in-features 3");
  expectError(run(makeInst("linear"), {&x, &w, &b}, {&y}), "linear",
              "'bias' has shape [6] but expected [5]");
  Tensor yBad = output({2, 3, 6});
  expectError(run(makeInst("linear"), {&x, &w}, {&yBad}), "linear",
              "'result' has shape");
  expectError(run(makeInst("linear"), {&x}, {&y}), "linear",
              "expects 2 to 3 operands, got 1");

  Tensor dy({2, 4, 5}), dw = output({5, 4});
  expectError(run(makeInst("linear_grad_params"), {&x, &dy}, {&dw}),
              "linear_grad_params", "differ in leading dimensions");

  Tensor g({4}), beta({4}), dx = output({2, 3, 4}), dg = output({4});
  expectError(run(makeInst("layer_norm", 1e-6), {&x, &g}, {&dx}), "layer_norm",
              "both gamma and beta");
  Tensor dyx({2, 3, 4});
  expectError(
      run(makeInst("layer_norm_grad", 1e-6), {&x, &dyx, &g, &beta}, {&dx, &dg}),
      "layer_norm_grad", "one gradient per affine operand");
  expectError(run(makeInst("rms_norm_grad", 1e-6), {&x, &dyx, &g}, {&dx}),
              "rms_norm_grad", "exactly when gamma is given");
  Tensor g5({5});
  expectError(run(makeInst("rms_norm", 1e-6), {&x, &g5}, {&dx}), "rms_norm",
              "'gamma' has shape [5] but expected [4]");

  Tensor x2({2, 4}), shiftBad({2, 3});
  expectError(run(makeInst("modulate"), {&x2, &g, &g}, {&dx}), "modulate",
              "'input' must have rank 3 [B, N, D], got [2, 4]");
  expectError(run(makeInst("modulate"), {&x, &shiftBad, &shiftBad}, {&dx}),
              "modulate", "'shift' has shape [2, 3] but expected [2, 4]");
  expectError(run(makeInst("gate_grad"), {&x, &shiftBad, &dyx}, {&dx, &dg}),
              "gate_grad", "'gate' has shape");

  Tensor bias3({3});
  expectError(run(makeInst("bias_add"), {&x, &bias3}, {&dx}), "bias_add",
              "is not a suffix of [2, 3, 4]");
  Tensor other({2, 3, 5});
  expectError(run(makeInst("add"), {&x, &other}, {&dx}), "add",
              "'rhs' has shape");

  Tensor p0 = output({2, 3, 1}), p1 = output({2, 3, 1}), p2 = output({2, 3, 1});
  expectError(run(makeInst("split"), {&x}, {&p0, &p1, &p2}), "split",
              "results are 3 wide together, but the input's last dimension "
              "is 4");
  Tensor c1({2, 4}), c2({3, 4}), cy = output({2, 8});
  expectError(run(makeInst("concat"), {&c1, &c2}, {&cy}), "concat",
              "differ outside the last dimension");

  Tensor r = output({5, 5});
  expectError(run(makeInst("reshape"), {&x}, {&r}), "reshape",
              "cannot reshape 24 elements");
  expectError(run(makeInst("zeros"), {&x}, {&r}), "zeros",
              "expects 0 operands, got 1");
}

TEST(CpuDenseErrors, NonFloatOrMissingData) {
  std::vector<int32_t> ids(12, 0);
  OpTensor x;
  x.type.dtype = exec::DType::I32;
  x.type.shape = {3, 4};
  x.i32 = ids.data();
  Tensor w({5, 4}), y = output({3, 5});
  expectError(runViews(makeInst("linear"), {x, w.view()}, {y.view()}), "linear",
              "'input' must be a float tensor");
  OpTensor noData = y.view();
  noData.f32 = nullptr;
  Tensor gx({3, 4});
  expectError(runViews(makeInst("gelu"), {gx.view()}, {noData}), "gelu",
              "'result' must be a float tensor");
  OpTensor reshaped;
  reshaped.type.shape = {12};
  std::vector<float> floats(12);
  reshaped.f32 = floats.data();
  expectError(runViews(makeInst("reshape"), {x}, {reshaped}), "reshape",
              "same kind of elements");
  OpTensor negative = gx.view();
  negative.type.shape = {-3, -4};
  expectError(runViews(makeInst("silu"), {negative}, {negative}), "silu",
              "negative dimension");
}

} // namespace
