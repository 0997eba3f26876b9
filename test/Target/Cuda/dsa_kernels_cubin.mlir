// REQUIRES: nvrtc
// RUN: rm -rf %t && mkdir -p %t
// RUN: env MEGASLIDE_KERNEL_CACHE=%t/cache megaslide-translate --emit-dsa-kernels %s -o %t/out --cubin sm_90a | FileCheck %s --check-prefix=TOOL
// RUN: FileCheck %s --check-prefix=TINY --input-file %t/out/dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1.resources.txt
// RUN: FileCheck %s --check-prefix=BIG --input-file %t/out/dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4.resources.txt
// RUN: FileCheck %s --check-prefix=MANIFEST --input-file %t/out/manifest.json
// RUN: env MEGASLIDE_KERNEL_CACHE=%t/cache megaslide-translate --emit-dsa-kernels %s -o %t/out --cubin sm_90a | FileCheck %s --check-prefix=CACHED
// RUN: ls %t/cache | FileCheck %s --check-prefix=CACHE-FILES

// Tests that NVRTC compiles the kernels of a small and of the 105B video
// DiT configuration to sm_90a cubins with no register spills in any kernel,
// that the forward of the 105B configuration fits two CTAs per SM, that the
// manifest names every kernel and sizes the backward's scratch (Delta, fp32
// [B, H, N]; no dK/dV accumulators) apart from lse (a graph tensor:
// dsa3d's second result), and that a second run is served from the
// on-disk kernel cache.

// TOOL:      dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1.cubin: {{[1-9][0-9]*}} bytes{{$}}
// TOOL-NEXT: dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4.cubin: {{[1-9][0-9]*}} bytes{{$}}
// TOOL-NEXT: total spill bytes: 0

// CACHED:      dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1.cubin: {{[0-9]+}} bytes (kernel cache)
// CACHED-NEXT: dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4.cubin: {{[0-9]+}} bytes (kernel cache)
// CACHED-NEXT: total spill bytes: 0

// CACHE-FILES-COUNT-2: {{^[0-9a-f]{16}\.mskc$}}
// CACHE-FILES-NOT: tmp

// TINY:       # compiled by NVRTC {{[0-9]+\.[0-9]+}} for sm_90a
// TINY-LABEL: kernel dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1_fwd (forward)
// TINY:         spill stores:      0 bytes
// TINY-NEXT:    spill loads:       0 bytes
// TINY-NEXT:    threads per block: 32
// TINY-LABEL: kernel dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1_bwd (backward)
// TINY:         spill stores:      0 bytes
// TINY-NEXT:    spill loads:       0 bytes
// TINY-LABEL: kernel dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1_bwd_keys (backward_keys)
// TINY:         spill stores:      0 bytes
// TINY-NEXT:    spill loads:       0 bytes
// TINY-LABEL: kernel dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1_offsets (offsets)
// TINY:         spill stores:      0 bytes
// TINY-NEXT:    spill loads:       0 bytes

// BIG-LABEL: kernel dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4_fwd (forward)
// BIG:         shared memory:     0 bytes static + 104996 bytes dynamic
// BIG-NEXT:    stack frame:       0 bytes
// BIG-NEXT:    spill stores:      0 bytes
// BIG-NEXT:    spill loads:       0 bytes
// BIG-NEXT:    threads per block: 256
// BIG-NEXT:    occupancy:         2 blocks/SM, 16 warps/SM, 25.0%
// BIG-LABEL: kernel dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4_bwd (backward)
// BIG:         shared memory:     0 bytes static + 140836 bytes dynamic
// BIG-NEXT:    stack frame:       0 bytes
// BIG-NEXT:    spill stores:      0 bytes
// BIG-NEXT:    spill loads:       0 bytes
// BIG-NEXT:    threads per block: 256
// BIG-NEXT:    occupancy:         1 blocks/SM, 8 warps/SM, 12.5%
// BIG-LABEL: kernel dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4_bwd_keys (backward_keys)
// BIG:         shared memory:     0 bytes static + 212412 bytes dynamic
// BIG-NEXT:    stack frame:       0 bytes
// BIG-NEXT:    spill stores:      0 bytes
// BIG-NEXT:    spill loads:       0 bytes
// BIG-NEXT:    threads per block: 256
// BIG-NEXT:    occupancy:         1 blocks/SM, 8 warps/SM, 12.5%
// BIG-LABEL: kernel dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4_offsets (offsets)
// BIG:         spill stores:      0 bytes
// BIG-NEXT:    spill loads:       0 bytes

// MANIFEST:      "lse": "forward output (dsa3d's second result), backward input (dsa3d_grad's lse operand)",
// MANIFEST:      "name": "dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1",
// MANIFEST:      "name": "dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4",
// MANIFEST-NEXT: "source": "dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4.cu",
// Per sample: lse = delta = H * N * 4 = 96 * 75600 * 4.
// MANIFEST:      "lse_bytes_per_sample": 29030400,
// MANIFEST-NEXT: "workspace_bytes_per_sample": {
// MANIFEST-NEXT:   "delta": 29030400
// MANIFEST-NEXT: },
// MANIFEST:      "kind": "forward",
// MANIFEST-NEXT: "name": "dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4_fwd",
// MANIFEST-NEXT: "grid_formula": "(tiles 630 x query blocks 1, heads 96, batch B)",
// MANIFEST:      "dynamic_shared_bytes": 104996,
// MANIFEST:      "kind": "backward",
// MANIFEST:      "kind": "backward_keys",
// MANIFEST:      "kind": "offsets",

func.func @tiny(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x32x4x16xbf16>, %v: tensor<1x32x4x16xbf16>) {
  %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, radius = 1 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x4x2x2x2x2x2xi32>
  %o, %lse = megaslide.dsa3d %q, %k, %v, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  return
}

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
