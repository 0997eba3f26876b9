func.func @patch_embed_grad_channels(%x: tensor<1x16x2x8x8xbf16>, %dy: tensor<1x32x64xbf16>) {
  %dw, %db = megaslide.patch_embed_grad %x, %dy
      : (tensor<1x16x2x8x8xbf16>, tensor<1x32x64xbf16>) -> (tensor<64x8x1x2x2xbf16>, tensor<64xbf16>)
  return
}
