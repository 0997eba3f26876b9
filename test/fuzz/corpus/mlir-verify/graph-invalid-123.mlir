func.func @loss_grad_shape(%p: tensor<1x32x2x8x8xbf16>, %x: tensor<1x16x2x8x8xbf16>) {
  %dp = megaslide.flow_matching_loss_grad %p, %x, %x
      : (tensor<1x32x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<1x16x2x8x8xbf16>
  return
}
