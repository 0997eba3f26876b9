func.func @adamw_betas(%p: tensor<4xf32>, %s: tensor<i64>) {
  %p1, %m1, %v1 = megaslide.adamw %p, %p, %p, %p, %s {beta2 = 1.0 : f64}
      : tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<i64>
  return
}
