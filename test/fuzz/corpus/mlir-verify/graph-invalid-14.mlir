func.func @adamw_m(%p: tensor<4xf32>, %m: tensor<2x2xf32>, %s: tensor<i64>) {
  %p1, %m1, %v1 = megaslide.adamw %p, %p, %m, %m, %s
      : tensor<4xf32>, tensor<4xf32>, tensor<2x2xf32>, tensor<2x2xf32>, tensor<i64>
  return
}
