func.func @modulate_shift(%x: tensor<1x32x64xbf16>, %shift: tensor<64xbf16>, %scale: tensor<1x64xbf16>) {
  %y = megaslide.modulate %x, %shift, %scale
      : (tensor<1x32x64xbf16>, tensor<64xbf16>, tensor<1x64xbf16>) -> tensor<1x32x64xbf16>
  return
}
