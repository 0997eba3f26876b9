func.func @attention_grad_dk(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x8x4x16xbf16>) {
  %dq, %dk, %dv = megaslide.attention_grad %q, %k, %k, %q, %q
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>,
         tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>)
  return
}
