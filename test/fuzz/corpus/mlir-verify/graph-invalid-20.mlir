func.func @reshape_type(%x: tensor<2x3xbf16>) -> tensor<6xf32> {
  %y = megaslide.reshape %x : tensor<2x3xbf16> -> tensor<6xf32>
  return %y : tensor<6xf32>
}
