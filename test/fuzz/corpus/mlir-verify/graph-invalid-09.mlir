func.func @not_a_param() {
  return
}
func.func @load_func() -> tensor<4xf32> {
  %0 = megaslide.load @not_a_param : tensor<4xf32>
  return %0 : tensor<4xf32>
}
