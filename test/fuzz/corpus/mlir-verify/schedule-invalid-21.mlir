megaslide.param master blocks[0] @w : tensor<64x64xf32>
func.func @fetch_integer() {
  %0 = msched.fetch @w : tensor<64x64xi32>
  return
}
