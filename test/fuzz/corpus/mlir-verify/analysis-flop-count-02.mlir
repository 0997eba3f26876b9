func.func @attention(%q: tensor<2x32x4x16xbf16>, %k: tensor<2x8x4x16xbf16>) {
  %o = megaslide.attention %q, %k, %k
      : (tensor<2x32x4x16xbf16>, tensor<2x8x4x16xbf16>, tensor<2x8x4x16xbf16>) -> tensor<2x32x4x16xbf16>
  %dq, %dk, %dv = megaslide.attention_grad %q, %k, %k, %o, %o
      : (tensor<2x32x4x16xbf16>, tensor<2x8x4x16xbf16>, tensor<2x8x4x16xbf16>,
         tensor<2x32x4x16xbf16>, tensor<2x32x4x16xbf16>)
        -> (tensor<2x32x4x16xbf16>, tensor<2x8x4x16xbf16>, tensor<2x8x4x16xbf16>)
  return
}
