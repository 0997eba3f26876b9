func.func @patch_embed(%x: tensor<1x16x2x8x8xbf16>, %w: tensor<64x16x1x2x2xf32>, %b: tensor<64xbf16>) {
  %w16 = megaslide.cast %w : tensor<64x16x1x2x2xf32> -> tensor<64x16x1x2x2xbf16>
  %t = megaslide.patch_embed %x, %w16, %b
      : (tensor<1x16x2x8x8xbf16>, tensor<64x16x1x2x2xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  %dw, %db = megaslide.patch_embed_grad %x, %t
      : (tensor<1x16x2x8x8xbf16>, tensor<1x32x64xbf16>) -> (tensor<64x16x1x2x2xbf16>, tensor<64xbf16>)
  %y = megaslide.unpatchify %t {grid = array<i64: 2, 4, 4>, patch = array<i64: 1, 2, 2>}
      : tensor<1x32x64xbf16> -> tensor<1x16x2x8x8xbf16>
  %t2 = megaslide.patchify %y {patch = array<i64: 1, 2, 2>} : tensor<1x16x2x8x8xbf16> -> tensor<1x32x64xbf16>
  %r = megaslide.reshape %t2 : tensor<1x32x64xbf16> -> tensor<32x64xbf16>
  return
}
