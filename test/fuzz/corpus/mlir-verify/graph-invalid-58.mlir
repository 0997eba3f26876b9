func.func @linear_types(%x: tensor<1x32x64xbf16>, %w: tensor<256x64xf32>) {
  %y = megaslide.linear %x, %w : (tensor<1x32x64xbf16>, tensor<256x64xf32>) -> tensor<1x32x256xbf16>
  return
}
