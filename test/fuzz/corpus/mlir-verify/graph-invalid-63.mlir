func.func @linear_grad_params_bias(%x: tensor<1x32x64xbf16>, %dy: tensor<1x32x256xbf16>) {
  %dw, %db = megaslide.linear_grad_params %x, %dy
      : (tensor<1x32x64xbf16>, tensor<1x32x256xbf16>) -> (tensor<256x64xbf16>, tensor<64xbf16>)
  return
}
