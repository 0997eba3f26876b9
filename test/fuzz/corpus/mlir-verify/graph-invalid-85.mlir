func.func @bias_add_grad_suffix(%dy: tensor<2x384xbf16>) {
  %db = megaslide.bias_add_grad %dy : tensor<2x384xbf16> -> tensor<1x2x384xbf16>
  return
}
