module @planned {
  msched.resource @device_arena device size(512) category("device arena")
  megaslide.param master blocks[0] @w : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<1x8x16xbf16> {
    msched.budget_check @device_arena budget(141000000000)
    msched.pack {alignment = 256 : i64, sizes = array<i64: 256, 256>, starts = array<i64: 0, 1>, ends = array<i64: 1, 2>,
                 offsets = array<i64: 0, 256>, arena_size = 512 : i64}
    %dx = msched.h2d %x {msched.offsets = array<i64: 0>, msched.stream = 1 : i32} : tensor<1x8x16xbf16>
    %t = msched.record h2d
    msched.wait %t compute
    %s = megaslide.silu %dx {msched.offsets = array<i64: 256>, msched.stream = 0 : i32} : tensor<1x8x16xbf16>
    %t2 = msched.record compute
    msched.wait %t2 d2h
    %out = msched.d2h %s {msched.stream = 2 : i32} : tensor<1x8x16xbf16>
    %t3 = msched.record d2h
    msched.wait %t3 host
    return {msched.stream = 3 : i32} %out : tensor<1x8x16xbf16>
  }
}
