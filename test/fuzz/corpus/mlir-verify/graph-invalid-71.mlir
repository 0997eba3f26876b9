func.func @layer_norm_grad_dy(%x: tensor<1x32x64xbf16>, %dy: tensor<1x16x64xbf16>) {
  %dx = megaslide.layer_norm_grad %x, %dy
      : (tensor<1x32x64xbf16>, tensor<1x16x64xbf16>) -> tensor<1x32x64xbf16>
  return
}
