func.func @bias_add_suffix(%x: tensor<2x384xbf16>, %b: tensor<2xbf16>) {
  %y = megaslide.bias_add %x, %b : (tensor<2x384xbf16>, tensor<2xbf16>) -> tensor<2x384xbf16>
  return
}
