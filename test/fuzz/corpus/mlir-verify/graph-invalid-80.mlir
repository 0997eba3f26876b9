func.func @gate_shape(%x: tensor<2x32x64xbf16>, %g: tensor<1x64xbf16>) {
  %y = megaslide.gate %x, %g : (tensor<2x32x64xbf16>, tensor<1x64xbf16>) -> tensor<2x32x64xbf16>
  return
}
