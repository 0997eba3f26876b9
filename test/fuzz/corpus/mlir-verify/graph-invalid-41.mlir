func.func @unpatchify_rank(%t: tensor<32x64xbf16>) {
  %y = megaslide.unpatchify %t {grid = array<i64: 2, 4, 4>, patch = array<i64: 1, 2, 2>}
      : tensor<32x64xbf16> -> tensor<1x16x2x8x8xbf16>
  return
}
