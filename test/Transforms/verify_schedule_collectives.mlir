// RUN: megaslide-opt %s --split-input-file --megaslide-verify-schedule=phase=streams --verify-diagnostics

// Tests that the streams gate verifies a job's collectives: a fetched
// shard is read only by its all_gather over the same ranks, and the
// collectives run on the comm stream (4); a schedule that keeps both
// passes.

megaslide.param master blocks[0] @w : tensor<16x16xf32>
func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
  %w = msched.fetch @w {ranks = 2 : i64, msched.stream = 1 : i32} : tensor<16x16xbf16>
  %all = msched.all_gather %w {ranks = 2 : i64, nodes = 1 : i64, send_bytes = 256 : i64, msched.stream = 4 : i32} : tensor<16x16xbf16>
  %h = megaslide.linear %x, %all {msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
  %g = msched.reduce_scatter %h {ranks = 2 : i64, nodes = 1 : i64, send_bytes = 128 : i64, msched.stream = 4 : i32} : tensor<1x8x16xbf16>
  func.return {msched.stream = 3 : i32} %g : tensor<1x8x16xbf16>
}

// -----

megaslide.param master blocks[0] @w : tensor<16x16xf32>
func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
  %w = msched.fetch @w {ranks = 2 : i64, msched.stream = 1 : i32} : tensor<16x16xbf16>
  // expected-error @below {{reads a fetched shard before its all_gather over 2 ranks}}
  %h = megaslide.linear %x, %w {msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
  func.return {msched.stream = 3 : i32} %h : tensor<1x8x16xbf16>
}

// -----

megaslide.param master blocks[0] @w : tensor<16x16xf32>
func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
  %w = msched.fetch @w {ranks = 2 : i64, msched.stream = 1 : i32} : tensor<16x16xbf16>
  // expected-error @below {{is a collective off the comm stream}}
  %all = msched.all_gather %w {ranks = 2 : i64, nodes = 1 : i64, send_bytes = 256 : i64, msched.stream = 0 : i32} : tensor<16x16xbf16>
  %h = megaslide.linear %x, %all {msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
  func.return {msched.stream = 3 : i32} %h : tensor<1x8x16xbf16>
}

// -----

// The op's verifier: a job has the same number of ranks on every node.
func.func @train_step(%x: tensor<16xbf16>) -> tensor<16xbf16> {
  // expected-error @below {{has 3 ranks over 2 nodes; each node must run the same number of ranks}}
  %all = msched.all_gather %x {ranks = 3 : i64, nodes = 2 : i64, send_bytes = 64 : i64} : tensor<16xbf16>
  func.return %all : tensor<16xbf16>
}
