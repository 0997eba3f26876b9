func.func @gate_types(%x: tensor<1x32x64xbf16>, %g: tensor<1x64xf32>) {
  %y = megaslide.gate %x, %g : (tensor<1x32x64xbf16>, tensor<1x64xf32>) -> tensor<1x32x64xbf16>
  return
}
