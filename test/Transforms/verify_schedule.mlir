// RUN: megaslide-opt %s --split-input-file --megaslide-verify-schedule --verify-diagnostics | FileCheck %s
// RUN: not megaslide-opt %s --split-input-file --megaslide-verify-schedule=phase=transfers -o %t.transfers 2>&1 | FileCheck %s --check-prefix=TRANSFERS
// RUN: not megaslide-opt %s --split-input-file --megaslide-verify-schedule=phase=streams -o %t.streams 2>&1 | FileCheck %s --check-prefix=STREAMS
// RUN: not megaslide-opt %s --split-input-file --megaslide-verify-schedule=phase=nope -o %t.nope 2>&1 | FileCheck %s --check-prefix=BADPHASE

// The gate checks what each planning phase promises; later phases include
// the earlier ones. The first RUN is the default phase, memory, where every
// case but the last fails (annotated below); the other phases fail on a
// prefix of the cases, listed here in file order. (The driver also echoes
// the memory-phase expectations it did not see as "error: expected error
// ...", which the NOT patterns skip.)

// TRANSFERS:     error: 'megaslide.load' op reads or writes host state inside the step; run megaslide-insert-transfers
// TRANSFERS-NEXT:  %p = megaslide.load @w
// TRANSFERS:     error: 'megaslide.store' op reads or writes host state inside the step; run megaslide-insert-transfers
// TRANSFERS-NEXT:  megaslide.store %p, @w
// TRANSFERS:     error: 'megaslide.adamw' op reads or writes host state inside the step; run megaslide-insert-transfers
// TRANSFERS-NEXT:  megaslide.adamw %p, %g, %m, %v, %step
// TRANSFERS-NOT: {{error: ('|has no)}}

// STREAMS:     error: 'megaslide.load' op reads or writes host state
// STREAMS:     error: 'megaslide.store' op reads or writes host state
// STREAMS:     error: 'megaslide.adamw' op reads or writes host state
// STREAMS:     error: 'megaslide.linear' op has no stream; run megaslide-schedule-overlap
// STREAMS-NEXT:  %h = megaslide.linear %dx, %w
// STREAMS-NOT: {{error: ('|has no)}}

// BADPHASE: error: option 'phase': unknown phase 'nope'; use transfers, streams or memory

// Tests that a load of host state left in the step fails the transfers
// gate, on the load.

module @load_left {
  megaslide.param master blocks[0] @w : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
    // expected-error @below {{'megaslide.load' op reads or writes host state inside the step; run megaslide-insert-transfers}}
    %p = megaslide.load @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    %c = megaslide.cast %p {megaslide.layer = 0 : i64} : tensor<16x16xf32> -> tensor<16x16xbf16>
    %h = megaslide.linear %x, %c {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    return %h : tensor<1x8x16xbf16>
  }
}

// -----

// Tests that a store of host state left in the step fails the transfers
// gate.

module @store_left {
  megaslide.param master blocks[0] @w : tensor<16x16xf32>
  func.func @train_step(%p: tensor<16x16xf32>) {
    // expected-error @below {{'megaslide.store' op reads or writes host state inside the step; run megaslide-insert-transfers}}
    megaslide.store %p, @w : tensor<16x16xf32>
    return
  }
}

// -----

// Tests that an AdamW left in the step (not moved to the host) fails the
// transfers gate.

module @adamw_left {
  func.func @train_step(%p: tensor<16xf32>, %g: tensor<16xbf16>, %m: tensor<16xf32>, %v: tensor<16xf32>, %step: tensor<i64>) -> tensor<16xf32> {
    // expected-error @below {{'megaslide.adamw' op reads or writes host state inside the step; run megaslide-insert-transfers}}
    %p1, %m1, %v1 = megaslide.adamw %p, %g, %m, %v, %step : tensor<16xf32>, tensor<16xbf16>, tensor<16xf32>, tensor<16xf32>, tensor<i64>
    return %p1 : tensor<16xf32>
  }
}

// -----

// Tests that an op without a stream fails the streams gate, on that op.

module @no_stream {
  megaslide.param master blocks[0] @w : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
    %dx = msched.h2d %x {msched.stream = 1 : i32} : tensor<1x8x16xbf16>
    %w = msched.fetch @w {megaslide.layer = 0 : i64, msched.stream = 1 : i32} : tensor<16x16xbf16>
    // expected-error @below {{'megaslide.linear' op has no stream; run megaslide-schedule-overlap}}
    %h = megaslide.linear %dx, %w {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %out = msched.d2h %h {msched.stream = 2 : i32} : tensor<1x8x16xbf16>
    return {msched.stream = 3 : i32} %out : tensor<1x8x16xbf16>
  }
}

// -----

// Tests that the memory gate needs the device arena.

// expected-error @below {{has no device arena; run megaslide-plan-memory}}
module @no_arena {
  func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
    %dx = msched.h2d %x {msched.stream = 1 : i32} : tensor<1x8x16xbf16>
    %out = msched.d2h %dx {msched.stream = 2 : i32} : tensor<1x8x16xbf16>
    return {msched.stream = 3 : i32} %out : tensor<1x8x16xbf16>
  }
}

// -----

// Tests that a device value (here on the h2d stream) without an offset
// fails the memory gate.

module @no_offsets {
  msched.resource @device_arena device size(256) category("device arena")
  func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
    // expected-error @below {{'msched.h2d' op produces device values without offsets}}
    %dx = msched.h2d %x {msched.stream = 1 : i32} : tensor<1x8x16xbf16>
    %out = msched.d2h %dx {msched.stream = 2 : i32} : tensor<1x8x16xbf16>
    return {msched.stream = 3 : i32} %out : tensor<1x8x16xbf16>
  }
}

// -----

// Tests that an op needs one offset per result.

module @offsets_count {
  msched.resource @device_arena device size(1024) category("device arena")
  func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x8xbf16> {
    %dx = msched.h2d %x {msched.offsets = array<i64: 0>, msched.stream = 1 : i32} : tensor<1x8x16xbf16>
    // expected-error @below {{'megaslide.split' op produces device values without offsets}}
    %a, %b = megaslide.split %dx {msched.offsets = array<i64: 256>, msched.stream = 0 : i32} : tensor<1x8x16xbf16> -> tensor<1x8x8xbf16>, tensor<1x8x8xbf16>
    %out = msched.d2h %a {msched.stream = 2 : i32} : tensor<1x8x8xbf16>
    return {msched.stream = 3 : i32} %out : tensor<1x8x8xbf16>
  }
}

// -----

// Tests that a value must lie inside the arena: 256 B at 256 ends past a
// 384-byte arena.

module @past_arena {
  msched.resource @device_arena device size(384) category("device arena")
  func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
    // expected-error @below {{'msched.h2d' op result at offset 256 does not fit the arena of 384 bytes}}
    %dx = msched.h2d %x {msched.offsets = array<i64: 256>, msched.stream = 1 : i32} : tensor<1x8x16xbf16>
    %out = msched.d2h %dx {msched.stream = 2 : i32} : tensor<1x8x16xbf16>
    return {msched.stream = 3 : i32} %out : tensor<1x8x16xbf16>
  }
}

// -----

// Tests that a negative offset (what plan-memory writes for a result it
// does not place) fails the memory gate.

module @negative_offset {
  msched.resource @device_arena device size(4096) category("device arena")
  func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
    // expected-error @below {{'megaslide.silu' op result at offset -1 does not fit the arena of 4096 bytes}}
    %s = megaslide.silu %x {msched.offsets = array<i64: -1>, msched.stream = 0 : i32} : tensor<1x8x16xbf16>
    %out = msched.d2h %s {msched.stream = 2 : i32} : tensor<1x8x16xbf16>
    return {msched.stream = 3 : i32} %out : tensor<1x8x16xbf16>
  }
}

// -----

// Tests that a fully planned step passes every gate unchanged: bookkeeping
// ops (pack, budget check, record, wait) need no stream, and values on the
// d2h and host streams need no offsets.

// CHECK-LABEL: module @planned
// CHECK:         msched.budget_check @device_arena
// CHECK:         return {msched.stream = 3 : i32}

module @planned {
  msched.resource @device_arena device size(512) category("device arena")
  megaslide.param master blocks[0] @w : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<1x8x16xbf16> {
    msched.budget_check @device_arena budget(141000000000)
    msched.pack {alignment = 256 : i64, sizes = array<i64: 256, 256>, starts = array<i64: 0, 1>, ends = array<i64: 1, 2>,
                 offsets = array<i64: 0, 256>, arena_size = 512 : i64}
    %dx = msched.h2d %x {msched.offsets = array<i64: 0>, msched.stream = 1 : i32} : tensor<1x8x16xbf16>
    %t = msched.record h2d
    msched.wait %t compute
    %s = megaslide.silu %dx {msched.offsets = array<i64: 256>, msched.stream = 0 : i32} : tensor<1x8x16xbf16>
    %t2 = msched.record compute
    msched.wait %t2 d2h
    %out = msched.d2h %s {msched.stream = 2 : i32} : tensor<1x8x16xbf16>
    %t3 = msched.record d2h
    msched.wait %t3 host
    return {msched.stream = 3 : i32} %out : tensor<1x8x16xbf16>
  }
}
