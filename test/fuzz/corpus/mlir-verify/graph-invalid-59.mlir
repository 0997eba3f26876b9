func.func @linear_grad_data_dy(%dy: tensor<1x32x64xbf16>, %w: tensor<256x64xbf16>) {
  %dx = megaslide.linear_grad_data %dy, %w
      : (tensor<1x32x64xbf16>, tensor<256x64xbf16>) -> tensor<1x32x64xbf16>
  return
}
