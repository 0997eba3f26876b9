// RUN: megaslide-translate --emit-dsa-kernels --split-input-file --verify-diagnostics %s

// Tests that a head dim that is not a multiple of 16 (the mma k-step) is
// rejected on the op that uses it.

func.func @head_dim_24(%q: tensor<1x32x4x24xbf16>, %k: tensor<1x32x4x24xbf16>) {
  // expected-error @+1 {{head dim 24 is not supported by the 3D-DSA CUDA kernels: it must be a multiple of 16 in [16, 256]}}
  %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, radius = 1 : i64}
      : (tensor<1x32x4x24xbf16>, tensor<1x32x4x24xbf16>) -> tensor<1x4x2x2x2x2x2xi32>
  return
}

// -----

// Tests that head dims above 256 are rejected (registers and shared memory
// of one warp's 16 query rows).

func.func @head_dim_272(%q: tensor<1x32x4x272xbf16>, %k: tensor<1x32x4x272xbf16>) {
  // expected-error @+1 {{head dim 272 is not supported}}
  %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, radius = 1 : i64}
      : (tensor<1x32x4x272xbf16>, tensor<1x32x4x272xbf16>) -> tensor<1x4x2x2x2x2x2xi32>
  return
}

// -----

// Tests that fp32 operands are rejected: the kernels use 16-bit mma.

func.func @f32(%q: tensor<1x32x4x16xf32>, %k: tensor<1x32x4x16xf32>, %v: tensor<1x32x4x16xf32>,
               %off: tensor<1x4x2x2x2x2x2xi32>) {
  // expected-error @+1 {{3D-DSA CUDA kernels take bf16 or f16 q/k/v (tensor-core mma), got f32}}
  %o, %lse = megaslide.dsa3d %q, %k, %v, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xf32>, tensor<1x32x4x16xf32>, tensor<1x32x4x16xf32>,
         tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xf32>, tensor<1x4x32xf32>)
  return
}
