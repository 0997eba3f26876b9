module attributes {msched.host_state_policy = "persistent-bf16"} {
  megaslide.param master blocks[0] @w : tensor<16x16xf32>
  megaslide.param weight blocks[0] @w.bf16 of @w : tensor<16x16xbf16>
  megaslide.param master head @gamma : tensor<16xf32>
  megaslide.param weight head @gamma.bf16 of @gamma : tensor<16xbf16>
  func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xf32> {
    %p = megaslide.load @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    %c = megaslide.cast %p {megaslide.layer = 0 : i64} : tensor<16x16xf32> -> tensor<16x16xbf16>
    %h = megaslide.linear %x, %c {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %h32 = megaslide.cast %h : tensor<1x8x16xbf16> -> tensor<1x8x16xf32>
    %g = megaslide.load @gamma : tensor<16xf32>
    %n = megaslide.rms_norm %h32, %g : (tensor<1x8x16xf32>, tensor<16xf32>) -> tensor<1x8x16xf32>
    return %n : tensor<1x8x16xf32>
  }
}
