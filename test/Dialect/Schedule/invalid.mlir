// RUN: megaslide-opt %s --split-input-file --verify-diagnostics

// One case per verifier message of the schedule dialect (ScheduleOps.cpp),
// plus the ODS constraints a hand-written plan is most likely to break.

//===----------------------------------------------------------------------===//
// Resources and budget checks
//===----------------------------------------------------------------------===//

// Tests that a resource cannot have a negative size.

// expected-error @below {{'msched.resource' op attribute 'size' failed to satisfy constraint: 64-bit signless integer attribute whose value is non-negative}}
msched.resource @r device size(-1) category("device arena")

// -----

// Tests that a budget must be positive.

func.func @zero_budget() {
  // expected-error @below {{'msched.budget_check' op attribute 'budget' failed to satisfy constraint: 64-bit signless integer attribute whose value is positive}}
  msched.budget_check @device_arena budget(0)
  return
}

//===----------------------------------------------------------------------===//
// msched.pack
//===----------------------------------------------------------------------===//

// -----

// Tests that the alignment of a pack must be positive.

func.func @zero_alignment() {
  // expected-error @below {{attribute 'alignment' failed to satisfy constraint: 64-bit signless integer attribute whose value is positive}}
  msched.pack {alignment = 0 : i64, sizes = array<i64: 1024>, starts = array<i64: 0>, ends = array<i64: 2>}
  return
}

// -----

// Tests that every slice needs a start and an end.

func.func @missing_start() {
  // expected-error @below {{'msched.pack' op needs one start and one end per slice: 2 sizes, 1 starts, 2 ends}}
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, 512>,
               starts = array<i64: 0>, ends = array<i64: 2, 3>}
  return
}

// -----

// Tests that every slice needs an end.

func.func @missing_end() {
  // expected-error @below {{'msched.pack' op needs one start and one end per slice: 2 sizes, 2 starts, 3 ends}}
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, 512>,
               starts = array<i64: 0, 1>, ends = array<i64: 2, 3, 4>}
  return
}

// -----

// Tests that a slice cannot have a negative size.

func.func @negative_size() {
  // expected-error @below {{'msched.pack' op slice 1 has negative size -512}}
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, -512>,
               starts = array<i64: 0, 1>, ends = array<i64: 2, 3>}
  return
}

// -----

// Tests that a slice cannot end before it starts.

func.func @reversed_lifetime() {
  // expected-error @below {{'msched.pack' op slice 1 has an empty lifetime [3, 2]}}
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, 512>,
               starts = array<i64: 0, 3>, ends = array<i64: 2, 2>}
  return
}

// -----

// Tests that a slice cannot start before the first op.

func.func @negative_start() {
  // expected-error @below {{'msched.pack' op slice 0 has an empty lifetime [-1, 2]}}
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024>,
               starts = array<i64: -1>, ends = array<i64: 2>}
  return
}

// -----

// Tests that a solution has one offset per slice.

func.func @offsets_count() {
  // expected-error @below {{'msched.pack' op has 1 offsets for 2 slices}}
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, 512>,
               starts = array<i64: 0, 1>, ends = array<i64: 2, 3>,
               offsets = array<i64: 0>, arena_size = 1536 : i64}
  return
}

// -----

// Tests that a solution states the arena size.

func.func @no_arena_size() {
  // expected-error @below {{'msched.pack' op a solved pack needs 'arena_size'}}
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, 512>,
               starts = array<i64: 0, 1>, ends = array<i64: 2, 3>,
               offsets = array<i64: 0, 1024>}
  return
}

// -----

// Tests that offsets must be multiples of the alignment.

func.func @misaligned_offset() {
  // expected-error @below {{'msched.pack' op slice 1 offset 1000 is not a non-negative multiple of the alignment 256}}
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1000, 512>,
               starts = array<i64: 0, 1>, ends = array<i64: 2, 3>,
               offsets = array<i64: 0, 1000>, arena_size = 1536 : i64}
  return
}

// -----

// Tests that offsets cannot be negative.

func.func @negative_offset() {
  // expected-error @below {{'msched.pack' op slice 0 offset -256 is not a non-negative multiple of the alignment 256}}
  msched.pack {alignment = 256 : i64, sizes = array<i64: 256>,
               starts = array<i64: 0>, ends = array<i64: 2>,
               offsets = array<i64: -256>, arena_size = 256 : i64}
  return
}

// -----

// Tests that a slice must end inside the arena.

func.func @past_arena() {
  // expected-error @below {{'msched.pack' op slice 1 ends at byte 2048, past the arena of 1536 bytes}}
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, 512>,
               starts = array<i64: 0, 1>, ends = array<i64: 2, 3>,
               offsets = array<i64: 0, 1536>, arena_size = 1536 : i64}
  return
}

// -----

// Tests that two slices live together (slice 1 during [1, 3] overlaps
// slice 0 during [0, 2]) cannot share bytes: slice 1 at 512 runs into the
// upper half of slice 0.

func.func @overlapping_live_slices() {
  // expected-error @below {{'msched.pack' op slices 0 and 1 are live together but overlap in bytes [512, 1024)}}
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, 512>,
               starts = array<i64: 0, 1>, ends = array<i64: 2, 3>,
               offsets = array<i64: 0, 512>, arena_size = 1536 : i64}
  return
}

// -----

// Tests that an overlap with the slice below (not only the one above) is
// found: slice 2 at 256 overlaps slice 0 [0, 512) and lies below slice 1.

func.func @overlap_with_lower_neighbour() {
  // expected-error @below {{'msched.pack' op slices 0 and 2 are live together but overlap in bytes [256, 512)}}
  msched.pack {alignment = 256 : i64, sizes = array<i64: 512, 256, 256>,
               starts = array<i64: 0, 0, 1>, ends = array<i64: 5, 5, 5>,
               offsets = array<i64: 0, 1024, 256>, arena_size = 1280 : i64}
  return
}

// -----

// Tests that slices that share a step (the end of one is the start of the
// other; ends are inclusive) must not overlap.

func.func @inclusive_end() {
  // expected-error @below {{'msched.pack' op slices 0 and 1 are live together but overlap in bytes [0, 256)}}
  msched.pack {alignment = 256 : i64, sizes = array<i64: 256, 256>,
               starts = array<i64: 0, 2>, ends = array<i64: 2, 4>,
               offsets = array<i64: 0, 0>, arena_size = 256 : i64}
  return
}

// -----

// Tests that valid solutions verify: disjoint lifetimes share offset 0,
// and a zero-size slice may sit anywhere (no diagnostic expected).

func.func @valid_reuse() {
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, 1024, 0>,
               starts = array<i64: 0, 3, 1>, ends = array<i64: 2, 4, 4>,
               offsets = array<i64: 0, 0, 0>, arena_size = 1024 : i64}
  return
}

//===----------------------------------------------------------------------===//
// Transfers and host work
//===----------------------------------------------------------------------===//

// -----

// Tests that a fetch must name a megaslide.param.

func.func @fetch_unknown() {
  // expected-error @below {{'msched.fetch' op 'blocks.0.nope' does not name a megaslide.param}}
  %0 = msched.fetch @"blocks.0.nope" : tensor<64x64xbf16>
  return
}

// -----

// Tests that a fetch has the shape of its param.

megaslide.param master blocks[0] @w : tensor<64x64xf32>
func.func @fetch_shape() {
  // expected-error @below {{'msched.fetch' op type 'tensor<32x64xbf16>' does not have the shape of 'tensor<64x64xf32>' declared by 'w'}}
  %0 = msched.fetch @w : tensor<32x64xbf16>
  return
}

// -----

// Tests that AdamW moments stay on the host: they cannot be fetched.

megaslide.param master blocks[0] @w : tensor<64x64xf32>
megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<64x64xf32>
func.func @fetch_moment() {
  // expected-error @below {{'msched.fetch' op can only fetch weights, not a 'moment' tensor}}
  %0 = msched.fetch @w.exp_avg : tensor<64x64xbf16>
  return
}

// -----

// Tests that persistent gradients cannot be fetched either.

megaslide.param master head @w : tensor<8xf32>
megaslide.param gradient head @w.grad of @w : tensor<8xf32>
func.func @fetch_gradient() {
  // expected-error @below {{'msched.fetch' op can only fetch weights, not a 'gradient' tensor}}
  %0 = msched.fetch @w.grad : tensor<8xf32>
  return
}

// -----

// Tests that a fetched working copy is floating point.

megaslide.param master blocks[0] @w : tensor<64x64xf32>
func.func @fetch_integer() {
  // expected-error @below {{'msched.fetch' op fetches floating-point working copies, got 'i32'}}
  %0 = msched.fetch @w : tensor<64x64xi32>
  return
}

// -----

// Tests that h2d keeps the type of what it copies.

func.func @h2d_type(%x: tensor<4xbf16>) {
  // expected-error @below {{'msched.h2d' op requires the same type for all operands and results}}
  %0 = "msched.h2d"(%x) : (tensor<4xbf16>) -> tensor<4xf32>
  return
}

// -----

// Tests that d2h keeps the type of what it copies.

func.func @d2h_type(%x: tensor<4xbf16>) {
  // expected-error @below {{'msched.d2h' op requires the same type for all operands and results}}
  %0 = "msched.d2h"(%x) : (tensor<4xbf16>) -> tensor<8xbf16>
  return
}

// -----

// Tests that host_adamw must name a megaslide.param.

func.func @adamw_unknown(%g: tensor<64x64xbf16>, %step: tensor<i64>) {
  // expected-error @below {{'msched.host_adamw' op 'nope' does not name a megaslide.param}}
  msched.host_adamw @nope, %g, %step : tensor<64x64xbf16>, tensor<i64>
  return
}

// -----

// Tests that the gradient has the shape of the parameter.

megaslide.param master blocks[0] @w : tensor<64x64xf32>
func.func @adamw_shape(%g: tensor<64xbf16>, %step: tensor<i64>) {
  // expected-error @below {{'msched.host_adamw' op type 'tensor<64xbf16>' does not have the shape of 'tensor<64x64xf32>' declared by 'w'}}
  msched.host_adamw @w, %g, %step : tensor<64xbf16>, tensor<i64>
  return
}

// -----

// Tests that only trainable (master) parameters are updated.

megaslide.param frozen embeddings @pos_embed : tensor<1x32x64xbf16>
func.func @adamw_frozen(%g: tensor<1x32x64xbf16>, %step: tensor<i64>) {
  // expected-error @below {{'msched.host_adamw' op updates trainable parameters; 'pos_embed' is a 'frozen' tensor}}
  msched.host_adamw @pos_embed, %g, %step : tensor<1x32x64xbf16>, tensor<i64>
  return
}

// -----

// Tests that the step counter is an i64 scalar.

megaslide.param master blocks[0] @w : tensor<64x64xf32>
func.func @adamw_step(%g: tensor<64x64xbf16>, %step: tensor<i32>) {
  // expected-error @below {{'msched.host_adamw' op operand #1 must be 0D tensor of 64-bit signless integer values, but got 'tensor<i32>'}}
  msched.host_adamw @w, %g, %step : tensor<64x64xbf16>, tensor<i32>
  return
}

//===----------------------------------------------------------------------===//
// Timepoints
//===----------------------------------------------------------------------===//

// -----

// Tests that join needs at least one timepoint.

func.func @empty_join() {
  // expected-error @below {{'msched.join' op needs at least one timepoint}}
  %0 = msched.join
  return
}
