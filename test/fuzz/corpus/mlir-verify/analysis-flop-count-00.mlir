func.func @linear(%x: tensor<2x32x64xbf16>, %w: tensor<256x64xbf16>, %b: tensor<256xbf16>) {
  %y = megaslide.linear %x, %w, %b
      : (tensor<2x32x64xbf16>, tensor<256x64xbf16>, tensor<256xbf16>) -> tensor<2x32x256xbf16>
  %y2 = megaslide.linear %x, %w : (tensor<2x32x64xbf16>, tensor<256x64xbf16>) -> tensor<2x32x256xbf16>
  %dx = megaslide.linear_grad_data %y, %w
      : (tensor<2x32x256xbf16>, tensor<256x64xbf16>) -> tensor<2x32x64xbf16>
  %dw, %db = megaslide.linear_grad_params %x, %y
      : (tensor<2x32x64xbf16>, tensor<2x32x256xbf16>) -> (tensor<256x64xbf16>, tensor<256xbf16>)
  %dw2 = megaslide.linear_grad_params %x, %y2
      : (tensor<2x32x64xbf16>, tensor<2x32x256xbf16>) -> tensor<256x64xbf16>
  return
}
