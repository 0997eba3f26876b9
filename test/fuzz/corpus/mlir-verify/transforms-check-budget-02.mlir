module @over_host {
  msched.resource @device_arena device size(4096) category("device arena")
  msched.resource @data_batch pinned size(67108864) category("data batch")
  msched.resource @os_allowance host size(1000000000) category("OS and runtime allowance")
  megaslide.param master blocks[0] @w : tensor<32768x16384xf32>
  megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<4096x4096xf32>
  megaslide.param moment blocks[0] @w.exp_avg_sq of @w : tensor<4096x4096xf32>
  func.func @train_step(%x: tensor<32xbf16>) -> tensor<32xbf16> {
    %dx = msched.h2d %x {msched.stream = 1 : i32} : tensor<32xbf16>
    %out = msched.d2h %dx {msched.stream = 2 : i32} : tensor<32xbf16>
    return {msched.stream = 3 : i32} %out : tensor<32xbf16>
  }
}
