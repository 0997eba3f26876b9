func.func @self_attention(%q: tensor<1x32x4x16xbf16>) {
  %o = megaslide.attention %q, %q, %q
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  %dq, %dk, %dv = megaslide.attention_grad %q, %q, %q, %o, %o
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
  return
}
