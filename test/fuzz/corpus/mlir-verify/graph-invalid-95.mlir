func.func @attention_result(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x8x4x16xbf16>) {
  %o = megaslide.attention %q, %k, %k
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>) -> tensor<1x8x4x16xbf16>
  return
}
