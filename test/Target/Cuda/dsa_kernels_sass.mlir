// REQUIRES: nvrtc, cuobjdump
// RUN: rm -rf %t && mkdir -p %t
// RUN: env MEGASLIDE_KERNEL_CACHE=%t/cache megaslide-translate --emit-dsa-kernels %s -o %t --cubin sm_90a
// RUN: %cuobjdump -sass %t/dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1.cubin | FileCheck %s
// RUN: %cuobjdump -sass %t/dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1.cubin | FileCheck %s --check-prefix=NOATOM
// RUN: %cuobjdump -sass %t/dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4.cubin | FileCheck %s --check-prefix=NOATOM

// Tests that the sm_90a SASS of the forward and backward kernels runs the
// matrix products on tensor cores (HMMA.16816 with fp32 accumulation on
// bf16), feeds them with ldmatrix (LDSM, transposed for V / K / dO / q as B
// operands) and stages keys and queries with cp.async (LDGSTS, zero-fill
// past the window or tile); and that, for the tiny and the 105B
// configurations, no kernel but the offsets one touches global memory
// with a reduction or atomic (RED, REDG, ATOM, ATOMG): dQ is written once
// by its query tile, dK and dV once by the key tile that owns them.

// CHECK-LABEL: Function : dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1_bwd_keys
// CHECK-DAG:   LDGSTS.E.BYPASS.128.ZFILL
// CHECK-DAG:   LDSM.16.M88.4
// CHECK-DAG:   LDSM.16.MT88.4
// CHECK-DAG:   HMMA.16816.F32.BF16
// CHECK-LABEL: Function : dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1_bwd
// CHECK-DAG:   LDGSTS.E.BYPASS.128.ZFILL
// CHECK-DAG:   LDSM.16.M88.4
// CHECK-DAG:   LDSM.16.MT88.4
// CHECK-DAG:   HMMA.16816.F32.BF16
// CHECK-LABEL: Function : dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1_fwd
// CHECK-DAG:   LDGSTS.E.BYPASS.128.ZFILL
// CHECK-DAG:   LDSM.16.M88.4
// CHECK-DAG:   LDSM.16.MT88.4
// CHECK-DAG:   HMMA.16816.F32.BF16

// NOATOM-LABEL: Function : {{dsa3d_.*_bwd_keys$}}
// NOATOM-NOT:   {{[[:space:]](RED|REDG|ATOM|ATOMG)\.}}
// NOATOM-LABEL: Function : {{dsa3d_.*_bwd$}}
// NOATOM-NOT:   {{[[:space:]](RED|REDG|ATOM|ATOMG)\.}}
// NOATOM-LABEL: Function : {{dsa3d_.*_fwd$}}
// NOATOM-NOT:   {{[[:space:]](RED|REDG|ATOM|ATOMG)\.}}

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
