func.func @adamw_lr(%p: tensor<4xf32>, %s: tensor<i64>) {
  %p1, %m1, %v1 = megaslide.adamw %p, %p, %p, %p, %s {lr = -1.0e-04 : f64}
      : tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<i64>
  return
}
