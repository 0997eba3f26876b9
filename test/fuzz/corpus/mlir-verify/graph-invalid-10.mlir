megaslide.param master head @w : tensor<4xf32>
func.func @load_type() -> tensor<8xf32> {
  %0 = megaslide.load @w : tensor<8xf32>
  return %0 : tensor<8xf32>
}
