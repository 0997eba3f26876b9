func.func @unpatchify_grid(%t: tensor<1x32x64xbf16>) {
  %y = megaslide.unpatchify %t {grid = array<i64: 2, 2, 8>, patch = array<i64: 1, 2, 2>}
      : tensor<1x32x64xbf16> -> tensor<1x16x2x8x8xbf16>
  return
}
