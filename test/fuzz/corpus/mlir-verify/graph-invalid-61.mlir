func.func @linear_grad_params_leading(%x: tensor<1x16x64xbf16>, %dy: tensor<1x32x256xbf16>) {
  %dw = megaslide.linear_grad_params %x, %dy
      : (tensor<1x16x64xbf16>, tensor<1x32x256xbf16>) -> tensor<256x64xbf16>
  return
}
