func.func @loss_type(%x: tensor<1x16x2x8x8xbf16>) {
  %l = megaslide.flow_matching_loss %x, %x, %x
      : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<bf16>
  return
}
