func.func @patchify_patch(%y: tensor<1x16x2x8x8xbf16>) {
  %t = megaslide.patchify %y {patch = array<i64: 1, 0, 2>} : tensor<1x16x2x8x8xbf16> -> tensor<1x32x64xbf16>
  return
}
