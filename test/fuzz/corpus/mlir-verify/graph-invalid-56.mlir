func.func @linear_bias(%x: tensor<1x32x64xbf16>, %w: tensor<256x64xbf16>, %b: tensor<64xbf16>) {
  %y = megaslide.linear %x, %w, %b
      : (tensor<1x32x64xbf16>, tensor<256x64xbf16>, tensor<64xbf16>) -> tensor<1x32x256xbf16>
  return
}
