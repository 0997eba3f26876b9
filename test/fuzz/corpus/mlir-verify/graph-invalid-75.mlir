func.func @rms_norm_grad_gamma_shape(%x: tensor<1x32x64xbf16>, %g: tensor<64xbf16>) {
  %dx, %dg = megaslide.rms_norm_grad %x, %x, %g
      : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>, tensor<64xbf16>) -> (tensor<1x32x64xbf16>, tensor<32xbf16>)
  return
}
