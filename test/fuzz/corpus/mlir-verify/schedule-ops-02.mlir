megaslide.param master blocks[0] @"blocks.0.attn1.to_q.weight" : tensor<64x64xf32>
megaslide.param weight blocks[0] @"blocks.0.attn1.to_q.weight.bf16" of @"blocks.0.attn1.to_q.weight" : tensor<64x64xbf16>
megaslide.param frozen embeddings @pos_embed : tensor<1x32x64xbf16>

func.func @transfers(%h: tensor<1x16x64xbf16>) -> tensor<64x64xbf16> {
  %w = msched.fetch @"blocks.0.attn1.to_q.weight" : tensor<64x64xbf16>
  %w32 = msched.fetch @"blocks.0.attn1.to_q.weight" {megaslide.layer = 0 : i64} : tensor<64x64xf32>
  %wb = msched.fetch @"blocks.0.attn1.to_q.weight.bf16" : tensor<64x64xbf16>
  %p = msched.fetch @pos_embed : tensor<1x32x64xf16>
  %d = msched.h2d %h : tensor<1x16x64xbf16>
  %back = msched.d2h %d : tensor<1x16x64xbf16>
  %g = msched.d2h %w : tensor<64x64xbf16>
  return %g : tensor<64x64xbf16>
}
