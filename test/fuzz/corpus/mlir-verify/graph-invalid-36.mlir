func.func @patch_embed_bias(%x: tensor<1x16x2x8x8xbf16>, %w: tensor<64x16x1x2x2xbf16>, %b: tensor<32xbf16>) {
  %t = megaslide.patch_embed %x, %w, %b
      : (tensor<1x16x2x8x8xbf16>, tensor<64x16x1x2x2xbf16>, tensor<32xbf16>) -> tensor<1x32x64xbf16>
  return
}
