func.func @loss_noise(%x: tensor<1x16x2x8x8xbf16>, %n: tensor<2x16x2x8x8xbf16>) {
  %l = megaslide.flow_matching_loss %x, %x, %n
      : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>) -> tensor<f32>
  return
}
