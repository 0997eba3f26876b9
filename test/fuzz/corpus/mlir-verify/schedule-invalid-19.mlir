megaslide.param master blocks[0] @w : tensor<64x64xf32>
megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<64x64xf32>
func.func @fetch_moment() {
  %0 = msched.fetch @w.exp_avg : tensor<64x64xbf16>
  return
}
