megaslide.param master blocks[0] @w0 : tensor<16x16xf32>
megaslide.param master blocks[0] @b0 : tensor<16xf32>
megaslide.param master blocks[1] @w1 : tensor<16x16xf32>
megaslide.param moment blocks[0] @w0.exp_avg of @w0 : tensor<16x16xf32>
megaslide.param moment blocks[0] @w0.exp_avg_sq of @w0 : tensor<16x16xf32>
megaslide.param moment blocks[0] @b0.exp_avg of @b0 : tensor<16xf32>
megaslide.param moment blocks[0] @b0.exp_avg_sq of @b0 : tensor<16xf32>
megaslide.param moment blocks[1] @w1.exp_avg of @w1 : tensor<16x16xf32>
megaslide.param moment blocks[1] @w1.exp_avg_sq of @w1 : tensor<16x16xf32>
func.func @train_step(%x: tensor<1x8x16xbf16>, %noise: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<f32> {
  %p0 = megaslide.load @w0 {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  %c0 = megaslide.cast %p0 {megaslide.layer = 0 : i64} : tensor<16x16xf32> -> tensor<16x16xbf16>
  %q0 = megaslide.load @b0 {megaslide.layer = 0 : i64} : tensor<16xf32>
  %e0 = megaslide.cast %q0 {megaslide.layer = 0 : i64} : tensor<16xf32> -> tensor<16xbf16>
  %h0 = megaslide.linear %x, %c0, %e0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>, tensor<16xbf16>) -> tensor<1x8x16xbf16>
  %p1 = megaslide.load @w1 {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  %c1 = megaslide.cast %p1 {megaslide.layer = 1 : i64} : tensor<16x16xf32> -> tensor<16x16xbf16>
  %h1 = megaslide.linear %h0, %c1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
  %loss = megaslide.flow_matching_loss %h1, %x, %noise : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
  %dh1 = megaslide.flow_matching_loss_grad %h1, %x, %noise : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16>
  %dh0 = megaslide.linear_grad_data %dh1, %c1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
  %dw1 = megaslide.linear_grad_params %h0, %dh1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<16x16xbf16>
  %dw0, %db0 = megaslide.linear_grad_params %x, %dh0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> (tensor<16x16xbf16>, tensor<16xbf16>)
  %m1 = megaslide.load @w1.exp_avg {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  %v1 = megaslide.load @w1.exp_avg_sq {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  %np1, %nm1, %nv1 = megaslide.adamw %p1, %dw1, %m1, %v1, %step {lr = 1.0e-05 : f64, megaslide.layer = 1 : i64}
      : tensor<16x16xf32>, tensor<16x16xbf16>, tensor<16x16xf32>, tensor<16x16xf32>, tensor<i64>
  megaslide.store %np1, @w1 {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  megaslide.store %nm1, @w1.exp_avg {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  megaslide.store %nv1, @w1.exp_avg_sq {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  %m0 = megaslide.load @w0.exp_avg {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  %v0 = megaslide.load @w0.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  %np0, %nm0, %nv0 = megaslide.adamw %p0, %dw0, %m0, %v0, %step {lr = 1.0e-05 : f64, weight_decay = 0.01 : f64, megaslide.layer = 0 : i64}
      : tensor<16x16xf32>, tensor<16x16xbf16>, tensor<16x16xf32>, tensor<16x16xf32>, tensor<i64>
  megaslide.store %np0, @w0 {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  megaslide.store %nm0, @w0.exp_avg {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  megaslide.store %nv0, @w0.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  %mb = megaslide.load @b0.exp_avg {megaslide.layer = 0 : i64} : tensor<16xf32>
  %vb = megaslide.load @b0.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16xf32>
  %nb, %nmb, %nvb = megaslide.adamw %q0, %db0, %mb, %vb, %step {lr = 1.0e-05 : f64, megaslide.layer = 0 : i64}
      : tensor<16xf32>, tensor<16xbf16>, tensor<16xf32>, tensor<16xf32>, tensor<i64>
  megaslide.store %nb, @b0 {megaslide.layer = 0 : i64} : tensor<16xf32>
  megaslide.store %nmb, @b0.exp_avg {megaslide.layer = 0 : i64} : tensor<16xf32>
  megaslide.store %nvb, @b0.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16xf32>
  return %loss : tensor<f32>
}
