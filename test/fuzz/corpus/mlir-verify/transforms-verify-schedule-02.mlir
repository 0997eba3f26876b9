module @adamw_left {
  func.func @train_step(%p: tensor<16xf32>, %g: tensor<16xbf16>, %m: tensor<16xf32>, %v: tensor<16xf32>, %step: tensor<i64>) -> tensor<16xf32> {
    %p1, %m1, %v1 = megaslide.adamw %p, %g, %m, %v, %step : tensor<16xf32>, tensor<16xbf16>, tensor<16xf32>, tensor<16xf32>, tensor<i64>
    return %p1 : tensor<16xf32>
  }
}
