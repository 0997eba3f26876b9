func.func @adamw_grad(%p: tensor<4xf32>, %g: tensor<8xbf16>, %s: tensor<i64>) {
  %p1, %m1, %v1 = megaslide.adamw %p, %g, %p, %p, %s
      : tensor<4xf32>, tensor<8xbf16>, tensor<4xf32>, tensor<4xf32>, tensor<i64>
  return
}
