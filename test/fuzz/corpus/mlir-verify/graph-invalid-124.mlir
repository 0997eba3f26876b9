func.func @attention_negative_scale(%q: tensor<1x8x2x4xbf16>) -> tensor<1x8x2x4xbf16> {
  %o = megaslide.attention %q, %q, %q {scale = -1.0 : f64}
      : (tensor<1x8x2x4xbf16>, tensor<1x8x2x4xbf16>, tensor<1x8x2x4xbf16>) -> tensor<1x8x2x4xbf16>
  return %o : tensor<1x8x2x4xbf16>
}
