func.func @bias_add_result(%x: tensor<2x384xbf16>, %b: tensor<384xbf16>) {
  %y = megaslide.bias_add %x, %b : (tensor<2x384xbf16>, tensor<384xbf16>) -> tensor<384xbf16>
  return
}
