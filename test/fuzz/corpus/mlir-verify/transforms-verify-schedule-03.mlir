module @no_stream {
  megaslide.param master blocks[0] @w : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
    %dx = msched.h2d %x {msched.stream = 1 : i32} : tensor<1x8x16xbf16>
    %w = msched.fetch @w {megaslide.layer = 0 : i64, msched.stream = 1 : i32} : tensor<16x16xbf16>
    %h = megaslide.linear %dx, %w {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %out = msched.d2h %h {msched.stream = 2 : i32} : tensor<1x8x16xbf16>
    return {msched.stream = 3 : i32} %out : tensor<1x8x16xbf16>
  }
}
