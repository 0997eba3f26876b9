func.func @linear_grad_params_weight(%x: tensor<1x32x64xbf16>, %dy: tensor<1x32x256xbf16>) {
  %dw = megaslide.linear_grad_params %x, %dy
      : (tensor<1x32x64xbf16>, tensor<1x32x256xbf16>) -> tensor<64x256xbf16>
  return
}
