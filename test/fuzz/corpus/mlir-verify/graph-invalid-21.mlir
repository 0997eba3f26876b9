func.func @reshape_dynamic(%x: tensor<?x3xbf16>) -> tensor<6xbf16> {
  %y = megaslide.reshape %x : tensor<?x3xbf16> -> tensor<6xbf16>
  return %y : tensor<6xbf16>
}
