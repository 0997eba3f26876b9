func.func @linear_in(%x: tensor<1x32x48xbf16>, %w: tensor<256x64xbf16>) {
  %y = megaslide.linear %x, %w : (tensor<1x32x48xbf16>, tensor<256x64xbf16>) -> tensor<1x32x256xbf16>
  return
}
