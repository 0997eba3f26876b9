func.func @adjacent(%q: tensor<1x32x2x8xbf16>, %k: tensor<1x32x2x8xbf16>, %v: tensor<1x32x2x8xbf16>,
                    %do: tensor<1x32x2x8xbf16>) -> tensor<1x32x2x8xbf16> {
  %rq = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 4, 2, 2>} : tensor<1x32x2x8xbf16>
  %rk = megaslide.rope3d %k {grid = array<i64: 2, 4, 4>, dims = array<i64: 4, 2, 2>} : tensor<1x32x2x8xbf16>
  %o = megaslide.attention %rq, %rk, %v
      : (tensor<1x32x2x8xbf16>, tensor<1x32x2x8xbf16>, tensor<1x32x2x8xbf16>) -> tensor<1x32x2x8xbf16>
  %dq, %dk, %dv = megaslide.attention_grad %rq, %rk, %v, %o, %do
      : (tensor<1x32x2x8xbf16>, tensor<1x32x2x8xbf16>, tensor<1x32x2x8xbf16>,
         tensor<1x32x2x8xbf16>, tensor<1x32x2x8xbf16>)
        -> (tensor<1x32x2x8xbf16>, tensor<1x32x2x8xbf16>, tensor<1x32x2x8xbf16>)
  return %dq : tensor<1x32x2x8xbf16>
}
