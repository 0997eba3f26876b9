megaslide.param master blocks[0] @w : tensor<64x64xf32>
func.func @adamw_step(%g: tensor<64x64xbf16>, %step: tensor<i32>) {
  msched.host_adamw @w, %g, %step : tensor<64x64xbf16>, tensor<i32>
  return
}
