func.func @adaln(%x: tensor<1x32x64xbf16>, %shift: tensor<1x64xbf16>, %scale: tensor<1x64xbf16>) {
  %y = megaslide.modulate %x, %shift, %scale
      : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x64xbf16>) -> tensor<1x32x64xbf16>
  %dx, %dshift, %dscale = megaslide.modulate_grad %x, %scale, %y
      : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>)
        -> (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x64xbf16>)
  %g = megaslide.gate %x, %shift : (tensor<1x32x64xbf16>, tensor<1x64xbf16>) -> tensor<1x32x64xbf16>
  %dx2, %dgate = megaslide.gate_grad %x, %shift, %g
      : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>)
        -> (tensor<1x32x64xbf16>, tensor<1x64xbf16>)
  return
}
