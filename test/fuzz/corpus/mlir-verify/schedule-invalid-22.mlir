func.func @h2d_type(%x: tensor<4xbf16>) {
  %0 = "msched.h2d"(%x) : (tensor<4xbf16>) -> tensor<4xf32>
  return
}
