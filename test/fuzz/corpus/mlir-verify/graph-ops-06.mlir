func.func @rms_norm(%x: tensor<1x32x64xbf16>, %g: tensor<64xbf16>) {
  %y = megaslide.rms_norm %x, %g {eps = 1.0e-06 : f64}
      : (tensor<1x32x64xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  %z = megaslide.rms_norm %x {eps = 1.0e-05 : f64} : (tensor<1x32x64xbf16>) -> tensor<1x32x64xbf16>
  %dx, %dg = megaslide.rms_norm_grad %x, %y, %g
      : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>, tensor<64xbf16>) -> (tensor<1x32x64xbf16>, tensor<64xbf16>)
  %dx2 = megaslide.rms_norm_grad %x, %z {eps = 1.0e-05 : f64}
      : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>) -> tensor<1x32x64xbf16>
  return
}
