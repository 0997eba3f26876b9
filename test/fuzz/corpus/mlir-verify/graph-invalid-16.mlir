func.func @adamw_nan_beta(%p: tensor<4xf32>, %s: tensor<i64>) {
  %p1, %m1, %v1 = megaslide.adamw %p, %p, %p, %p, %s {beta1 = 0x7FF8000000000000 : f64}
      : tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<i64>
  return
}
