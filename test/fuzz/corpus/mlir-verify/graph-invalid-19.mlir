func.func @reshape_count(%x: tensor<2x3xbf16>) -> tensor<7xbf16> {
  %y = megaslide.reshape %x : tensor<2x3xbf16> -> tensor<7xbf16>
  return %y : tensor<7xbf16>
}
