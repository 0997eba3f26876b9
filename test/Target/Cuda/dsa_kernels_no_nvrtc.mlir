// RUN: rm -rf %t && mkdir -p %t
// RUN: env MEGASLIDE_NVRTC_LIBRARY=%t/no-such-libnvrtc.so not megaslide-translate --emit-dsa-kernels %s -o %t --cubin sm_90a 2>&1 | FileCheck %s
// RUN: ls %t | FileCheck %s --check-prefix=FILES
// RUN: not megaslide-translate --emit-dsa-kernels %s --cubin sm_90a 2>&1 | FileCheck %s --check-prefix=NO-DIR

// Tests that --cubin without a loadable NVRTC fails with a message naming
// what was tried (the sources are still written), and that --cubin needs
// an output directory.

// CHECK:      error: --cubin: NVRTC (the CUDA run-time compiler) was not found; tried:
// CHECK-NEXT:   {{.*}}no-such-libnvrtc.so
// CHECK-NEXT: install the CUDA toolkit, or point CUDA_HOME, LD_LIBRARY_PATH or MEGASLIDE_NVRTC_LIBRARY at it

// FILES:     dsa3d_g2x4x4_w2x2x2_t1x2x2_h4_d16_bf16_r1.cu
// FILES-NOT: .cubin
// FILES:     manifest.json

// NO-DIR: error: --cubin needs an output directory (-o DIR)

func.func @tiny(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x32x4x16xbf16>) {
  %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, radius = 1 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x4x2x2x2x2x2xi32>
  return
}
