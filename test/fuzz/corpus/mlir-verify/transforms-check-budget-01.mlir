module @over_device_offloaded attributes {msched.activation_policy = ["offload"]} {
  msched.resource @device_arena device size(872415232) category("device arena")
  megaslide.param master blocks[0] @w : tensor<32768x8192xf32>
  func.func @train_step(%x: tensor<4096x8192xbf16>) -> tensor<4096x32768xbf16> {
    %dx = msched.h2d %x {msched.stream = 1 : i32} : tensor<4096x8192xbf16>
    %w = msched.fetch @w {megaslide.layer = 0 : i64, msched.stream = 1 : i32} : tensor<32768x8192xbf16>
    %h = megaslide.linear %dx, %w {megaslide.layer = 0 : i64, msched.stream = 0 : i32} : (tensor<4096x8192xbf16>, tensor<32768x8192xbf16>) -> tensor<4096x32768xbf16>
    %g = megaslide.gelu %h {megaslide.layer = 0 : i64, msched.stream = 0 : i32} : tensor<4096x32768xbf16>
    %out = msched.d2h %g {msched.stream = 2 : i32} : tensor<4096x32768xbf16>
    return {msched.stream = 3 : i32} %out : tensor<4096x32768xbf16>
  }
}
