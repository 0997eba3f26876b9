func.func @patch_embed_divisible(%x: tensor<1x16x2x9x8xbf16>, %w: tensor<64x16x1x2x2xbf16>, %b: tensor<64xbf16>) {
  %t = megaslide.patch_embed %x, %w, %b
      : (tensor<1x16x2x9x8xbf16>, tensor<64x16x1x2x2xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  return
}
