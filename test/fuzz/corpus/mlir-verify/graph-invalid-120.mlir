func.func @loss_channels(%p: tensor<1x8x2x8x8xbf16>, %x: tensor<1x16x2x8x8xbf16>) {
  %l = megaslide.flow_matching_loss %p, %x, %x
      : (tensor<1x8x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<f32>
  return
}
