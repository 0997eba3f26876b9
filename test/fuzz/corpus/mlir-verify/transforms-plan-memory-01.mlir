module @views {
  msched.resource @device_arena device size(1) category("device arena")
  func.func @train_step(%arg0: tensor<1x8x32xbf16>) -> tensor<1x8x2x16xbf16> {
    msched.pack {alignment = 256 : i64, sizes = array<i64>, starts = array<i64>, ends = array<i64>}
    %in = msched.h2d %arg0 {msched.stream = 1 : i32} : tensor<1x8x32xbf16>
    %x = megaslide.silu %in {msched.stream = 0 : i32} : tensor<1x8x32xbf16>
    %r = megaslide.reshape %x {msched.stream = 0 : i32} : tensor<1x8x32xbf16> -> tensor<1x8x2x16xbf16>
    %y = megaslide.silu %in {msched.stream = 0 : i32} : tensor<1x8x32xbf16>
    %0 = msched.d2h %r {msched.stream = 2 : i32} : tensor<1x8x2x16xbf16>
    %o = megaslide.attention %r, %r, %r {msched.stream = 0 : i32} : (tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>) -> tensor<1x8x2x16xbf16>
    %1 = msched.d2h %o {msched.stream = 2 : i32} : tensor<1x8x2x16xbf16>
    return {msched.stream = 3 : i32} %1 : tensor<1x8x2x16xbf16>
  }
}
