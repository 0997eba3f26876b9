func.func @adamw_eps(%p: tensor<4xf32>, %s: tensor<i64>) {
  %p1, %m1, %v1 = megaslide.adamw %p, %p, %p, %p, %s {eps = 0.0 : f64}
      : tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<i64>
  return
}
