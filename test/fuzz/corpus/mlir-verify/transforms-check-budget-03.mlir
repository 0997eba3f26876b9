module @fits {
  msched.resource @device_arena device size(463129088) category("device arena")
  megaslide.param master blocks[0] @w : tensor<1024xf32>
  func.func @train_step(%x: tensor<32xbf16>) -> tensor<32xbf16> {
    msched.budget_check @device_arena budget(141000000000)
    %dx = msched.h2d %x {msched.stream = 1 : i32} : tensor<32xbf16>
    %out = msched.d2h %dx {msched.stream = 2 : i32} : tensor<32xbf16>
    return {msched.stream = 3 : i32} %out : tensor<32xbf16>
  }
}
