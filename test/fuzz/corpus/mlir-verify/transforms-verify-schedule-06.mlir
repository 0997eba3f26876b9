module @offsets_count {
  msched.resource @device_arena device size(1024) category("device arena")
  func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x8xbf16> {
    %dx = msched.h2d %x {msched.offsets = array<i64: 0>, msched.stream = 1 : i32} : tensor<1x8x16xbf16>
    %a, %b = megaslide.split %dx {msched.offsets = array<i64: 256>, msched.stream = 0 : i32} : tensor<1x8x16xbf16> -> tensor<1x8x8xbf16>, tensor<1x8x8xbf16>
    %out = msched.d2h %a {msched.stream = 2 : i32} : tensor<1x8x8xbf16>
    return {msched.stream = 3 : i32} %out : tensor<1x8x8xbf16>
  }
}
