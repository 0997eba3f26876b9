module @bf16_moments {
  megaslide.param master blocks[0] @w : tensor<16x16xf32>
  megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<16x16xf32>
  megaslide.param moment blocks[0] @w.exp_avg_sq of @w : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>, %noise: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<f32> {
    %p = megaslide.load @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    %c = megaslide.cast %p {megaslide.layer = 0 : i64} : tensor<16x16xf32> -> tensor<16x16xbf16>
    %h = megaslide.linear %x, %c {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %loss = megaslide.flow_matching_loss %h, %x, %noise : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
    %dh = megaslide.flow_matching_loss_grad %h, %x, %noise : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16>
    %dw = megaslide.linear_grad_params %x, %dh {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<16x16xbf16>
    %m = megaslide.load @w.exp_avg {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    %v = megaslide.load @w.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    %p1, %m1, %v1 = megaslide.adamw %p, %dw, %m, %v, %step {lr = 1.0e-05 : f64, megaslide.layer = 0 : i64}
        : tensor<16x16xf32>, tensor<16x16xbf16>, tensor<16x16xf32>, tensor<16x16xf32>, tensor<i64>
    megaslide.store %p1, @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    megaslide.store %m1, @w.exp_avg {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    megaslide.store %v1, @w.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    return %loss : tensor<f32>
  }
}
