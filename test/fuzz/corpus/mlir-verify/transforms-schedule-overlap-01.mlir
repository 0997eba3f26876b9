module @recompute {
  megaslide.param master embeddings @emb : tensor<16x16xf32>
  megaslide.param master blocks[0] @w0 : tensor<16x16xf32>
  megaslide.param master blocks[1] @w1 : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>, %noise: tensor<1x8x16xbf16>) -> tensor<f32> {
    %dx = msched.h2d %x : tensor<1x8x16xbf16>
    %dn = msched.h2d %noise : tensor<1x8x16xbf16>
    %e = msched.fetch @emb : tensor<16x16xbf16>
    %h = megaslide.linear %dx, %e : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %w0 = msched.fetch @w0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
    %h0 = megaslide.linear %h, %w0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %w1 = msched.fetch @w1 {megaslide.layer = 1 : i64} : tensor<16x16xbf16>
    %h1 = megaslide.linear %h0, %w1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %loss = megaslide.flow_matching_loss %h1, %dx, %dn : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
    %g = megaslide.flow_matching_loss_grad %h1, %dx, %dn : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16>
    %w1b = msched.fetch @w1 {megaslide.layer = 1 : i64} : tensor<16x16xbf16>
    %d0 = megaslide.linear_grad_data %g, %w1b {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %w0b = msched.fetch @w0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
    %d = megaslide.linear_grad_data %d0, %w0b {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %hloss = msched.d2h %loss : tensor<f32>
    return %hloss : tensor<f32>
  }
}
