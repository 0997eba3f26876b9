module @persistent_bf16 {
  megaslide.param master blocks[0] @w : tensor<16x16xf32>
  megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<16x16xf32>
  megaslide.param moment blocks[0] @w.exp_avg_sq of @w : tensor<16x16xf32>
  megaslide.param frozen embeddings @pos_embed : tensor<1x8x16xbf16>
  megaslide.param master head @proj.weight : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
    %p = megaslide.load @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    %c = megaslide.cast %p {megaslide.layer = 0 : i64} : tensor<16x16xf32> -> tensor<16x16xbf16>
    %h = megaslide.linear %x, %c {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    return %h : tensor<1x8x16xbf16>
  }
}
