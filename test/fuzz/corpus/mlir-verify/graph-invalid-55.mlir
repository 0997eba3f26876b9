func.func @linear_weight(%x: tensor<1x32x64xbf16>, %w: tensor<64xbf16>) {
  %y = megaslide.linear %x, %w : (tensor<1x32x64xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  return
}
