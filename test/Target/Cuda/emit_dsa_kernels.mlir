// RUN: megaslide-translate --emit-dsa-kernels --split-input-file %s | FileCheck %s

// Tests that the ops of one 3D-DSA configuration (offsets, forward,
// backward) give one source holding the forward, backward (dQ), dK/dV and
// offset kernels, with the configuration substituted as constants, the
// matrix products on tensor cores (mma.sync m16n8k16, bf16 in, fp32 out)
// and no atomics (dK and dV by key ownership over the inverse tile
// neighbourhood the generator computes).

// CHECK-LABEL: //--- dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1.cu
// CHECK:       // Configuration dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1:
// CHECK-NEXT:  //   grid (T, Y, X)      = (2, 4, 4)  32 tokens
// CHECK-NEXT:  //   window (kt, ky, kx) = (2, 2, 2)  8 keys per query tile
// CHECK-NEXT:  //   tile (tt, ty, tx)   = (1, 2, 2)  4 queries; 2 x 2 x 2 = 8 tiles
// CHECK-NEXT:  //   heads 4, head dim 16, element type bf16, offset radius 1
// CHECK:       //   dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1_fwd
// CHECK-NEXT:  //     grid (tiles 8 x query blocks 1, heads 4, batch B), 32 threads, 2376 bytes dynamic shared memory
// CHECK:       #define DSA_BF16 1
// CHECK-NEXT:  #define DSA_FWD_NAME dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1_fwd
// CHECK-NEXT:  #define DSA_BWD_NAME dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1_bwd
// CHECK-NEXT:  #define DSA_BWD_KEYS_NAME dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1_bwd_keys
// CHECK-NEXT:  #define DSA_OFFSETS_NAME dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1_offsets
// CHECK:       constexpr int T = 2, Y = 4, X = 4;
// CHECK-NEXT:  constexpr int KT = 2, KY = 2, KX = 2;
// CHECK-NEXT:  constexpr int TT = 1, TY = 2, TX = 2;
// CHECK-NEXT:  constexpr int H = 4, D = 16, R = 1;
// CHECK:       constexpr int FWD_WARPS = 1, FWD_KC = 16, FWD_STAGES = 1, FWD_QBLOCKS = 1;
// CHECK-NEXT:  constexpr int FWD_MIN_BLOCKS = 2;
// CHECK-NEXT:  constexpr bool FWD_QREG = true;
// Inverse tile neighbourhood: along t both frames are in every window
// (kt = T); along y (and x) query tile 0 (centre 0) reaches rows [0, 2)
// only, even displaced by -1 or +1 (clamped), query tile 1 (centre 2) rows
// [0, 4): key tile 0 has both as candidates, key tile 1 only tile 1.
// CHECK:       constexpr int BKV_CAND_T = 2, BKV_CAND_Y = 2, BKV_CAND_X = 2;
// CHECK-NEXT:  __device__ const int INV_T[2][2] = {{[{][{]}}0, 1}, {0, 1{{[}][}]}};
// CHECK-NEXT:  __device__ const int INV_Y[2][2] = {{[{][{]}}0, 1}, {1, 1{{[}][}]}};
// CHECK-NEXT:  __device__ const int INV_X[2][2] = {{[{][{]}}0, 1}, {1, 1{{[}][}]}};
// CHECK:       mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
// CHECK:       ldmatrix.sync.aligned.m8n8.x4.shared.b16
// CHECK:       cp.async.cg.shared.global
// CHECK:       extern "C" __global__ void __launch_bounds__(FWD_THREADS, FWD_MIN_BLOCKS){{[[:space:]]+}}DSA_FWD_NAME(
// CHECK-NOT:   atomic{{[A-Z]}}
// CHECK:       extern "C" __global__ void __launch_bounds__(BWD_THREADS, BWD_MIN_BLOCKS){{[[:space:]]+}}DSA_BWD_NAME(
// CHECK-NOT:   atomic{{[A-Z]}}
// CHECK:       extern "C" __global__ void __launch_bounds__(BKV_THREADS, 1){{[[:space:]]+}}DSA_BWD_KEYS_NAME(
// CHECK-NOT:   atomic{{[A-Z]}}
// CHECK:       extern "C" __global__ void __launch_bounds__(OFF_THREADS){{[[:space:]]+}}DSA_OFFSETS_NAME(
// CHECK-NOT:   //--- dsa3d_
func.func @one_config(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x32x4x16xbf16>, %v: tensor<1x32x4x16xbf16>) {
  %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, radius = 1 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x4x2x2x2x2x2xi32>
  %o, %lse = megaslide.dsa3d %q, %k, %v, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %k, %v, %off, %o, %lse, %o {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, scale = 0.25 : f64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>, tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>,
         tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
  return
}

// -----

// Tests that configurations are deduplicated and sorted: two layers of the
// same geometry share one source, a different tile gives a second one, and
// an attention op whose offsets come from outside (a function argument)
// with no estimator of its geometry gets radius 0.

// CHECK-LABEL: //--- dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r0.cu
// CHECK:       constexpr int TT = 1, TY = 2, TX = 2;
// CHECK-LABEL: //--- dsa3d_g2x4x4_w2x2x2_t2x2x2_h4_d16_bf16_r2.cu
// CHECK:       constexpr int TT = 2, TY = 2, TX = 2;
// CHECK:       constexpr int H = 4, D = 16, R = 2;
// CHECK-NOT:   //--- dsa3d_
func.func @dedup(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x32x4x16xbf16>, %v: tensor<1x32x4x16xbf16>,
                 %ext: tensor<1x4x2x2x2x2x2xi32>) {
  %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 2, 2, 2>, radius = 2 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x4x1x2x2x2x2xi32>
  %o1, %lse1 = megaslide.dsa3d %q, %k, %v, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 2, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x1x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  %o2, %lse2 = megaslide.dsa3d %o1, %k, %v, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 2, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x1x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  %o3, %lse3 = megaslide.dsa3d %q, %k, %v, %ext {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  return
}

// -----

// Tests the 105B video DiT configuration (720p, 21 latent frames): 630
// tiles of 120 queries (8 warps, one CTA each), 3240-key windows streamed
// in 64-key chunks through two shared-memory stages, two forward CTAs per
// SM requested from ptxas (Q reloaded per chunk there: in registers it
// would spill), lse as the forward's output and the backward's input, the
// backward's Delta scratch, and the dK/dV kernel's inverse tile
// neighbourhood for R = 4: 4 x 5 x 5 candidate query tiles at most.

// CHECK-LABEL: //--- dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4.cu
// CHECK:       //   grid (T, Y, X)      = (21, 45, 80)  75600 tokens
// CHECK-NEXT:  //   window (kt, ky, kx) = (9, 15, 24)  3240 keys per query tile
// CHECK-NEXT:  //   tile (tt, ty, tx)   = (3, 5, 8)  120 queries; 7 x 9 x 10 = 630 tiles
// CHECK-NEXT:  //   heads 96, head dim 128, element type bf16, offset radius 4
// CHECK:       // sum exp(scale q.k): written by the forward (megaslide.dsa3d's second result),
// CHECK-NEXT:  // read by the backward (megaslide.dsa3d_grad's lse operand); delta fp32
// CHECK-NEXT:  // [B, H, N], rowsum(dO * O): scratch written by the backward, read by the
// CHECK-NEXT:  // dK/dV kernel (launched after it).
// CHECK:       //   dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4_fwd
// CHECK-NEXT:  //     grid (tiles 630 x query blocks 1, heads 96, batch B), 256 threads, 104996 bytes dynamic shared memory
// CHECK-NEXT:  //   dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4_bwd
// CHECK-NEXT:  //     grid (tiles 630 x query blocks 1, heads 96, batch B), 256 threads, 140836 bytes dynamic shared memory
// CHECK-NEXT:  //   dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4_bwd_keys
// CHECK-NEXT:  //     grid (key tiles 630 x key blocks 1, heads 96, batch B); after the backward (reads its delta), 256 threads, 212412 bytes dynamic shared memory
// CHECK-NEXT:  //   dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4_offsets
// CHECK-NEXT:  //     grid (tiles 630, heads 96, batch B), 256 threads, 0 bytes dynamic shared memory
// CHECK:       constexpr int T = 21, Y = 45, X = 80;
// CHECK-NEXT:  constexpr int KT = 9, KY = 15, KX = 24;
// CHECK-NEXT:  constexpr int TT = 3, TY = 5, TX = 8;
// CHECK-NEXT:  constexpr int H = 96, D = 128, R = 4;
// CHECK:       constexpr int FWD_WARPS = 8, FWD_KC = 64, FWD_STAGES = 2, FWD_QBLOCKS = 1;
// CHECK-NEXT:  constexpr int FWD_MIN_BLOCKS = 2;
// CHECK-NEXT:  constexpr bool FWD_QREG = false;
// CHECK-NEXT:  constexpr int BWD_WARPS = 8, BWD_KC = 64, BWD_STAGES = 2, BWD_QBLOCKS = 1;
// CHECK-NEXT:  constexpr int BWD_MIN_BLOCKS = 1;
// CHECK-NEXT:  constexpr int BKV_WARPS = 8, BKV_QC = 128, BKV_STAGES = 2, BKV_KBLOCKS = 1;
// CHECK:       constexpr int BKV_CAND_T = 4, BKV_CAND_Y = 5, BKV_CAND_X = 5;
// CHECK-NEXT:  __device__ const int INV_T[7][2] = {{[{][{]}}0, 1}, {0, 2}, {0, 3}, {2, 4}, {3, 6}, {4, 6}, {5, 6{{[}][}]}};
// CHECK-NEXT:  __device__ const int INV_Y[9][2] = {{[{][{]}}0, 2}, {0, 3}, {0, 4}, {1, 5}, {2, 6}, {3, 7}, {4, 8}, {5, 8}, {6, 8{{[}][}]}};
// CHECK-NEXT:  __device__ const int INV_X[10][2] = {{[{][{]}}0, 2}, {0, 3}, {0, 4}, {1, 5}, {2, 6}, {3, 7}, {4, 8}, {5, 9}, {6, 9}, {7, 9{{[}][}]}};
func.func @video_105b(%q: tensor<1x75600x96x128xbf16>, %k: tensor<1x75600x96x128xbf16>, %v: tensor<1x75600x96x128xbf16>) {
  %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 21, 45, 80>,
      window = array<i64: 9, 15, 24>, tile = array<i64: 3, 5, 8>, radius = 4 : i64}
      : (tensor<1x75600x96x128xbf16>, tensor<1x75600x96x128xbf16>) -> tensor<1x96x7x9x10x9x2xi32>
  %o, %lse = megaslide.dsa3d %q, %k, %v, %off {grid = array<i64: 21, 45, 80>,
      window = array<i64: 9, 15, 24>, tile = array<i64: 3, 5, 8>}
      : (tensor<1x75600x96x128xbf16>, tensor<1x75600x96x128xbf16>, tensor<1x75600x96x128xbf16>,
         tensor<1x96x7x9x10x9x2xi32>) -> (tensor<1x75600x96x128xbf16>, tensor<1x96x75600xf32>)
  return
}

// -----

// Tests partial border tiles and big tiles: a 5x7x9 grid with 2x3x4 tiles
// (3 x 3 x 3 tiles, the last of each axis partial) in f16, and 8x8x8 tiles
// of 512 queries split into four query blocks of 8 warps.

// CHECK-LABEL: //--- dsa3d_g5x7x9_w3x3x5_t2x3x4_h2_d64_f16_r1.cu
// CHECK:       //   tile (tt, ty, tx)   = (2, 3, 4)  24 queries; 3 x 3 x 3 = 27 tiles
// CHECK:       #define DSA_BF16 0
// CHECK:       constexpr int FWD_WARPS = 2, FWD_KC = 48, FWD_STAGES = 1, FWD_QBLOCKS = 1;
// CHECK:       mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
// CHECK-LABEL: //--- dsa3d_g8x16x16_w4x8x8_t8x8x8_h1_d32_bf16_r0.cu
// CHECK:       constexpr int FWD_WARPS = 8, FWD_KC = 64, FWD_STAGES = 2, FWD_QBLOCKS = 4;
func.func @borders(%q: tensor<1x315x2x64xf16>, %k: tensor<1x315x2x64xf16>,
                   %a: tensor<1x2048x1x32xbf16>, %b: tensor<1x2048x1x32xbf16>) {
  %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 5, 7, 9>,
      window = array<i64: 3, 3, 5>, tile = array<i64: 2, 3, 4>, radius = 1 : i64}
      : (tensor<1x315x2x64xf16>, tensor<1x315x2x64xf16>) -> tensor<1x2x3x3x3x3x2xi32>
  %off2 = megaslide.dsa3d_offsets %a, %b {grid = array<i64: 8, 16, 16>,
      window = array<i64: 4, 8, 8>, tile = array<i64: 8, 8, 8>, radius = 0 : i64}
      : (tensor<1x2048x1x32xbf16>, tensor<1x2048x1x32xbf16>) -> tensor<1x1x1x2x2x4x2xi32>
  return
}
