func.func @modulate_rank(%x: tensor<32x64xbf16>, %s: tensor<1x64xbf16>) {
  %y = megaslide.modulate %x, %s, %s
      : (tensor<32x64xbf16>, tensor<1x64xbf16>, tensor<1x64xbf16>) -> tensor<32x64xbf16>
  return
}
