//===- Dsa3d.h - 3D Deformable Slide Attention on the CPU -------*- C++ -*-===//
//
// Reference CPU kernels of 3D-DSA (docs/Dsa3d.md, "Definition"): forward,
// flash-style backward and block-matching offset estimation. No MLIR: the runtime's CPU backend and the Python module call
// these directly on host buffers.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_DSA3D_H
#define MEGASLIDE_RUNTIME_CPU_DSA3D_H

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>

namespace megaslide::cpu {

/// Shapes and window geometry of one 3D-DSA call. Tokens form the grid
/// T x Y x X, flattened row-major: n = (t * Y + y) * X + x.
struct Dsa3dConfig {
  int64_t batch = 0, heads = 0;
  int64_t T = 0, Y = 0, X = 0;
  int64_t headDim = 0;
  std::array<int64_t, 3> window{}; ///< (kt, ky, kx) keys per query
  std::array<int64_t, 3> tile{};   ///< (tt, ty, tx) queries sharing a window
  double scale = 0;                ///< logits are scale * q.k

  /// Tokens per (batch, head): T * Y * X.
  int64_t tokens() const { return T * Y * X; }
  /// Keys every query attends to: kt * ky * kx.
  int64_t windowSize() const { return window[0] * window[1] * window[2]; }
  /// Query tiles per axis, ceil(extent / tile); border tiles may be partial.
  std::array<int64_t, 3> numTiles() const;
  /// Number of int32 values of the offsets tensor
  /// [B, H, nT, nY, nX, kt, 2].
  int64_t offsetsSize() const;
  /// Empty if the configuration is usable, else a message naming the first
  /// offending field (non-positive sizes, a window larger than the grid, a
  /// scale that is not positive and finite).
  std::string validate() const;
};

/// A rank-4 view (b, h, n, d) of a float tensor whose d axis is
/// contiguous: element (b, h, n, d) lives at
/// data + b * strideB + h * strideH + n * strideN + d. Both the Python
/// layout [B, H, T, Y, X, D] and the graph layout [B, N, H, D] are such
/// views, so the kernels need no transposes.
template <typename Elem> struct Dsa3dView {
  Elem *data = nullptr;
  int64_t strideB = 0, strideH = 0, strideN = 0;

  Dsa3dView() = default;
  Dsa3dView(Elem *data, int64_t strideB, int64_t strideH, int64_t strideN)
      : data(data), strideB(strideB), strideH(strideH), strideN(strideN) {}
  /// A writable view is also a read-only one (out and dq are inputs of
  /// the backward).
  template <typename Other,
            typename = std::enable_if_t<std::is_convertible_v<Other *, Elem *>>>
  Dsa3dView(const Dsa3dView<Other> &other)
      : data(other.data), strideB(other.strideB), strideH(other.strideH),
        strideN(other.strideN) {}

  /// The D contiguous elements of token n of head h in batch b.
  Elem *row(int64_t b, int64_t h, int64_t n) const {
    return data + b * strideB + h * strideH + n * strideN;
  }
};

using Dsa3dInput = Dsa3dView<const float>;
using Dsa3dOutput = Dsa3dView<float>;

/// View of a C-contiguous [B, H, T, Y, X, D] buffer (the Python layout).
template <typename Elem>
Dsa3dView<Elem> dsa3dPythonLayout(Elem *data, const Dsa3dConfig &cfg) {
  int64_t strideN = cfg.headDim, strideH = cfg.tokens() * strideN;
  return {data, cfg.heads * strideH, strideH, strideN};
}

/// View of a C-contiguous [B, N, H, D] buffer (the graph dialect's layout).
template <typename Elem>
Dsa3dView<Elem> dsa3dGraphLayout(Elem *data, const Dsa3dConfig &cfg) {
  int64_t strideH = cfg.headDim, strideN = cfg.heads * strideH;
  return {data, cfg.tokens() * strideN, strideH, strideN};
}

/// out = softmax(scale * q k^T) v over exactly kt * ky * kx keys per query
/// (the tile's clamped, per-key-frame displaced window). Accumulates in
/// fp32 with an online softmax; writes the log-sum-exp of the scaled logits
/// per (b, h, n) into `lse` ([B, H, N], contiguous) for the backward.
/// `offsets` is int32 [B, H, nT, nY, nX, kt, 2] holding (dy, dx).
/// Requires cfg.validate() to be empty. O(N * window * D) time; scratch per
/// thread bounded whatever the window (chunks of keys, Dsa3d.cpp).
void dsa3dForward(const Dsa3dConfig &cfg, Dsa3dInput q, Dsa3dInput k,
                  Dsa3dInput v, const int32_t *offsets, Dsa3dOutput out,
                  float *lse);

/// Gradients of dsa3dForward with respect to q, k and v given the forward's
/// `out` and `lse` and the output gradient `dout` (flash-attention style:
/// probabilities are recomputed from lse, nothing quadratic is stored).
/// dq, dk and dv are overwritten. Offsets carry no gradient. Requires
/// cfg.validate() to be empty. O(N * window * D) time, O(N) scratch per
/// thread.
void dsa3dBackward(const Dsa3dConfig &cfg, Dsa3dInput q, Dsa3dInput k,
                   Dsa3dInput v, const int32_t *offsets, Dsa3dInput out,
                   Dsa3dInput dout, const float *lse, Dsa3dOutput dq,
                   Dsa3dOutput dk, Dsa3dOutput dv);

/// The row sums Delta = rowsum(dO * O) that dsa3dBackward computes first,
/// fp32 [B, H, N] (the layout of lse), bit for bit as it does.
void dsa3dRowDot(const Dsa3dConfig &cfg, Dsa3dInput out, Dsa3dInput dout,
                 float *delta);

/// dsa3dBackward with Delta given (as dsa3dRowDot computes it) instead of
/// `out`: the same gradients bit for bit. The contract of the CUDA dK/dV
/// kernel, which reads the Delta its backward stored.
void dsa3dBackwardFromDelta(const Dsa3dConfig &cfg, Dsa3dInput q, Dsa3dInput k,
                            Dsa3dInput v, const int32_t *offsets,
                            Dsa3dInput dout, const float *lse,
                            const float *delta, Dsa3dOutput dq, Dsa3dOutput dk,
                            Dsa3dOutput dv);

/// Block-matching offset estimation: for each query tile and key frame j,
/// the displacement (dy, dx) in [-radius, radius]^2 maximising the dot
/// product of the mean-pooled query tile and the mean-pooled keys of the
/// displaced, clamped window at frame s_t + j (ties: smallest |dy| + |dx|,
/// then smallest dy, then smallest dx). Writes int32
/// [B, H, nT, nY, nX, kt, 2]. Requires cfg.validate() to be empty and
/// radius >= 0; cfg.scale is not used.
void dsa3dOffsets(const Dsa3dConfig &cfg, Dsa3dInput q, Dsa3dInput k,
                  int64_t radius, int32_t *offsets);

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_DSA3D_H
