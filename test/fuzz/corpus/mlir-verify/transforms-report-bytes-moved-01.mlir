module @offload {
  megaslide.param master blocks[0] @w0 : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>, %noise: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<f32> {
    %dx = msched.h2d %x : tensor<1x8x16xbf16>
    %dn = msched.h2d %noise : tensor<1x8x16xbf16>
    %w0 = msched.fetch @w0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
    %h0 = megaslide.linear %dx, %w0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %c0 = msched.d2h %dx {megaslide.layer = 0 : i64} : tensor<1x8x16xbf16>
    %loss = megaslide.flow_matching_loss %h0, %dx, %dn : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
    %r0 = msched.h2d %c0 {megaslide.layer = 0 : i64} : tensor<1x8x16xbf16>
    %w0b = msched.fetch @w0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
    %h0b = megaslide.linear %r0, %w0b {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %dh0 = megaslide.flow_matching_loss_grad %h0b, %r0, %dn : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16>
    %dw0 = megaslide.linear_grad_params %r0, %dh0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<16x16xbf16>
    %hdw0 = msched.d2h %dw0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
    msched.host_adamw @w0, %hdw0, %step {lr = 1.000000e-05 : f64, megaslide.layer = 0 : i64} : tensor<16x16xbf16>, tensor<i64>
    %hloss = msched.d2h %loss : tensor<f32>
    return %hloss : tensor<f32>
  }
}
