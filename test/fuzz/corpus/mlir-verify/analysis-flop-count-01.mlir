func.func @linear_2d(%x: tensor<3x1152xbf16>, %w: tensor<6912x1152xbf16>, %b: tensor<6912xbf16>) {
  %y = megaslide.linear %x, %w, %b
      : (tensor<3x1152xbf16>, tensor<6912x1152xbf16>, tensor<6912xbf16>) -> tensor<3x6912xbf16>
  return
}
