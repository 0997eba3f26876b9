// RUN: megaslide-opt %s --split-input-file --megaslide-plan-memory --verify-diagnostics | FileCheck %s
// RUN: megaslide-opt %s --split-input-file --megaslide-plan-memory=alignment=1024 --verify-diagnostics | FileCheck %s --check-prefix=ALIGN1K
// RUN: not megaslide-opt %s --split-input-file --megaslide-plan-memory=alignment=384 2>&1 | FileCheck %s --check-prefix=BADALIGN

// Device values are the results of ops on the compute (0) and h2d (1)
// streams; d2h (2) copies only end lifetimes. Program-order indices count
// every op of the step (the return too), starting at 0.

// BADALIGN: error: option 'alignment': 384 is not a positive power of two

// Tests that the packing is exactly the hand-computed one on a case that
// exercises reuse, best fit, coalescing of freed neighbours and growth from
// a free tail.
// Slices (size in bytes -> aligned to 256, live [start, end]):
//   a   1024 -> 1024  [0, 4]     b   240 -> 256   [1, 7]
//   c    512 -> 512   [2, 5]     d   256 -> 256   [3, 9]
//   e     32 -> 256   [6, 8]     f  1536 -> 1536  [10, 12]
//   g   1024 -> 1024  [11, 13]
// Linear scan in start order, freeing slices whose end < the next start:
//   a: nothing free, arena top 0        -> a @ 0,    top 1024
//   b:                                  -> b @ 1024, top 1280
//   c:                                  -> c @ 1280, top 1792
//   d:                                  -> d @ 1792, top 2048
//   e (starts at 6): a, c are dead; free = {[0,1024), [1280,1792)}. Best
//      fit for 256 is the 512-byte hole, not the first (1024-byte) one
//                                       -> e @ 1280; free = {[0,1024), [1536,1792)}
//   f (starts at 10): b, e, d are dead. b [1024,1280) joins [0,1024) ->
//      [0,1280); e [1280,1536) joins both neighbours -> [0,1792); d
//      [1792,2048) joins -> [0,2048). Only the coalesced block holds 1536
//                                       -> f @ 0;    free = {[1536,2048)}
//   g (starts at 11): no free block holds 1024, but the free one ends at
//      the top, so g starts there and grows the arena
//                                       -> g @ 1536, top 2560
// Arena = max(offset + aligned size) = 2560 = f + g, the peak live bytes.

// CHECK-LABEL: module @packing
// CHECK:         msched.resource @device_arena device size([[ARENA:2560]]) category("device arena")
// CHECK:       func.func @train_step()
// CHECK-NEXT:    msched.pack {alignment = 256 : i64, arena_size = [[ARENA]] : i64,
// CHECK-SAME:      ends = array<i64: 4, 7, 5, 9, 8, 12, 13>,
// CHECK-SAME:      offsets = array<i64: 0, 1024, 1280, 1792, 1280, 0, 1536>,
// CHECK-SAME:      sizes = array<i64: 1024, 240, 512, 256, 32, 1536, 1024>,
// CHECK-SAME:      starts = array<i64: 0, 1, 2, 3, 6, 10, 11>}
// CHECK-NEXT:    megaslide.zeros {msched.offsets = array<i64: 0>, msched.stream = 0 : i32} : tensor<256xf32>
// CHECK-NEXT:    megaslide.zeros {msched.offsets = array<i64: 1024>, msched.stream = 0 : i32} : tensor<60xf32>
// CHECK-NEXT:    megaslide.zeros {msched.offsets = array<i64: 1280>, msched.stream = 0 : i32} : tensor<128xf32>
// CHECK-NEXT:    megaslide.zeros {msched.offsets = array<i64: 1792>, msched.stream = 0 : i32} : tensor<64xf32>
// The host-side copies are not device values: no offsets.
// CHECK-NEXT:    msched.d2h %{{.*}} {msched.stream = 2 : i32} : tensor<256xf32>
// CHECK-NEXT:    msched.d2h %{{.*}} {msched.stream = 2 : i32} : tensor<128xf32>
// CHECK-NEXT:    megaslide.zeros {msched.offsets = array<i64: 1280>, msched.stream = 0 : i32} : tensor<16xbf16>
// CHECK-NEXT:    msched.d2h
// CHECK-NEXT:    msched.d2h
// CHECK-NEXT:    msched.d2h
// CHECK-NEXT:    megaslide.zeros {msched.offsets = array<i64: 0>, msched.stream = 0 : i32} : tensor<384xf32>
// CHECK-NEXT:    megaslide.zeros {msched.offsets = array<i64: 1536>, msched.stream = 0 : i32} : tensor<256xf32>

// With 1 KiB alignment every slice takes a multiple of 1024 bytes:
// a @ 0, b @ 1024, c @ 2048, d @ 3072 (top 4096). e: a's and c's holes
// are both 1024 bytes; ties go to the lowest offset -> e @ 0. For f (2048)
// b, e and d free and everything coalesces to [0,4096) -> f @ 0, and g
// takes the rest -> g @ 2048. The arena stays at d's end, 4096.
// ALIGN1K-LABEL: module @packing
// ALIGN1K:         msched.resource @device_arena device size(4096)
// ALIGN1K:         msched.pack {alignment = 1024 : i64, arena_size = 4096 : i64, {{.*}}offsets = array<i64: 0, 1024, 2048, 3072, 0, 0, 2048>

module @packing {
  func.func @train_step() {
    %a = megaslide.zeros {msched.stream = 0 : i32} : tensor<256xf32>   // 0
    %b = megaslide.zeros {msched.stream = 0 : i32} : tensor<60xf32>    // 1
    %c = megaslide.zeros {msched.stream = 0 : i32} : tensor<128xf32>   // 2
    %d = megaslide.zeros {msched.stream = 0 : i32} : tensor<64xf32>    // 3
    %0 = msched.d2h %a {msched.stream = 2 : i32} : tensor<256xf32>     // 4
    %1 = msched.d2h %c {msched.stream = 2 : i32} : tensor<128xf32>     // 5
    %e = megaslide.zeros {msched.stream = 0 : i32} : tensor<16xbf16>   // 6
    %2 = msched.d2h %b {msched.stream = 2 : i32} : tensor<60xf32>      // 7
    %3 = msched.d2h %e {msched.stream = 2 : i32} : tensor<16xbf16>     // 8
    %4 = msched.d2h %d {msched.stream = 2 : i32} : tensor<64xf32>      // 9
    %f = megaslide.zeros {msched.stream = 0 : i32} : tensor<384xf32>   // 10
    %g = megaslide.zeros {msched.stream = 0 : i32} : tensor<256xf32>   // 11
    %5 = msched.d2h %f {msched.stream = 2 : i32} : tensor<384xf32>     // 12
    %6 = msched.d2h %g {msched.stream = 2 : i32} : tensor<256xf32>     // 13
    return {msched.stream = 3 : i32}                                   // 14
  }
}

// -----

// Tests that a reshape is a view: its result gets its input's offset and
// shares one slice with it (5 slices for 5 values and a workspace), live
// from the silu at 1 to the last use of the view, the attention at 5. The
// batch copied in on h2d is a device value. The attention op gets a
// workspace (fp32 log-sum-exp per batch, token and head: 4 * 1 * 8 * 2 =
// 64 B, live during the op) recorded as [offset, size]. Planning again
// replaces the pack and the arena's size instead of adding new ones.
//   in  512 [0, 3] -> 0      x|r 512 [1, 5] -> 512    y 512 [3, 3] -> 1024
//   o   512 [5, 6] -> 0 (in died at 3)   workspace 64 [5, 5] -> 1024 (y died)

// CHECK-LABEL: module @views
// CHECK-NEXT:    msched.resource @device_arena device size([[ARENA:1536]]) category("device arena")
// CHECK-NOT:     msched.resource @device_arena
// CHECK:       func.func @train_step(
// CHECK-NEXT:    msched.pack {alignment = 256 : i64, arena_size = [[ARENA]] : i64, ends = array<i64: 3, 5, 3, 6, 5>, offsets = array<i64: 0, 512, 1024, 0, 1024>, sizes = array<i64: 512, 512, 512, 512, 64>, starts = array<i64: 0, 1, 3, 5, 5>}
// CHECK-NEXT:    %[[IN:.*]] = msched.h2d %{{.*}} {msched.offsets = array<i64: 0>, msched.stream = 1 : i32}
// CHECK-NEXT:    %[[X:.*]] = megaslide.silu %[[IN]] {msched.offsets = array<i64: [[X_OFF:512]]>, msched.stream = 0 : i32}
// CHECK-NEXT:    %[[R:.*]] = megaslide.reshape %[[X]] {msched.offsets = array<i64: [[X_OFF]]>, msched.stream = 0 : i32}
// CHECK-NEXT:    %[[Y:.*]] = megaslide.silu %[[IN]] {msched.offsets = array<i64: 1024>, msched.stream = 0 : i32}
// CHECK-NEXT:    msched.d2h %[[R]] {msched.stream = 2 : i32}
// CHECK-NEXT:    megaslide.attention %[[R]], %[[R]], %[[R]] {msched.offsets = array<i64: 0>, msched.stream = 0 : i32, msched.workspace = array<i64: 1024, 64>}
// CHECK-NOT:     msched.pack

module @views {
  msched.resource @device_arena device size(1) category("device arena")
  func.func @train_step(%arg0: tensor<1x8x32xbf16>) -> tensor<1x8x2x16xbf16> {
    msched.pack {alignment = 256 : i64, sizes = array<i64>, starts = array<i64>, ends = array<i64>}
    %in = msched.h2d %arg0 {msched.stream = 1 : i32} : tensor<1x8x32xbf16>
    %x = megaslide.silu %in {msched.stream = 0 : i32} : tensor<1x8x32xbf16>
    %r = megaslide.reshape %x {msched.stream = 0 : i32} : tensor<1x8x32xbf16> -> tensor<1x8x2x16xbf16>
    %y = megaslide.silu %in {msched.stream = 0 : i32} : tensor<1x8x32xbf16>
    %0 = msched.d2h %r {msched.stream = 2 : i32} : tensor<1x8x2x16xbf16>
    %o = megaslide.attention %r, %r, %r {msched.stream = 0 : i32} : (tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>) -> tensor<1x8x2x16xbf16>
    %1 = msched.d2h %o {msched.stream = 2 : i32} : tensor<1x8x2x16xbf16>
    return {msched.stream = 3 : i32} %1 : tensor<1x8x2x16xbf16>
  }
}

// -----

// Tests the 3D-DSA buffers: the forward's log-sum-exp is a result buffer
// (no workspace on dsa3d), and dsa3d_grad's workspace holds the fp32 row
// sums D = rowsum(dO * O) only (dK and dV are written once by the key
// tiles that own them: no accumulators).
// q [B, N, H, Dh] = [1, 8, 2, 16] bf16 over grid (2, 2, 2), tile (1, 2, 2):
//   q, o, do, dq, dk, dv  1 * 8 * 2 * 16 * 2 = 512 B each
//   offsets [1, 2, 2, 1, 1, 2, 2] i32 = 16 * 4 = 64 B -> 256
//   lse [B, H, N] = [1, 2, 8] f32 = 64 B -> 256
//   workspace = B*H*N*4 = 64 B -> 256
// Slices (live [start, end]): q [0, 4], off [1, 4], o and lse [2, 4],
// do [3, 4], dq [4, 5], dk [4, 6], dv [4, 7], workspace [4, 4]. Nothing
// dies before 4, so each slice stacks on the top; at 4 the largest go
// first (dq, dk, dv, then the workspace):
//   q @ 0, off @ 512, o @ 768, lse @ 1280, do @ 1536, dq @ 2048,
//   dk @ 2560, dv @ 3072, workspace @ 3584; arena 3840 = everything live
//   at 4.

// CHECK-LABEL: module @dsa3d
// CHECK:         msched.resource @device_arena device size([[ARENA:3840]]) category("device arena")
// CHECK:       func.func @train_step(
// CHECK-NEXT:    msched.pack {alignment = 256 : i64, arena_size = [[ARENA]] : i64,
// CHECK-SAME:      ends = array<i64: 4, 4, 4, 4, 4, 5, 6, 7, 4>,
// CHECK-SAME:      offsets = array<i64: 0, 512, 768, 1280, 1536, 2048, 2560, 3072, 3584>,
// CHECK-SAME:      sizes = array<i64: 512, 64, 512, 64, 512, 512, 512, 512, 64>,
// CHECK-SAME:      starts = array<i64: 0, 1, 2, 2, 3, 4, 4, 4, 4>}
// CHECK-NEXT:    msched.h2d
// CHECK-NEXT:    megaslide.dsa3d_offsets
// The forward: two result offsets and no msched.workspace.
// CHECK-NEXT:    megaslide.dsa3d {{.*}}, msched.offsets = array<i64: 768, 1280>, msched.stream = 0 : i32, tile = {{.*}}} :
// CHECK-NEXT:    megaslide.zeros
// CHECK-NEXT:    megaslide.dsa3d_grad {{.*}}msched.offsets = array<i64: 2048, 2560, 3072>, msched.stream = 0 : i32, msched.workspace = array<i64: 3584, 64>,

module @dsa3d {
  func.func @train_step(%arg0: tensor<1x8x2x16xbf16>) -> (tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>) {
    %q = msched.h2d %arg0 {msched.stream = 1 : i32} : tensor<1x8x2x16xbf16>      // 0
    %off = megaslide.dsa3d_offsets %q, %q {grid = array<i64: 2, 2, 2>,          // 1
        window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, radius = 1 : i64, msched.stream = 0 : i32}
        : (tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>) -> tensor<1x2x2x1x1x2x2xi32>
    %o, %lse = megaslide.dsa3d %q, %q, %q, %off {grid = array<i64: 2, 2, 2>,    // 2
        window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, msched.stream = 0 : i32}
        : (tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>,
           tensor<1x2x2x1x1x2x2xi32>) -> (tensor<1x8x2x16xbf16>, tensor<1x2x8xf32>)
    %do = megaslide.zeros {msched.stream = 0 : i32} : tensor<1x8x2x16xbf16>     // 3
    %dq, %dk, %dv = megaslide.dsa3d_grad %q, %q, %q, %off, %o, %lse, %do {      // 4
        grid = array<i64: 2, 2, 2>, window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>,
        msched.stream = 0 : i32}
        : (tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>,
           tensor<1x2x2x1x1x2x2xi32>, tensor<1x8x2x16xbf16>, tensor<1x2x8xf32>,
           tensor<1x8x2x16xbf16>)
          -> (tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>)
    %0 = msched.d2h %dq {msched.stream = 2 : i32} : tensor<1x8x2x16xbf16>       // 5
    %1 = msched.d2h %dk {msched.stream = 2 : i32} : tensor<1x8x2x16xbf16>       // 6
    %2 = msched.d2h %dv {msched.stream = 2 : i32} : tensor<1x8x2x16xbf16>       // 7
    return {msched.stream = 3 : i32} %0, %1, %2 : tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>  // 8
  }
}
