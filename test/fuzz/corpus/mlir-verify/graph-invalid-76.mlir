func.func @rms_norm_grad_dx(%x: tensor<1x32x64xbf16>) {
  %dx = megaslide.rms_norm_grad %x, %x {eps = 1.0e-05 : f64}
      : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>) -> tensor<1x32x32xbf16>
  return
}
