module @dsa3d {
  func.func @train_step(%arg0: tensor<1x8x2x16xbf16>) -> (tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>) {
    %q = msched.h2d %arg0 {msched.stream = 1 : i32} : tensor<1x8x2x16xbf16>
    %off = megaslide.dsa3d_offsets %q, %q {grid = array<i64: 2, 2, 2>,
        window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, radius = 1 : i64, msched.stream = 0 : i32}
        : (tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>) -> tensor<1x2x2x1x1x2x2xi32>
    %o, %lse = megaslide.dsa3d %q, %q, %q, %off {grid = array<i64: 2, 2, 2>,
        window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, msched.stream = 0 : i32}
        : (tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>,
           tensor<1x2x2x1x1x2x2xi32>) -> (tensor<1x8x2x16xbf16>, tensor<1x2x8xf32>)
    %do = megaslide.zeros {msched.stream = 0 : i32} : tensor<1x8x2x16xbf16>
    %dq, %dk, %dv = megaslide.dsa3d_grad %q, %q, %q, %off, %o, %lse, %do {
        grid = array<i64: 2, 2, 2>, window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>,
        msched.stream = 0 : i32}
        : (tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>,
           tensor<1x2x2x1x1x2x2xi32>, tensor<1x8x2x16xbf16>, tensor<1x2x8xf32>,
           tensor<1x8x2x16xbf16>)
          -> (tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>)
    %0 = msched.d2h %dq {msched.stream = 2 : i32} : tensor<1x8x2x16xbf16>
    %1 = msched.d2h %dk {msched.stream = 2 : i32} : tensor<1x8x2x16xbf16>
    %2 = msched.d2h %dv {msched.stream = 2 : i32} : tensor<1x8x2x16xbf16>
    return {msched.stream = 3 : i32} %0, %1, %2 : tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>
  }
}
