megaslide.param master blocks[0] @w : tensor<64x64xf32>
func.func @fetch_shape() {
  %0 = msched.fetch @w : tensor<32x64xbf16>
  return
}
