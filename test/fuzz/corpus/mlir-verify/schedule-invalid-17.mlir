func.func @fetch_unknown() {
  %0 = msched.fetch @"blocks.0.nope" : tensor<64x64xbf16>
  return
}
