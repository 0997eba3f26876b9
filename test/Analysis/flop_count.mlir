// RUN: megaslide-opt %s --split-input-file --test-megaslide-flop-count --verify-diagnostics

// Pins the FLOP formulas of GraphFlops.cpp: one remark per counted op,
// "matmul M attention A other O", with " backward" on backward ops. A
// multiply-add is 2 FLOPs. Forward remarks are anchored with {{$}} so that
// a missing " backward" or an extra digit fails.

// Tests that linear counts 2 * numel(y) * in matmul FLOPs plus one add per
// output element for the bias, and that its two gradients cost the same
// matmul FLOPs each.
//
// x [2, 32, 64], W [256, 64]: numel(y) = 2 * 32 * 256 = 16384.
//   matmul = 2 * 16384 * 64 = 2097152; bias = 16384.

func.func @linear(%x: tensor<2x32x64xbf16>, %w: tensor<256x64xbf16>, %b: tensor<256xbf16>) {
  // expected-remark-re @below {{matmul 2097152 attention 0 other 16384{{$}}}}
  %y = megaslide.linear %x, %w, %b
      : (tensor<2x32x64xbf16>, tensor<256x64xbf16>, tensor<256xbf16>) -> tensor<2x32x256xbf16>
  // expected-remark-re @below {{matmul 2097152 attention 0 other 0{{$}}}}
  %y2 = megaslide.linear %x, %w : (tensor<2x32x64xbf16>, tensor<256x64xbf16>) -> tensor<2x32x256xbf16>
  // dx = dy W: 2 * numel(dy) * in = 2 * 16384 * 64 = 2097152.
  // expected-remark @below {{matmul 2097152 attention 0 other 0 backward}}
  %dx = megaslide.linear_grad_data %y, %w
      : (tensor<2x32x256xbf16>, tensor<256x64xbf16>) -> tensor<2x32x64xbf16>
  // dW = dy^T x: 2 * numel(dy) * in = 2097152; db = sum(dy): 16384 adds.
  // expected-remark @below {{matmul 2097152 attention 0 other 16384 backward}}
  %dw, %db = megaslide.linear_grad_params %x, %y
      : (tensor<2x32x64xbf16>, tensor<2x32x256xbf16>) -> (tensor<256x64xbf16>, tensor<256xbf16>)
  // expected-remark @below {{matmul 2097152 attention 0 other 0 backward}}
  %dw2 = megaslide.linear_grad_params %x, %y2
      : (tensor<2x32x64xbf16>, tensor<2x32x256xbf16>) -> tensor<256x64xbf16>
  return
}

// -----

// Tests that linear over a 2-D input counts the same way.
//
// x [3, 1152], W [6912, 1152] (DiT-XL adaLN): numel(y) = 3 * 6912 = 20736.
//   matmul = 2 * 20736 * 1152 = 47775744; bias = 20736.

func.func @linear_2d(%x: tensor<3x1152xbf16>, %w: tensor<6912x1152xbf16>, %b: tensor<6912xbf16>) {
  // expected-remark-re @below {{matmul 47775744 attention 0 other 20736{{$}}}}
  %y = megaslide.linear %x, %w, %b
      : (tensor<3x1152xbf16>, tensor<6912x1152xbf16>, tensor<6912xbf16>) -> tensor<3x6912xbf16>
  return
}

// -----

// Tests that global attention counts 2 matmuls forward (QK^T and PV),
// 4 * B * Nq * Nk * H * Dh, and 5 backward (S recomputed, dV, dP, dQ, dK),
// 10 * B * Nq * Nk * H * Dh.
//
// Cross-attention, q [2, 32, 4, 16], k/v [2, 8, 4, 16]:
//   forward  = 4 * 2 * 32 * 8 * 4 * 16 = 131072
//   backward = 10 * 2 * 32 * 8 * 4 * 16 = 327680

func.func @attention(%q: tensor<2x32x4x16xbf16>, %k: tensor<2x8x4x16xbf16>) {
  // expected-remark-re @below {{matmul 0 attention 131072 other 0{{$}}}}
  %o = megaslide.attention %q, %k, %k
      : (tensor<2x32x4x16xbf16>, tensor<2x8x4x16xbf16>, tensor<2x8x4x16xbf16>) -> tensor<2x32x4x16xbf16>
  // expected-remark @below {{matmul 0 attention 327680 other 0 backward}}
  %dq, %dk, %dv = megaslide.attention_grad %q, %k, %k, %o, %o
      : (tensor<2x32x4x16xbf16>, tensor<2x8x4x16xbf16>, tensor<2x8x4x16xbf16>,
         tensor<2x32x4x16xbf16>, tensor<2x32x4x16xbf16>)
        -> (tensor<2x32x4x16xbf16>, tensor<2x8x4x16xbf16>, tensor<2x8x4x16xbf16>)
  return
}

// -----

// Tests that self-attention is quadratic in the tokens.
//
// q = k = v [1, 32, 4, 16]:
//   forward  = 4 * 1 * 32 * 32 * 4 * 16 = 262144
//   backward = 10 * 1 * 32 * 32 * 4 * 16 = 655360

func.func @self_attention(%q: tensor<1x32x4x16xbf16>) {
  // expected-remark-re @below {{matmul 0 attention 262144 other 0{{$}}}}
  %o = megaslide.attention %q, %q, %q
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  // expected-remark @below {{matmul 0 attention 655360 other 0 backward}}
  %dq, %dk, %dv = megaslide.attention_grad %q, %q, %q, %o, %o
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
  return
}

// -----

// Tests that 3D-DSA counts every query against the window volume
// kt * ky * kx instead of all tokens, and that the offset search counts
// pooling, prefix sums and the per-candidate box sums and dot products.
//
// q = k = v [1, 32, 4, 16] over grid (2, 4, 4), window (2, 2, 2) = 8 keys:
//   forward  = 4 * 1 * 32 * 8 * 4 * 16 = 65536   (1/4 of the 262144 above)
//   backward = 10 * 1 * 32 * 8 * 4 * 16 = 163840
// Offsets, tile (1, 2, 2) -> tiles 2 * 2 * 2 = 8, radius 1 -> 3 * 3 = 9
// candidates, B * H = 4, Dh = 16, kt = 2:
//   3 * numel(q) + B*H * tiles * kt * candidates * 5 * Dh
//   = 3 * 2048 + 4 * 8 * 2 * 9 * 5 * 16 = 6144 + 46080 = 52224

func.func @dsa3d(%q: tensor<1x32x4x16xbf16>) {
  // expected-remark-re @below {{matmul 0 attention 52224 other 0{{$}}}}
  %off = megaslide.dsa3d_offsets %q, %q {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, radius = 1 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x4x2x2x2x2x2xi32>
  // expected-remark-re @below {{matmul 0 attention 65536 other 0{{$}}}}
  %o, %lse = megaslide.dsa3d %q, %q, %q, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  // expected-remark @below {{matmul 0 attention 163840 other 0 backward}}
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %q, %q, %off, %o, %lse, %o {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>, tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>,
         tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
  return
}

// -----

// Tests that the 3D-DSA offset search counts partial tiles and a radius of
// zero (a single candidate).
//
// q [2, 48, 2, 8] over grid (3, 4, 4), tile (2, 4, 4), window (2, 2, 2):
//   tiles = ceil(3/2) * 1 * 1 = 2, candidates = 1, B * H = 4, Dh = 8
//   3 * 1536 + 4 * 2 * 2 * 1 * 5 * 8 = 4608 + 640 = 5248

func.func @dsa3d_offsets_partial(%q: tensor<2x48x2x8xbf16>) {
  // expected-remark-re @below {{matmul 0 attention 5248 other 0{{$}}}}
  %off = megaslide.dsa3d_offsets %q, %q {grid = array<i64: 3, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 2, 4, 4>, radius = 0 : i64}
      : (tensor<2x48x2x8xbf16>, tensor<2x48x2x8xbf16>) -> tensor<2x2x2x1x1x2x2xi32>
  return
}

// -----

// Tests the per-element constants of the norms: layer_norm 7 (+2 affine),
// layer_norm_grad 11 (+4 affine), rms_norm 4 (+1 gamma), rms_norm_grad 8
// (+2 gamma), all times numel(x).
//
// x [2, 32, 64]: numel = 4096.

func.func @norms(%x: tensor<2x32x64xbf16>, %g: tensor<64xbf16>) {
  // 7 * 4096 = 28672
  // expected-remark-re @below {{matmul 0 attention 0 other 28672{{$}}}}
  %y = megaslide.layer_norm %x : (tensor<2x32x64xbf16>) -> tensor<2x32x64xbf16>
  // (7 + 2) * 4096 = 36864
  // expected-remark-re @below {{matmul 0 attention 0 other 36864{{$}}}}
  %z = megaslide.layer_norm %x, %g, %g
      : (tensor<2x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>) -> tensor<2x32x64xbf16>
  // 11 * 4096 = 45056
  // expected-remark @below {{matmul 0 attention 0 other 45056 backward}}
  %dx = megaslide.layer_norm_grad %x, %y : (tensor<2x32x64xbf16>, tensor<2x32x64xbf16>) -> tensor<2x32x64xbf16>
  // (11 + 2 * 2) * 4096 = 61440
  // expected-remark @below {{matmul 0 attention 0 other 61440 backward}}
  %dx2, %dg, %db = megaslide.layer_norm_grad %x, %z, %g, %g
      : (tensor<2x32x64xbf16>, tensor<2x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>)
        -> (tensor<2x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>)
  // 4 * 4096 = 16384
  // expected-remark-re @below {{matmul 0 attention 0 other 16384{{$}}}}
  %r = megaslide.rms_norm %x : (tensor<2x32x64xbf16>) -> tensor<2x32x64xbf16>
  // (4 + 1) * 4096 = 20480
  // expected-remark-re @below {{matmul 0 attention 0 other 20480{{$}}}}
  %rg = megaslide.rms_norm %x, %g : (tensor<2x32x64xbf16>, tensor<64xbf16>) -> tensor<2x32x64xbf16>
  // 8 * 4096 = 32768
  // expected-remark @below {{matmul 0 attention 0 other 32768 backward}}
  %dr = megaslide.rms_norm_grad %x, %r : (tensor<2x32x64xbf16>, tensor<2x32x64xbf16>) -> tensor<2x32x64xbf16>
  // (8 + 2) * 4096 = 40960
  // expected-remark @below {{matmul 0 attention 0 other 40960 backward}}
  %dr2, %dg2 = megaslide.rms_norm_grad %x, %rg, %g
      : (tensor<2x32x64xbf16>, tensor<2x32x64xbf16>, tensor<64xbf16>) -> (tensor<2x32x64xbf16>, tensor<64xbf16>)
  return
}

// -----

// Tests the per-element constants of adaLN and the elementwise ops:
// modulate 3, modulate_grad 5, gate 1, gate_grad 4, gelu 9, gelu_grad 15,
// silu 4, silu_grad 6, add / bias_add / bias_add_grad 1, rope3d 3.
//
// x [1, 32, 64] and q [1, 32, 4, 16]: numel = 2048 each.

func.func @elementwise(%x: tensor<1x32x64xbf16>, %v: tensor<1x64xbf16>, %b: tensor<64xbf16>,
                       %q: tensor<1x32x4x16xbf16>) {
  // 3 * 2048 = 6144
  // expected-remark-re @below {{matmul 0 attention 0 other 6144{{$}}}}
  %m = megaslide.modulate %x, %v, %v
      : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x64xbf16>) -> tensor<1x32x64xbf16>
  // 5 * 2048 = 10240
  // expected-remark @below {{matmul 0 attention 0 other 10240 backward}}
  %dm:3 = megaslide.modulate_grad %x, %v, %m
      : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>)
        -> (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x64xbf16>)
  // 1 * 2048 = 2048
  // expected-remark-re @below {{matmul 0 attention 0 other 2048{{$}}}}
  %g = megaslide.gate %x, %v : (tensor<1x32x64xbf16>, tensor<1x64xbf16>) -> tensor<1x32x64xbf16>
  // 4 * 2048 = 8192
  // expected-remark @below {{matmul 0 attention 0 other 8192 backward}}
  %dg:2 = megaslide.gate_grad %x, %v, %g
      : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>) -> (tensor<1x32x64xbf16>, tensor<1x64xbf16>)
  // 9 * 2048 = 18432
  // expected-remark-re @below {{matmul 0 attention 0 other 18432{{$}}}}
  %ge = megaslide.gelu %x : tensor<1x32x64xbf16>
  // 15 * 2048 = 30720
  // expected-remark @below {{matmul 0 attention 0 other 30720 backward}}
  %dge = megaslide.gelu_grad %x, %ge : tensor<1x32x64xbf16>
  // 4 * 2048 = 8192
  // expected-remark-re @below {{matmul 0 attention 0 other 8192{{$}}}}
  %s = megaslide.silu %x : tensor<1x32x64xbf16>
  // 6 * 2048 = 12288
  // expected-remark @below {{matmul 0 attention 0 other 12288 backward}}
  %ds = megaslide.silu_grad %x, %s : tensor<1x32x64xbf16>
  // expected-remark-re @below {{matmul 0 attention 0 other 2048{{$}}}}
  %a = megaslide.add %x, %s : tensor<1x32x64xbf16>
  // expected-remark-re @below {{matmul 0 attention 0 other 2048{{$}}}}
  %ba = megaslide.bias_add %x, %b : (tensor<1x32x64xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  // One add per element of the gradient being reduced: 2048.
  // expected-remark @below {{matmul 0 attention 0 other 2048 backward}}
  %dba = megaslide.bias_add_grad %ba : tensor<1x32x64xbf16> -> tensor<64xbf16>
  // 3 * 2048 = 6144, the same forward and inverse.
  // expected-remark-re @below {{matmul 0 attention 0 other 6144{{$}}}}
  %r = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>} : tensor<1x32x4x16xbf16>
  // expected-remark-re @below {{matmul 0 attention 0 other 6144{{$}}}}
  %ri = megaslide.rope3d %r {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>, inverse} : tensor<1x32x4x16xbf16>
  return
}

// -----

// Tests that patch_embed counts a GEMM over patches, 2 * numel(tokens) *
// (C * pt * ph * pw), plus the bias, and that its gradient costs the same;
// that structural ops (cast, reshape, unpatchify, patchify) count nothing.
//
// x [1, 16, 2, 8, 8], W [64, 16, 1, 2, 2] -> patch size 16 * 1 * 2 * 2 = 64,
// tokens [1, 32, 64] -> numel 2048: matmul = 2 * 2048 * 64 = 262144,
// bias = 2048.

func.func @patch_embed(%x: tensor<1x16x2x8x8xbf16>, %w: tensor<64x16x1x2x2xf32>, %b: tensor<64xbf16>) {
  %w16 = megaslide.cast %w : tensor<64x16x1x2x2xf32> -> tensor<64x16x1x2x2xbf16>
  // expected-remark-re @below {{matmul 262144 attention 0 other 2048{{$}}}}
  %t = megaslide.patch_embed %x, %w16, %b
      : (tensor<1x16x2x8x8xbf16>, tensor<64x16x1x2x2xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  // expected-remark @below {{matmul 262144 attention 0 other 2048 backward}}
  %dw, %db = megaslide.patch_embed_grad %x, %t
      : (tensor<1x16x2x8x8xbf16>, tensor<1x32x64xbf16>) -> (tensor<64x16x1x2x2xbf16>, tensor<64xbf16>)
  %y = megaslide.unpatchify %t {grid = array<i64: 2, 4, 4>, patch = array<i64: 1, 2, 2>}
      : tensor<1x32x64xbf16> -> tensor<1x16x2x8x8xbf16>
  %t2 = megaslide.patchify %y {patch = array<i64: 1, 2, 2>} : tensor<1x16x2x8x8xbf16> -> tensor<1x32x64xbf16>
  %r = megaslide.reshape %t2 : tensor<1x32x64xbf16> -> tensor<32x64xbf16>
  return
}

// -----

// Tests the conditioning embeddings: timestep_embedding 3 per output
// element, embedding (a gather) 0, embedding_grad 1 add per row-gradient
// element.
//
// timesteps [2] -> [2, 256]: 3 * 512 = 1536. ids [2], table [1001, 64]:
// row gradients [2, 64] -> 128.

func.func @conditioning(%t: tensor<2xf32>, %ids: tensor<2xi64>, %table: tensor<1001x64xbf16>) {
  // expected-remark-re @below {{matmul 0 attention 0 other 1536{{$}}}}
  %e = megaslide.timestep_embedding %t : tensor<2xf32> -> tensor<2x256xbf16>
  // expected-remark-re @below {{matmul 0 attention 0 other 0{{$}}}}
  %rows = megaslide.embedding %ids, %table : (tensor<2xi64>, tensor<1001x64xbf16>) -> tensor<2x64xbf16>
  // expected-remark @below {{matmul 0 attention 0 other 128 backward}}
  %dt = megaslide.embedding_grad %ids, %rows : (tensor<2xi64>, tensor<2x64xbf16>) -> tensor<1001x64xbf16>
  return
}

// -----

// Tests that flow matching counts 3 per latent element (interpolation,
// loss and its gradient, the latter on the latents even when the prediction
// has extra channels) and AdamW 14 per parameter element.
//
// latents [1, 16, 2, 8, 8]: numel 2048 -> 3 * 2048 = 6144.
// param [64, 64]: 14 * 4096 = 57344.

megaslide.param master head @w : tensor<64x64xf32>
megaslide.param moment head @w.exp_avg of @w : tensor<64x64xf32>
megaslide.param moment head @w.exp_avg_sq of @w : tensor<64x64xf32>

func.func @flow_and_adamw(%x0: tensor<1x16x2x8x8xbf16>, %t: tensor<1xf32>, %pred: tensor<1x32x2x8x8xbf16>,
                          %g: tensor<64x64xbf16>, %step: tensor<i64>) -> tensor<f32> {
  // expected-remark-re @below {{matmul 0 attention 0 other 6144{{$}}}}
  %xt = megaslide.flow_interpolate %x0, %x0, %t
      : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1xf32>) -> tensor<1x16x2x8x8xbf16>
  // expected-remark-re @below {{matmul 0 attention 0 other 6144{{$}}}}
  %loss = megaslide.flow_matching_loss %pred, %x0, %xt
      : (tensor<1x32x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<f32>
  // expected-remark @below {{matmul 0 attention 0 other 6144 backward}}
  %dp = megaslide.flow_matching_loss_grad %pred, %x0, %xt
      : (tensor<1x32x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<1x32x2x8x8xbf16>
  %p = megaslide.load @w : tensor<64x64xf32>
  %m = megaslide.load @w.exp_avg : tensor<64x64xf32>
  %v = megaslide.load @w.exp_avg_sq : tensor<64x64xf32>
  // expected-remark-re @below {{matmul 0 attention 0 other 57344{{$}}}}
  %p1, %m1, %v1 = megaslide.adamw %p, %g, %m, %v, %step
      : tensor<64x64xf32>, tensor<64x64xbf16>, tensor<64x64xf32>, tensor<64x64xf32>, tensor<i64>
  return %loss : tensor<f32>
}
