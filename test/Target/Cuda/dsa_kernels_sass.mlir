// REQUIRES: nvrtc, cuobjdump
// RUN: rm -rf %t && mkdir -p %t
// RUN: env MEGASLIDE_KERNEL_CACHE=%t/cache megaslide-translate --emit-dsa-kernels %s -o %t --cubin sm_90a
// RUN: %cuobjdump -sass %t/dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1.cubin | FileCheck %s

// Tests that the sm_90a SASS of the forward and backward kernels runs the
// matrix products on tensor cores (HMMA.16816 with fp32 accumulation on
// bf16), feeds them with ldmatrix (LDSM, transposed for V / K / dO / q as B
// operands), stages keys with cp.async (LDGSTS, zero-fill past the window)
// and accumulates dK/dV with vector fp32 reductions (REDG ... F32x2).

// CHECK-LABEL: Function : dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1_bwd
// CHECK-DAG:   LDGSTS.E.BYPASS.128.ZFILL
// CHECK-DAG:   LDSM.16.M88.4
// CHECK-DAG:   LDSM.16.MT88.4
// CHECK-DAG:   HMMA.16816.F32.BF16
// CHECK-DAG:   REDG.E.ADD.F32x2
// CHECK-LABEL: Function : dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1_fwd
// CHECK-DAG:   LDGSTS.E.BYPASS.128.ZFILL
// CHECK-DAG:   LDSM.16.M88.4
// CHECK-DAG:   LDSM.16.MT88.4
// CHECK-DAG:   HMMA.16816.F32.BF16

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
