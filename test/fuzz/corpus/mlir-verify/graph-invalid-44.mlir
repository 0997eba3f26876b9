func.func @patchify_rank(%y: tensor<16x2x8x8xbf16>) {
  %t = megaslide.patchify %y {patch = array<i64: 1, 2, 2>} : tensor<16x2x8x8xbf16> -> tensor<1x32x64xbf16>
  return
}
