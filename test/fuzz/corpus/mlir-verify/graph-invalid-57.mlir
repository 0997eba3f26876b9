func.func @linear_result(%x: tensor<1x32x64xbf16>, %w: tensor<256x64xbf16>) {
  %y = megaslide.linear %x, %w : (tensor<1x32x64xbf16>, tensor<256x64xbf16>) -> tensor<1x32x64xbf16>
  return
}
