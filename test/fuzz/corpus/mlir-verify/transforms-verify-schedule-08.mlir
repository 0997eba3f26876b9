module @negative_offset {
  msched.resource @device_arena device size(4096) category("device arena")
  func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
    %s = megaslide.silu %x {msched.offsets = array<i64: -1>, msched.stream = 0 : i32} : tensor<1x8x16xbf16>
    %out = msched.d2h %s {msched.stream = 2 : i32} : tensor<1x8x16xbf16>
    return {msched.stream = 3 : i32} %out : tensor<1x8x16xbf16>
  }
}
