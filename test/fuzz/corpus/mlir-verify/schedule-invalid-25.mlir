megaslide.param master blocks[0] @w : tensor<64x64xf32>
func.func @adamw_shape(%g: tensor<64xbf16>, %step: tensor<i64>) {
  msched.host_adamw @w, %g, %step : tensor<64xbf16>, tensor<i64>
  return
}
