func.func @self_and_cross(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x32x4x16xbf16>, %v: tensor<1x32x4x16xbf16>,
                          %tk: tensor<1x8x4x16xbf16>, %tv: tensor<1x8x4x16xbf16>, %do: tensor<1x32x4x16xbf16>)
    -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) {
  %rq = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>, megaslide.layer = 0 : i64} : tensor<1x32x4x16xbf16>
  %rk = megaslide.rope3d %k {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>, megaslide.layer = 0 : i64} : tensor<1x32x4x16xbf16>
  %o = megaslide.attention %rq, %rk, %v {scale = 0.25 : f64, megaslide.layer = 0 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  %c = megaslide.attention %o, %tk, %tv {megaslide.layer = 0 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  %dq, %dk, %dv = megaslide.attention_grad %rq, %rk, %v, %o, %do {scale = 0.25 : f64, megaslide.layer = 0 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
  %cq, %ck, %cv = megaslide.attention_grad %o, %tk, %tv, %c, %do {megaslide.layer = 0 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>)
  return %c, %dq, %dk, %dv : tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>
}
