module @keep {
  megaslide.param master blocks[0] @w0 : tensor<16x16xf32>
  megaslide.param master blocks[0] @b0 : tensor<16xf32>
  megaslide.param master blocks[1] @w1 : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>, %noise: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<f32> {
    %dx = msched.h2d %x : tensor<1x8x16xbf16>
    %dn = msched.h2d %noise : tensor<1x8x16xbf16>
    %w0 = msched.fetch @w0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
    %b0 = msched.fetch @b0 {megaslide.layer = 0 : i64} : tensor<16xbf16>
    %h0 = megaslide.linear %dx, %w0, %b0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>, tensor<16xbf16>) -> tensor<1x8x16xbf16>
    %w1 = msched.fetch @w1 {megaslide.layer = 1 : i64} : tensor<16x16xbf16>
    %h1 = megaslide.linear %h0, %w1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %loss = megaslide.flow_matching_loss %h1, %dx, %dn : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
    %dh1 = megaslide.flow_matching_loss_grad %h1, %dx, %dn : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16>
    %dh0 = megaslide.linear_grad_data %dh1, %w1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %dw1 = megaslide.linear_grad_params %h0, %dh1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<16x16xbf16>
    %hdw1 = msched.d2h %dw1 {megaslide.layer = 1 : i64} : tensor<16x16xbf16>
    msched.host_adamw @w1, %hdw1, %step {lr = 1.0e-05 : f64, megaslide.layer = 1 : i64} : tensor<16x16xbf16>, tensor<i64>
    %dw0, %db0 = megaslide.linear_grad_params %dx, %dh0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> (tensor<16x16xbf16>, tensor<16xbf16>)
    %hdw0 = msched.d2h %dw0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
    msched.host_adamw @w0, %hdw0, %step {lr = 1.0e-05 : f64, megaslide.layer = 0 : i64} : tensor<16x16xbf16>, tensor<i64>
    %hdb0 = msched.d2h %db0 {megaslide.layer = 0 : i64} : tensor<16xbf16>
    msched.host_adamw @b0, %hdb0, %step {lr = 1.0e-05 : f64, megaslide.layer = 0 : i64} : tensor<16xbf16>, tensor<i64>
    %hloss = msched.d2h %loss : tensor<f32>
    return %hloss : tensor<f32>
  }
}
