func.func @attention_value(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x8x4x16xbf16>, %v: tensor<1x16x4x16xbf16>) {
  %o = megaslide.attention %q, %k, %v
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x16x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  return
}
