megaslide.param master head @w : tensor<8xf32>
megaslide.param gradient head @w.grad of @w : tensor<8xf32>
func.func @fetch_gradient() {
  %0 = msched.fetch @w.grad : tensor<8xf32>
  return
}
