func.func @rms_norm_gamma(%x: tensor<1x32x64xbf16>, %g: tensor<1x64xbf16>) {
  %y = megaslide.rms_norm %x, %g : (tensor<1x32x64xbf16>, tensor<1x64xbf16>) -> tensor<1x32x64xbf16>
  return
}
