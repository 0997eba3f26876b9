//===- GraphOpLowering.cpp - Graph ops as CUDA kernels and GEMMs ----------===//

#include "megaslide/runtime/cuda/GraphOpLowering.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MathExtras.h"

#include <algorithm>
#include <cmath>
#include <optional>

namespace megaslide::cuda {

using exec::DType;
using exec::OpCode;
using exec::TensorType;

namespace {

bool isFloat(DType t) {
  return t == DType::BF16 || t == DType::F16 || t == DType::F32;
}

/// Blocks of a grid-stride kernel over n elements.
uint32_t gridFor(int64_t n) {
  return static_cast<uint32_t>(std::clamp<int64_t>(
      llvm::divideCeilSigned(n, int64_t{kElementwiseBlockThreads}), 1, 16384));
}

class Lowerer {
public:
  Lowerer(const exec::Instruction &inst, llvm::ArrayRef<TensorType> operands,
          llvm::ArrayRef<TensorType> results)
      : inst(inst), ops(operands), res(results) {}

  llvm::Expected<LoweredOp> run();

  /// Each op with a cuda lowering and the member that emits it: the one
  /// table hasGraphOpLowering and run() both read.
  using LowerFn = llvm::Error (*)(Lowerer &);
  static const exec::OpTable<LowerFn> &lowerings();

private:
  const exec::Instruction &inst;
  llvm::ArrayRef<TensorType> ops, res;
  LoweredOp out;

  llvm::Error fail(const llvm::Twine &msg) const {
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   llvm::Twine("'") + exec::opName(inst.op) +
                                       "' on cuda: " + msg);
  }
  llvm::Error arity(size_t minOps, size_t maxOps, size_t minRes,
                    size_t maxRes) const {
    if (ops.size() < minOps || ops.size() > maxOps || res.size() < minRes ||
        res.size() > maxRes)
      return fail(llvm::formatv("unexpected {0} operands and {1} results",
                                ops.size(), res.size()));
    for (const TensorType &t : ops)
      if (!isFloat(t.dtype) && !isIdsOp())
        return fail(std::string("operand of type ") + exec::dtypeName(t.dtype));
    return llvm::Error::success();
  }
  bool isIdsOp() const {
    return inst.op == OpCode::Embedding || inst.op == OpCode::EmbeddingGrad;
  }

  int64_t scratch(int64_t bytes) {
    int64_t at = (out.scratchBytes + 255) / 256 * 256;
    out.scratchBytes = at + std::max<int64_t>(bytes, 0);
    return at;
  }
  void launch(const char *kind, std::vector<DType> types,
              std::array<uint32_t, 3> grid, std::vector<KernelArg> args) {
    out.steps.push_back(
        KernelLaunch{KernelInstance{kind, std::move(types)}, grid, args});
  }
  void launch1d(const char *kind, std::vector<DType> types, int64_t n,
                std::vector<KernelArg> args) {
    fits(n);
    launch(kind, std::move(types), {gridFor(n), 1, 1}, std::move(args));
  }
  /// Notes an index range the 32-bit kernels cannot cover; run() fails
  /// with it once the op is lowered.
  void fits(int64_t n) {
    if (n > kMaxKernelElements)
      tooLarge = std::max(tooLarge, n);
  }
  int64_t tooLarge = 0;

  static KernelArg B(BufferRef r) { return KernelArg::buf(r); }
  static KernelArg I(int64_t v) { return KernelArg::i64(v); }
  /// An `unsigned` argument (the low half of the slot); fits() bounds it.
  static KernelArg U(int64_t v) { return KernelArg::i64(v); }
  /// An `msDivisor` argument.
  KernelArg Q(int64_t d) {
    fits(d);
    return KernelArg::i64(static_cast<int64_t>(
        fastDivisor(std::clamp<int64_t>(d, 1, kMaxKernelElements))));
  }
  static KernelArg F(double v) { return KernelArg::f32(v); }
  static BufferRef op(int64_t i) { return BufferRef::operand(i); }
  static BufferRef rs(int64_t i) { return BufferRef::result(i); }

  double floatAttr(llvm::StringRef name, double dflt) const {
    return inst.floatAttr(name).value_or(dflt);
  }
  llvm::Expected<std::array<int64_t, 3>> triple(llvm::StringRef name) const {
    auto v = inst.intsAttr(name);
    if (!v || v->size() != 3)
      return fail("needs a 3-element '" + name + "' attribute");
    return std::array<int64_t, 3>{(*v)[0], (*v)[1], (*v)[2]};
  }

  /// Sums a [groups * rows, cols] matrix (a, or a * b per `mode`) over the
  /// rows of each group into `dst` [groups, cols].
  void colsum(BufferRef a, DType ta, std::optional<BufferRef> b, DType tb,
              std::optional<BufferRef> stats, int mode, int64_t groups,
              int64_t rows, int64_t cols, BufferRef dst, DType td);

  /// dst = src converted, in scratch: returns the scratch buffer.
  BufferRef converted(BufferRef src, DType from, DType to, int64_t n) {
    BufferRef s = BufferRef::scratch(scratch(n * exec::dtypeBytes(to)));
    launch1d("cast", {from, to}, n, {B(src), B(s), U(n)});
    return s;
  }

  /// y [M, O] = x [M, I] W^T (+ bias [O]) for row-major x, W [O, I], y.
  void gemmForward(BufferRef x, DType tx, int64_t M, int64_t In, BufferRef w,
                   DType tw, int64_t O, BufferRef y, DType ty,
                   std::optional<std::pair<BufferRef, DType>> bias);
  /// dx [M, I] = dy [M, O] W [O, I].
  void gemmGradData(BufferRef dy, DType tdy, int64_t M, int64_t O, BufferRef w,
                    DType tw, int64_t In, BufferRef dx, DType tdx);
  /// dW [O, I] = dy^T [O, M] x [M, I].
  void gemmGradParams(BufferRef x, DType tx, int64_t M, int64_t In,
                      BufferRef dy, DType tdy, int64_t O, BufferRef dw,
                      DType tdw);
  /// Gives A and B one type: the 16-bit one(s) widened to f32 in scratch
  /// when they differ.
  DType harmonise(BufferRef &a, DType ta, int64_t na, BufferRef &b, DType tb,
                  int64_t nb);
  /// Emits `g` writing into d (of type td), through an f32 scratch when
  /// cuBLASLt cannot write td from g.abType.
  void emitGemm(GemmCall g, BufferRef d, DType td,
                std::optional<std::pair<BufferRef, DType>> bias);

  /// Latents x [B, C, T, H, W] (shape `xs`) as patch rows into y:
  /// patchify's (pt, ph, pw, C) order when channelsLast, else im2col's
  /// (C, pt, ph, pw).
  void patchGather(BufferRef x, DType tx, BufferRef y, DType ty,
                   const std::vector<int64_t> &xs, std::array<int64_t, 3> patch,
                   bool channelsLast);

  llvm::Error lowerNorm(bool rms);
  llvm::Error lowerNormGrad(bool rms);
  llvm::Error lowerModulateLike(bool isGate);
  llvm::Error lowerModulateGrad(bool isGate);
  llvm::Error lowerAttention();
  llvm::Error lowerAttentionGrad();
  llvm::Error lowerPatchEmbed(bool grad);
  llvm::Error lowerFlowLoss(bool grad);
  llvm::Error lowerLinear();
  llvm::Error lowerSplitConcat(bool split);
  llvm::Error lowerRope();
  llvm::Error lowerPatchify(bool inverse);
  llvm::Error lowerEmbedding(bool grad);
  llvm::Error lowerElementwise(size_t nOps);
  llvm::Error lowerReshape();
  llvm::Error lowerZeros();
  llvm::Error lowerBiasAdd();
  llvm::Error lowerBiasAddGrad();
  llvm::Error lowerTimestepEmbedding();
  llvm::Error lowerFlowInterpolate();

  /// Stride of a per-sample [B, D] or shared [D] modulation tensor.
  llvm::Expected<int64_t> batchStride(const TensorType &t, int64_t batch,
                                      int64_t D) const {
    if (t.numElements() == batch * D)
      return D;
    if (t.numElements() == D)
      return 0;
    return fail(llvm::formatv("modulation tensor of {0} elements for batch "
                              "{1} and width {2}",
                              t.numElements(), batch, D));
  }
};

void Lowerer::colsum(BufferRef a, DType ta, std::optional<BufferRef> b,
                     DType tb, std::optional<BufferRef> stats, int mode,
                     int64_t groups, int64_t rows, int64_t cols, BufferRef dst,
                     DType td) {
  int64_t chunks =
      std::clamp<int64_t>(llvm::divideCeilSigned(rows, 64), 1, 1024);
  int64_t chunkRows =
      std::max<int64_t>(llvm::divideCeilSigned(rows, chunks), 1);
  chunks = std::max<int64_t>(llvm::divideCeilSigned(rows, chunkRows), 1);
  BufferRef partial =
      BufferRef::scratch(scratch(groups * chunks * cols * int64_t(4)));
  launch("colsum_partial", {ta, b ? tb : ta},
         {static_cast<uint32_t>(
              llvm::divideCeilSigned(cols, int64_t{kElementwiseBlockThreads})),
          static_cast<uint32_t>(chunks), static_cast<uint32_t>(groups)},
         {B(a), b ? B(*b) : KernelArg::null(),
          stats ? B(*stats) : KernelArg::null(), B(partial), I(rows), I(cols),
          I(chunkRows), I(mode)});
  fits(groups * chunks * cols);
  launch1d("colsum_finalize", {td}, groups * cols,
           {B(partial), B(dst), U(groups * cols), U(chunks), Q(cols)});
}

void Lowerer::patchGather(BufferRef x, DType tx, BufferRef y, DType ty,
                          const std::vector<int64_t> &xs,
                          std::array<int64_t, 3> patch, bool channelsLast) {
  auto [pt, ph, pw] = patch;
  int64_t C = xs[1], n = xs[0] * C * xs[2] * xs[3] * xs[4];
  std::array<int64_t, 3> inner =
      channelsLast ? std::array{C, pw, ph} : std::array{pw, ph, pt};
  launch1d("patch_gather", {tx, ty}, n,
           {B(x), B(y), U(n), U(C), U(xs[2]), U(xs[3]), U(xs[4]), U(pt), U(ph),
            U(pw), Q(C * pt * ph * pw), Q(xs[4] / pw), Q(xs[3] / ph),
            Q(xs[2] / pt), Q(inner[0]), Q(inner[1]), Q(inner[2]),
            U(channelsLast)});
}

DType Lowerer::harmonise(BufferRef &a, DType ta, int64_t na, BufferRef &b,
                         DType tb, int64_t nb) {
  if (ta == tb)
    return ta;
  if (ta != DType::F32)
    a = converted(a, ta, DType::F32, na);
  if (tb != DType::F32)
    b = converted(b, tb, DType::F32, nb);
  return DType::F32;
}

void Lowerer::emitGemm(GemmCall g, BufferRef d, DType td,
                       std::optional<std::pair<BufferRef, DType>> bias) {
  bool direct = td == g.abType || td == DType::F32;
  g.dType = direct ? td : DType::F32;
  g.d = direct ? d : BufferRef::scratch(scratch(g.m * g.n * int64_t(4)));
  if (bias) {
    g.hasBias = true;
    g.bias = bias->second == g.dType
                 ? bias->first
                 : converted(bias->first, bias->second, g.dType, g.m);
  }
  out.steps.push_back(g);
  if (!direct)
    launch1d("cast", {DType::F32, td}, g.m * g.n, {B(g.d), B(d), U(g.m * g.n)});
}

void Lowerer::gemmForward(BufferRef x, DType tx, int64_t M, int64_t In,
                          BufferRef w, DType tw, int64_t O, BufferRef y,
                          DType ty,
                          std::optional<std::pair<BufferRef, DType>> bias) {
  // Column-major: y^T [O, M] = W [O, I] (stored as [I, O], transposed) x
  // x^T [I, M].
  GemmCall g;
  g.abType = harmonise(w, tw, O * In, x, tx, M * In);
  g.transA = true;
  g.transB = false;
  g.m = O;
  g.n = M;
  g.k = In;
  g.a = w;
  g.lda = In;
  g.b = x;
  g.ldb = In;
  g.ldd = O;
  emitGemm(g, y, ty, bias);
}

void Lowerer::gemmGradData(BufferRef dy, DType tdy, int64_t M, int64_t O,
                           BufferRef w, DType tw, int64_t In, BufferRef dx,
                           DType tdx) {
  // Column-major: dx^T [I, M] = W^T [I, O] (stored as is) x dy^T [O, M].
  GemmCall g;
  g.abType = harmonise(w, tw, O * In, dy, tdy, M * O);
  g.m = In;
  g.n = M;
  g.k = O;
  g.a = w;
  g.lda = In;
  g.b = dy;
  g.ldb = O;
  g.ldd = In;
  emitGemm(g, dx, tdx, std::nullopt);
}

void Lowerer::gemmGradParams(BufferRef x, DType tx, int64_t M, int64_t In,
                             BufferRef dy, DType tdy, int64_t O, BufferRef dw,
                             DType tdw) {
  // Column-major: dW^T [I, O] = x^T [I, M] (stored as is) x dy [M, O]
  // (stored as dy^T [O, M], transposed).
  GemmCall g;
  g.abType = harmonise(x, tx, M * In, dy, tdy, M * O);
  g.transB = true;
  g.m = In;
  g.n = O;
  g.k = M;
  g.a = x;
  g.lda = In;
  g.b = dy;
  g.ldb = O;
  g.ldd = In;
  emitGemm(g, dw, tdw, std::nullopt);
}

llvm::Error Lowerer::lowerLinear() {
  auto lastDim = [](const TensorType &t) {
    return t.shape.empty() ? int64_t(1) : t.shape.back();
  };
  if (inst.op == OpCode::Linear) {
    if (auto e = arity(2, 3, 1, 1))
      return e;
    const TensorType &x = ops[0], &w = ops[1];
    if (w.shape.size() != 2 || lastDim(x) != w.shape[1])
      return fail("weight must be [out, in] matching the input");
    int64_t In = w.shape[1], O = w.shape[0], M = x.numElements() / In;
    std::optional<std::pair<BufferRef, DType>> bias;
    if (ops.size() == 3) {
      if (ops[2].numElements() != O)
        return fail("bias must have the output width");
      bias = std::make_pair(op(2), ops[2].dtype);
    }
    if (res[0].numElements() != M * O)
      return fail("result shape does not match input and weight");
    gemmForward(op(0), x.dtype, M, In, op(1), w.dtype, O, rs(0), res[0].dtype,
                bias);
    return llvm::Error::success();
  }
  if (inst.op == OpCode::LinearGradData) {
    if (auto e = arity(2, 2, 1, 1))
      return e;
    const TensorType &dy = ops[0], &w = ops[1];
    if (w.shape.size() != 2 || lastDim(dy) != w.shape[0])
      return fail("weight must be [out, in] matching the gradient");
    int64_t O = w.shape[0], In = w.shape[1], M = dy.numElements() / O;
    if (res[0].numElements() != M * In)
      return fail("result shape does not match gradient and weight");
    gemmGradData(op(0), dy.dtype, M, O, op(1), w.dtype, In, rs(0),
                 res[0].dtype);
    return llvm::Error::success();
  }
  // linear_grad_params
  if (auto e = arity(2, 2, 1, 2))
    return e;
  const TensorType &x = ops[0], &dy = ops[1];
  int64_t In = lastDim(x), O = lastDim(dy), M = x.numElements() / In;
  if (dy.numElements() != M * O || res[0].numElements() != O * In)
    return fail("input, gradient and weight gradient shapes disagree");
  gemmGradParams(op(0), x.dtype, M, In, op(1), dy.dtype, O, rs(0),
                 res[0].dtype);
  if (res.size() == 2)
    colsum(op(1), dy.dtype, std::nullopt, dy.dtype, std::nullopt, 0, 1, M, O,
           rs(1), res[1].dtype);
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerNorm(bool rms) {
  if (auto e = arity(1, rms ? 2 : 3, 1, 1))
    return e;
  const TensorType &x = ops[0];
  if (x.shape.empty())
    return fail("needs a ranked input");
  int64_t D = x.shape.back(), rows = x.numElements() / D;
  for (size_t i = 1; i < ops.size(); ++i)
    if (ops[i].numElements() != D)
      return fail("affine operands must have the normalised width");
  if (rows > INT32_MAX)
    return fail("too many rows for one launch");
  float eps = static_cast<float>(floatAttr("eps", 1e-6));
  DType tx = x.dtype, ty = res[0].dtype;
  std::array<uint32_t, 3> grid{static_cast<uint32_t>(rows), 1, 1};
  auto opt = [&](size_t i) {
    return i < ops.size() ? B(op(i)) : KernelArg::null();
  };
  auto optType = [&](size_t i) { return i < ops.size() ? ops[i].dtype : tx; };
  if (rms)
    launch("rms_norm", {tx, optType(1), ty}, grid,
           {B(op(0)), opt(1), B(rs(0)), I(D), F(eps)});
  else
    launch("layer_norm", {tx, optType(1), optType(2), ty}, grid,
           {B(op(0)), opt(1), opt(2), B(rs(0)), I(D), F(eps)});
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerNormGrad(bool rms) {
  if (auto e = arity(2, rms ? 3 : 4, 1, rms ? 2 : 3))
    return e;
  const TensorType &x = ops[0];
  if (x.shape.empty() || ops[1].numElements() != x.numElements())
    return fail("input and gradient shapes disagree");
  int64_t D = x.shape.back(), rows = x.numElements() / D;
  if (rows > INT32_MAX)
    return fail("too many rows for one launch");
  if (res.size() > 1 && ops.size() < 3)
    return fail("affine gradients need the affine operands");
  float eps = static_cast<float>(floatAttr("eps", 1e-6));
  bool affine = ops.size() > 2;
  DType tx = x.dtype, tdy = ops[1].dtype;
  DType tg = affine ? ops[2].dtype : tx;
  std::optional<BufferRef> stats;
  if (res.size() > 1)
    stats = BufferRef::scratch(scratch(rows * (rms ? 4 : 8)));
  std::array<uint32_t, 3> grid{static_cast<uint32_t>(rows), 1, 1};
  launch(rms ? "rms_norm_grad" : "layer_norm_grad", {tx, tdy, tg, res[0].dtype},
         grid,
         {B(op(0)), B(op(1)), affine ? B(op(2)) : KernelArg::null(), B(rs(0)),
          stats ? B(*stats) : KernelArg::null(), I(D), F(eps)});
  if (res.size() > 1)
    colsum(op(1), tdy, op(0), tx, stats, rms ? 3 : 2, 1, rows, D, rs(1),
           res[1].dtype);
  if (res.size() > 2)
    colsum(op(1), tdy, std::nullopt, tdy, std::nullopt, 0, 1, rows, D, rs(2),
           res[2].dtype);
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerModulateLike(bool isGate) {
  if (auto e = arity(isGate ? 2 : 3, isGate ? 2 : 3, 1, 1))
    return e;
  const TensorType &x = ops[0];
  if (x.shape.size() < 2)
    return fail("input must be [B, ..., D]");
  int64_t n = x.numElements(), batch = x.shape[0], D = x.shape.back();
  int64_t perBatch = n / batch;
  if (isGate) {
    auto gs = batchStride(ops[1], batch, D);
    if (!gs)
      return gs.takeError();
    launch1d("gate", {x.dtype, ops[1].dtype, res[0].dtype}, n,
             {B(op(0)), B(op(1)), B(rs(0)), U(n), Q(D), Q(perBatch), U(*gs)});
    return llvm::Error::success();
  }
  auto ss = batchStride(ops[1], batch, D);
  if (!ss)
    return ss.takeError();
  auto cs = batchStride(ops[2], batch, D);
  if (!cs)
    return cs.takeError();
  launch1d("modulate", {x.dtype, ops[1].dtype, ops[2].dtype, res[0].dtype}, n,
           {B(op(0)), B(op(1)), B(op(2)), B(rs(0)), U(n), Q(D), Q(perBatch),
            U(*ss), U(*cs)});
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerModulateGrad(bool isGate) {
  // gate_grad (x, gate, dy) -> dx, dgate; modulate_grad (x, scale, dy) ->
  // dx, dshift, dscale.
  if (auto e = arity(3, 3, isGate ? 2 : 3, isGate ? 2 : 3))
    return e;
  const TensorType &x = ops[0], &m = ops[1], &dy = ops[2];
  if (x.shape.size() < 2 || dy.numElements() != x.numElements())
    return fail("input and gradient shapes disagree");
  int64_t n = x.numElements(), batch = x.shape[0], D = x.shape.back();
  int64_t perBatch = n / batch, tokens = perBatch / D;
  auto ms = batchStride(m, batch, D);
  if (!ms)
    return ms.takeError();
  if (isGate)
    launch1d("gate", {dy.dtype, m.dtype, res[0].dtype}, n,
             {B(op(2)), B(op(1)), B(rs(0)), U(n), Q(D), Q(perBatch), U(*ms)});
  else
    launch1d("modulate", {dy.dtype, m.dtype, m.dtype, res[0].dtype}, n,
             {B(op(2)), KernelArg::null(), B(op(1)), B(rs(0)), U(n), Q(D),
              Q(perBatch), U(0), U(*ms)});
  // Per-sample [B, D] gradients sum over the tokens of a sample; shared
  // [D] ones over every token.
  auto reduce = [&](size_t result, bool timesX) -> llvm::Error {
    int64_t count = res[result].numElements();
    int64_t groups = count == batch * D ? batch : 1;
    if (count != batch * D && count != D)
      return fail("gradient of a modulation tensor has the wrong size");
    colsum(op(2), dy.dtype,
           timesX ? std::optional<BufferRef>(op(0)) : std::nullopt, x.dtype,
           std::nullopt, timesX ? 1 : 0, groups,
           groups == 1 ? batch * tokens : tokens, D, rs(result),
           res[result].dtype);
    return llvm::Error::success();
  };
  if (isGate)
    return reduce(1, true);
  if (auto e = reduce(1, false))
    return e;
  return reduce(2, true);
}

/// True when global attention over these inputs runs on the tensor-core
/// kernels: one 16-bit type for every input read through mma.sync and a
/// head dim that is a multiple of 8 up to 128 (zero-padded to a multiple of
/// 16 inside the kernel). fp32 inputs stay on the scalar kernels: rounding
/// them to bf16 would change the plan's numerics.
bool attentionOnTensorCores(llvm::ArrayRef<DType> inputs, int64_t Dh) {
  DType t = inputs.front();
  if (t != DType::BF16 && t != DType::F16)
    return false;
  if (!llvm::all_of(inputs, [&](DType d) { return d == t; }))
    return false;
  return Dh >= 8 && Dh % 8 == 0 && Dh <= kAttentionTcMaxHeadDim;
}

/// The tensor-core kind of a scalar attention kind at head dim Dh.
std::string tensorCoreKind(const char *kind, int64_t Dh) {
  return std::string(kind) + "_tc" + std::to_string(Dh);
}

/// Grid of the tensor-core kernels: 64 rows of one (head, sample) per CTA.
std::array<uint32_t, 3> tensorCoreGrid(int64_t rows, int64_t H, int64_t Bn) {
  return {static_cast<uint32_t>(llvm::divideCeilSigned(rows, 64)),
          static_cast<uint32_t>(H), static_cast<uint32_t>(Bn)};
}

llvm::Error Lowerer::lowerAttention() {
  if (auto e = arity(3, 3, 1, 1))
    return e;
  const TensorType &q = ops[0], &k = ops[1], &v = ops[2];
  if (q.shape.size() != 4 || k.shape.size() != 4 || v.shape != k.shape)
    return fail("q, k, v must be [B, N, H, Dh] with matching k and v");
  int64_t Bn = q.shape[0], Nq = q.shape[1], H = q.shape[2], Dh = q.shape[3];
  int64_t Nk = k.shape[1];
  if (Dh > kAttentionMaxHeadDim)
    return fail(
        llvm::formatv("head dim {0} over {1}", Dh, kAttentionMaxHeadDim));
  double scale = floatAttr("scale", 1.0 / std::sqrt(double(Dh)));
  if (attentionOnTensorCores({q.dtype, k.dtype, v.dtype}, Dh)) {
    out.steps.push_back(
        KernelLaunch{KernelInstance{tensorCoreKind("attention_fwd", Dh),
                                    {q.dtype, k.dtype, v.dtype, res[0].dtype}},
                     tensorCoreGrid(Nq, H, Bn),
                     {B(op(0)), B(op(1)), B(op(2)), B(rs(0)), KernelArg::null(),
                      I(Bn), I(Nq), I(Nk), I(H), I(Dh), F(scale)}});
    return llvm::Error::success();
  }
  int64_t warps = Bn * H * Nq;
  launch("attention_fwd", {q.dtype, k.dtype, v.dtype, res[0].dtype},
         {gridFor(warps * 32), 1, 1},
         {B(op(0)), B(op(1)), B(op(2)), B(rs(0)), KernelArg::null(), I(Bn),
          I(Nq), I(Nk), I(H), I(Dh), F(scale)});
  // gridFor caps blocks for grid-stride kernels; these are not: one warp
  // per query, every warp needs a thread.
  auto &l = std::get<KernelLaunch>(out.steps.back());
  l.grid[0] = static_cast<uint32_t>(
      llvm::divideCeilSigned(warps * 32, int64_t{kElementwiseBlockThreads}));
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerAttentionGrad() {
  if (auto e = arity(5, 5, 3, 3))
    return e;
  const TensorType &q = ops[0], &k = ops[1], &v = ops[2], &o = ops[3],
                   &dout = ops[4];
  if (q.shape.size() != 4 || k.shape.size() != 4 || v.shape != k.shape ||
      o.shape != q.shape || dout.shape != q.shape)
    return fail("q, k, v, output and its gradient must be [B, N, H, Dh]");
  int64_t Bn = q.shape[0], Nq = q.shape[1], H = q.shape[2], Dh = q.shape[3];
  int64_t Nk = k.shape[1];
  if (Dh > kAttentionMaxHeadDim)
    return fail(
        llvm::formatv("head dim {0} over {1}", Dh, kAttentionMaxHeadDim));
  double scale = floatAttr("scale", 1.0 / std::sqrt(double(Dh)));
  BufferRef lse = BufferRef::scratch(scratch(Bn * H * Nq * 4));
  BufferRef delta = BufferRef::scratch(scratch(Bn * H * Nq * 4));
  if (attentionOnTensorCores({q.dtype, k.dtype, v.dtype, dout.dtype}, Dh)) {
    out.steps.push_back(KernelLaunch{
        KernelInstance{
            tensorCoreKind("attention_bwd_dq", Dh),
            {q.dtype, k.dtype, v.dtype, o.dtype, dout.dtype, res[0].dtype}},
        tensorCoreGrid(Nq, H, Bn),
        {B(op(0)), B(op(1)), B(op(2)), B(op(3)), B(op(4)), B(rs(0)), B(lse),
         B(delta), I(Bn), I(Nq), I(Nk), I(H), I(Dh), F(scale)}});
    out.steps.push_back(KernelLaunch{
        KernelInstance{tensorCoreKind("attention_bwd_dkv", Dh),
                       {q.dtype, k.dtype, v.dtype, dout.dtype, res[1].dtype,
                        res[2].dtype}},
        tensorCoreGrid(Nk, H, Bn),
        {B(op(0)), B(op(1)), B(op(2)), B(op(4)), B(rs(1)), B(rs(2)), B(lse),
         B(delta), I(Bn), I(Nq), I(Nk), I(H), I(Dh), F(scale)}});
    return llvm::Error::success();
  }
  launch("attention_bwd_dq",
         {q.dtype, k.dtype, v.dtype, o.dtype, dout.dtype, res[0].dtype},
         {static_cast<uint32_t>(llvm::divideCeilSigned(
              Bn * H * Nq * 32, int64_t{kElementwiseBlockThreads})),
          1, 1},
         {B(op(0)), B(op(1)), B(op(2)), B(op(3)), B(op(4)), B(rs(0)), B(lse),
          B(delta), I(Bn), I(Nq), I(Nk), I(H), I(Dh), F(scale)});
  launch("attention_bwd_dkv",
         {q.dtype, k.dtype, v.dtype, dout.dtype, res[1].dtype, res[2].dtype},
         {static_cast<uint32_t>(llvm::divideCeilSigned(
              Bn * H * Nk * 32, int64_t{kElementwiseBlockThreads})),
          1, 1},
         {B(op(0)), B(op(1)), B(op(2)), B(op(4)), B(rs(1)), B(rs(2)), B(lse),
          B(delta), I(Bn), I(Nq), I(Nk), I(H), I(Dh), F(scale)});
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerPatchEmbed(bool grad) {
  // patch_embed (x, w [D, C, pt, ph, pw], b [D]) -> y [B, N, D];
  // patch_embed_grad (x, dy) -> dw, db.
  if (auto e = grad ? arity(2, 2, 2, 2) : arity(3, 3, 1, 1))
    return e;
  const TensorType &x = ops[0];
  const TensorType &w = grad ? res[0] : ops[1];
  if (x.shape.size() != 5 || w.shape.size() != 5 || w.shape[1] != x.shape[1])
    return fail("latents must be [B, C, T, H, W] and the weight "
                "[D, C, pt, ph, pw]");
  int64_t Bn = x.shape[0], C = x.shape[1], T = x.shape[2], H = x.shape[3],
          W = x.shape[4];
  int64_t D = w.shape[0], pt = w.shape[2], ph = w.shape[3], pw = w.shape[4];
  if (pt <= 0 || ph <= 0 || pw <= 0 || T % pt || H % ph || W % pw)
    return fail("latents are not a whole number of patches");
  int64_t N = (T / pt) * (H / ph) * (W / pw), K = C * pt * ph * pw;
  int64_t M = Bn * N;
  // im2col in the GEMM's 16-bit type: the weight's (forward) or the
  // token gradient's (backward).
  DType tc = grad ? ops[1].dtype : w.dtype;
  BufferRef cols = BufferRef::scratch(scratch(M * K * exec::dtypeBytes(tc)));
  patchGather(op(0), x.dtype, cols, tc, x.shape, {pt, ph, pw}, false);
  if (!grad) {
    if (ops[2].numElements() != D || res[0].numElements() != M * D)
      return fail("bias or result shape does not match the weight");
    gemmForward(cols, tc, M, K, op(1), w.dtype, D, rs(0), res[0].dtype,
                std::make_pair(op(2), ops[2].dtype));
    return llvm::Error::success();
  }
  const TensorType &dy = ops[1];
  if (dy.numElements() != M * D || res[1].numElements() != D)
    return fail("token gradient or bias gradient shape does not match");
  gemmGradParams(cols, tc, M, K, op(1), dy.dtype, D, rs(0), res[0].dtype);
  colsum(op(1), dy.dtype, std::nullopt, dy.dtype, std::nullopt, 0, 1, M, D,
         rs(1), res[1].dtype);
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerFlowLoss(bool grad) {
  // A weighted loss (fourth operand, fp32 [B]) also returns the unweighted
  // loss; its kernels are the _w variants.
  if (auto e = arity(3, 4, 1, grad ? 1 : 2))
    return e;
  bool weighted = ops.size() == 4;
  if (!grad && res.size() != (weighted ? 2u : 1u))
    return fail("returns the unweighted loss exactly when it has weights");
  const TensorType &pred = ops[0], &x0 = ops[1], &noise = ops[2];
  if (x0.shape.size() < 2 || pred.shape.size() != x0.shape.size() ||
      noise.numElements() != x0.numElements() || pred.shape[0] != x0.shape[0] ||
      pred.shape[1] < x0.shape[1])
    return fail("prediction, latents and noise shapes disagree");
  int64_t Bn = x0.shape[0], C = x0.shape[1], Cp = pred.shape[1];
  int64_t n = x0.numElements(), S = n / (Bn * C);
  if (pred.numElements() != Bn * Cp * S)
    return fail("prediction and latents differ beyond the channels");
  if (weighted &&
      (ops[3].dtype != exec::DType::F32 || ops[3].numElements() != Bn))
    return fail("weights must be fp32, one per sample");
  if (grad) {
    int64_t np = pred.numElements();
    if (weighted)
      launch1d("fm_loss_grad_w",
               {pred.dtype, x0.dtype, noise.dtype, res[0].dtype}, np,
               {B(op(0)), B(op(1)), B(op(2)), B(op(3)), B(rs(0)), U(np), Q(S),
                Q(Cp), U(C), F(2.0 / double(n))});
    else
      launch1d("fm_loss_grad",
               {pred.dtype, x0.dtype, noise.dtype, res[0].dtype}, np,
               {B(op(0)), B(op(1)), B(op(2)), B(rs(0)), U(np), Q(S), Q(Cp),
                U(C), F(2.0 / double(n))});
    return llvm::Error::success();
  }
  uint32_t blocks = static_cast<uint32_t>(std::clamp<int64_t>(
      llvm::divideCeilSigned(n, int64_t{kElementwiseBlockThreads}), 1, 1024));
  BufferRef partial =
      BufferRef::scratch(scratch(int64_t(blocks) * 4 * (weighted ? 2 : 1)));
  fits(pred.numElements());
  fits(n);
  if (weighted)
    launch("fm_loss_partial_w", {pred.dtype, x0.dtype, noise.dtype},
           {blocks, 1, 1},
           {B(op(0)), B(op(1)), B(op(2)), B(op(3)), B(partial), U(n), Q(C * S),
            U(Cp * S)});
  else
    launch(
        "fm_loss_partial", {pred.dtype, x0.dtype, noise.dtype}, {blocks, 1, 1},
        {B(op(0)), B(op(1)), B(op(2)), B(partial), U(n), Q(C * S), U(Cp * S)});
  for (size_t r = 0; r < res.size(); ++r)
    launch("sum_finalize", {res[r].dtype}, {1, 1, 1},
           {B(partial.plus(int64_t(blocks) * 4 * r)), B(rs(r)), I(blocks),
            F(1.0 / double(n))});
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerSplitConcat(bool split) {
  if (auto e = split ? arity(1, 1, 1, SIZE_MAX) : arity(1, SIZE_MAX, 1, 1))
    return e;
  const TensorType &whole = split ? ops[0] : res[0];
  llvm::ArrayRef<TensorType> parts = split ? res : ops;
  if (whole.shape.empty())
    return fail("needs ranked tensors");
  int64_t width = whole.shape.back(), rows = whole.numElements() / width;
  int64_t offset = 0;
  for (auto [i, part] : llvm::enumerate(parts)) {
    int64_t cols = part.shape.empty() ? 1 : part.shape.back();
    if (part.numElements() != rows * cols)
      return fail("pieces must share the leading dimensions");
    fits(whole.numElements());
    if (split)
      launch1d("copy2d", {whole.dtype, part.dtype}, rows * cols,
               {B(op(0)), B(rs(i)), U(rows), Q(cols), U(width), U(offset),
                U(cols), U(0)});
    else
      launch1d("copy2d", {part.dtype, whole.dtype}, rows * cols,
               {B(op(i)), B(rs(0)), U(rows), Q(cols), U(cols), U(0), U(width),
                U(offset)});
    offset += cols;
  }
  if (offset != width)
    return fail("pieces do not add up to the last dimension");
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerRope() {
  if (auto e = arity(1, 1, 1, 1))
    return e;
  const TensorType &x = ops[0];
  auto grid = triple("grid");
  if (!grid)
    return grid.takeError();
  auto dims = triple("dims");
  if (!dims)
    return dims.takeError();
  if (x.shape.size() != 4)
    return fail("input must be [B, N, H, Dh]");
  int64_t N = x.shape[1], H = x.shape[2], Dh = x.shape[3];
  auto [gt, gy, gx] = *grid;
  auto [dt, dy, dx] = *dims;
  if (gt * gy * gx != N)
    return fail("grid does not cover the tokens");
  if (Dh % 2 || dt % 2 || dy % 2 || dx % 2 || dt + dy + dx > Dh)
    return fail("rotary dims must be even and fit the head dim");
  bool inverse = false;
  if (const exec::Attr *a = inst.attr("inverse")) {
    inverse = true;
    if (auto *i = std::get_if<int64_t>(a))
      inverse = *i != 0;
  }
  double theta = floatAttr("theta", 10000.0);
  if (!(theta > 1) || !std::isfinite(theta))
    return fail("theta must be a finite number over 1");
  int64_t pairs = x.numElements() / 2;
  fits(x.numElements());
  // Per axis of d channels, pair i's frequency over pi is 2^(i c + lpi):
  // the exponent's coefficients in double, rounded to float once.
  auto coef = [&](int64_t d) {
    return F(d ? -2.0 * std::log2(theta) / double(d) : 0.0);
  };
  launch1d("rope3d", {x.dtype, res[0].dtype}, pairs,
           {B(op(0)), B(rs(0)), U(pairs), Q(Dh / 2), Q(H), Q(N), Q(gx), Q(gy),
            U(dt), U(dy), U(dx), coef(dt), coef(dy), coef(dx),
            F(-std::log2(M_PI)), F(inverse ? -1.0 : 1.0)});
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerPatchify(bool inverse) {
  // patchify: latents [B, C, T, H, W] -> tokens; unpatchify: the reverse.
  if (auto e = arity(1, 1, 1, 1))
    return e;
  auto patch = triple("patch");
  if (!patch)
    return patch.takeError();
  const TensorType &y = inverse ? res[0] : ops[0];
  auto [pt, ph, pw] = *patch;
  if (y.shape.size() != 5 || pt <= 0 || ph <= 0 || pw <= 0 || y.shape[2] % pt ||
      y.shape[3] % ph || y.shape[4] % pw ||
      res[0].numElements() != ops[0].numElements())
    return fail("latents [B, C, T, H, W] are not whole patches");
  if (!inverse) {
    // Channels fastest within a patch.
    patchGather(op(0), ops[0].dtype, rs(0), res[0].dtype, y.shape, {pt, ph, pw},
                true);
    return llvm::Error::success();
  }
  const std::vector<int64_t> &s = y.shape;
  launch1d("unpatchify", {ops[0].dtype, res[0].dtype}, y.numElements(),
           {B(op(0)), B(rs(0)), U(y.numElements()), Q(s[1]), Q(s[2]), Q(s[3]),
            Q(s[4]), Q(pt), Q(ph), Q(pw), U(s[3] / ph), U(s[4] / pw)});
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerEmbedding(bool grad) {
  if (auto e = arity(2, 2, 1, 1))
    return e;
  const TensorType &ids = ops[0];
  const TensorType &table = grad ? res[0] : ops[1];
  if (ids.dtype != DType::I32 && ids.dtype != DType::I64)
    return fail("ids must be i32 or i64");
  if (table.shape.size() != 2)
    return fail("table must be [V, D]");
  int64_t V = table.shape[0], D = table.shape[1], rows = ids.numElements();
  if ((grad ? ops[1] : res[0]).numElements() != rows * D)
    return fail("rows do not match ids and table width");
  fits(V * D);
  fits(rows * D);
  if (grad)
    launch1d("embedding_grad", {ids.dtype, ops[1].dtype, res[0].dtype}, V * D,
             {B(op(0)), B(op(1)), B(rs(0)), U(rows), Q(D), U(V * D)});
  else
    launch1d("embedding", {ids.dtype, ops[1].dtype, res[0].dtype}, rows * D,
             {B(op(0)), B(op(1)), B(rs(0)), U(rows * D), Q(D), I(V)});
  return llvm::Error::success();
}

/// The op's own kernel over equally sized operands and result.
llvm::Error Lowerer::lowerElementwise(size_t nOps) {
  if (auto e = arity(nOps, nOps, 1, 1))
    return e;
  int64_t n = res[0].numElements();
  std::vector<DType> types;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].numElements() != n)
      return fail("operands and result differ in size");
    types.push_back(ops[i].dtype);
  }
  types.push_back(res[0].dtype);
  // gelu and gelu_grad {exact}: their erf kernels.
  const char *kernel = exec::opName(inst.op);
  if (inst.hasAttr(exec::kExactAttr))
    kernel = inst.op == OpCode::Gelu ? "gelu_exact" : "gelu_exact_grad";
  // Beyond the 32-bit kernels' reach (the 105B FFN's GELU: 2.48e9
  // elements), one launch per slice: the ops are elementwise, so slices of
  // every buffer at the same element offset are independent. Slices of
  // 2^30 elements keep each buffer 16-byte aligned for the vector loads.
  constexpr int64_t kSlice = int64_t(1) << 30;
  for (int64_t first = 0; first < n; first += kSlice) {
    int64_t count = std::min(kSlice, n - first);
    std::vector<KernelArg> args;
    for (size_t i = 0; i < ops.size(); ++i)
      args.push_back(B(op(i).plus(first * exec::dtypeBytes(ops[i].dtype))));
    args.push_back(B(rs(0).plus(first * exec::dtypeBytes(res[0].dtype))));
    args.push_back(U(count));
    launch1d(kernel, types, count, args);
  }
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerReshape() {
  if (auto e = arity(1, 1, 1, 1))
    return e;
  if (ops[0].bytes() != res[0].bytes() || ops[0].dtype != res[0].dtype)
    return fail("reshape changes the bytes");
  out.steps.push_back(CopyCall{op(0), rs(0), res[0].bytes()});
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerZeros() {
  if (!ops.empty() || res.size() != 1)
    return fail("takes no operands and one result");
  out.steps.push_back(MemsetCall{rs(0), res[0].bytes()});
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerBiasAdd() {
  if (auto e = arity(2, 2, 1, 1))
    return e;
  int64_t n = ops[0].numElements(), nb = ops[1].numElements();
  if (nb == 0 || n % nb || res[0].numElements() != n)
    return fail("bias must be a suffix of the input shape");
  launch1d("bias_add", {ops[0].dtype, ops[1].dtype, res[0].dtype}, n,
           {B(op(0)), B(op(1)), B(rs(0)), U(n), Q(nb)});
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerBiasAddGrad() {
  if (auto e = arity(1, 1, 1, 1))
    return e;
  int64_t n = ops[0].numElements(), nb = res[0].numElements();
  if (nb == 0 || n % nb)
    return fail("bias must be a suffix of the gradient shape");
  colsum(op(0), ops[0].dtype, std::nullopt, ops[0].dtype, std::nullopt, 0, 1,
         n / nb, nb, rs(0), res[0].dtype);
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerTimestepEmbedding() {
  if (auto e = arity(1, 1, 1, 1))
    return e;
  int64_t Bn = ops[0].numElements();
  int64_t width = Bn ? res[0].numElements() / Bn : 0;
  if (width == 0 || width % 2 || res[0].numElements() != Bn * width)
    return fail("needs an even embedding width");
  fits(Bn * width);
  launch1d("timestep_embedding", {ops[0].dtype, res[0].dtype}, Bn * width / 2,
           {B(op(0)), B(rs(0)), U(Bn * width / 2), Q(width / 2),
            KernelArg::f64(std::log(floatAttr("max_period", 10000.0))),
            KernelArg::f64(floatAttr("time_scale", 1.0))});
  return llvm::Error::success();
}

llvm::Error Lowerer::lowerFlowInterpolate() {
  if (auto e = arity(3, 3, 1, 1))
    return e;
  int64_t n = ops[0].numElements(), Bn = ops[2].numElements();
  if (Bn == 0 || n % Bn || ops[1].numElements() != n ||
      res[0].numElements() != n)
    return fail("latents, noise and timesteps shapes disagree");
  launch1d("flow_interpolate",
           {ops[0].dtype, ops[1].dtype, ops[2].dtype, res[0].dtype}, n,
           {B(op(0)), B(op(1)), B(op(2)), B(rs(0)), U(n), Q(n / Bn)});
  return llvm::Error::success();
}

const exec::OpTable<Lowerer::LowerFn> &Lowerer::lowerings() {
  static const exec::OpTable<LowerFn> table = [] {
    exec::OpTable<LowerFn> t;
    t[OpCode::Add] = [](Lowerer &l) { return l.lowerElementwise(2); };
    t[OpCode::Attention] = [](Lowerer &l) { return l.lowerAttention(); };
    t[OpCode::AttentionGrad] = [](Lowerer &l) {
      return l.lowerAttentionGrad();
    };
    t[OpCode::BiasAdd] = [](Lowerer &l) { return l.lowerBiasAdd(); };
    t[OpCode::BiasAddGrad] = [](Lowerer &l) { return l.lowerBiasAddGrad(); };
    t[OpCode::Cast] = [](Lowerer &l) { return l.lowerElementwise(1); };
    t[OpCode::Concat] = [](Lowerer &l) { return l.lowerSplitConcat(false); };
    t[OpCode::Embedding] = [](Lowerer &l) { return l.lowerEmbedding(false); };
    t[OpCode::EmbeddingGrad] = [](Lowerer &l) {
      return l.lowerEmbedding(true);
    };
    t[OpCode::FlowInterpolate] = [](Lowerer &l) {
      return l.lowerFlowInterpolate();
    };
    t[OpCode::FlowMatchingLoss] = [](Lowerer &l) {
      return l.lowerFlowLoss(false);
    };
    t[OpCode::FlowMatchingLossGrad] = [](Lowerer &l) {
      return l.lowerFlowLoss(true);
    };
    t[OpCode::Gate] = [](Lowerer &l) { return l.lowerModulateLike(true); };
    t[OpCode::GateGrad] = [](Lowerer &l) { return l.lowerModulateGrad(true); };
    t[OpCode::Gelu] = [](Lowerer &l) { return l.lowerElementwise(1); };
    t[OpCode::GeluGrad] = [](Lowerer &l) { return l.lowerElementwise(2); };
    t[OpCode::LayerNorm] = [](Lowerer &l) { return l.lowerNorm(false); };
    t[OpCode::LayerNormGrad] = [](Lowerer &l) {
      return l.lowerNormGrad(false);
    };
    t[OpCode::Linear] = [](Lowerer &l) { return l.lowerLinear(); };
    t[OpCode::LinearGradData] = [](Lowerer &l) { return l.lowerLinear(); };
    t[OpCode::LinearGradParams] = [](Lowerer &l) { return l.lowerLinear(); };
    t[OpCode::Modulate] = [](Lowerer &l) { return l.lowerModulateLike(false); };
    t[OpCode::ModulateGrad] = [](Lowerer &l) {
      return l.lowerModulateGrad(false);
    };
    t[OpCode::PatchEmbed] = [](Lowerer &l) { return l.lowerPatchEmbed(false); };
    t[OpCode::PatchEmbedGrad] = [](Lowerer &l) {
      return l.lowerPatchEmbed(true);
    };
    t[OpCode::Patchify] = [](Lowerer &l) { return l.lowerPatchify(false); };
    t[OpCode::Reshape] = [](Lowerer &l) { return l.lowerReshape(); };
    t[OpCode::RMSNorm] = [](Lowerer &l) { return l.lowerNorm(true); };
    t[OpCode::RMSNormGrad] = [](Lowerer &l) { return l.lowerNormGrad(true); };
    t[OpCode::Rope3d] = [](Lowerer &l) { return l.lowerRope(); };
    t[OpCode::Silu] = [](Lowerer &l) { return l.lowerElementwise(1); };
    t[OpCode::SiluGrad] = [](Lowerer &l) { return l.lowerElementwise(2); };
    t[OpCode::Split] = [](Lowerer &l) { return l.lowerSplitConcat(true); };
    t[OpCode::TimestepEmbedding] = [](Lowerer &l) {
      return l.lowerTimestepEmbedding();
    };
    t[OpCode::Unpatchify] = [](Lowerer &l) { return l.lowerPatchify(true); };
    t[OpCode::Zeros] = [](Lowerer &l) { return l.lowerZeros(); };
    return t;
  }();
  return table;
}

llvm::Expected<LoweredOp> Lowerer::run() {
  LowerFn lower = lowerings()[inst.op];
  if (!lower)
    return fail("no cuda lowering");
  if (llvm::Error e = lower(*this))
    return std::move(e);
  if (tooLarge)
    return fail(llvm::formatv(
        "{0} elements in one kernel launch; the elementwise kernels index "
        "with 32 bits and take at most {1}",
        tooLarge, kMaxKernelElements));
  return std::move(out);
}

} // namespace

bool hasGraphOpLowering(exec::OpCode op) {
  return Lowerer::lowerings()[op] != nullptr;
}

llvm::Expected<LoweredOp> lowerGraphOp(const exec::Instruction &inst,
                                       llvm::ArrayRef<TensorType> operands,
                                       llvm::ArrayRef<TensorType> results) {
  return Lowerer(inst, operands, results).run();
}

std::vector<KernelInstance> kernelsOf(const LoweredOp &op) {
  std::vector<KernelInstance> kernels;
  for (const LoweredStep &s : op.steps)
    if (auto *l = std::get_if<KernelLaunch>(&s))
      kernels.push_back(l->kernel);
  return kernels;
}

} // namespace megaslide::cuda
