megaslide.param weight blocks[0] @"blocks.0.attn1.to_q.weight.bf16" : tensor<64x64xbf16>
megaslide.param master blocks[0] @"blocks.0.attn1.to_q.weight" : tensor<64x64xf32>
megaslide.param moment blocks[0] @"blocks.0.attn1.to_q.weight.exp_avg" of @"blocks.0.attn1.to_q.weight" : tensor<64x64xf32>
megaslide.param gradient blocks[12] @"blocks.12.attn1.to_q.weight.grad" of @"blocks.12.attn1.to_q.weight" : tensor<64x64xf32>
megaslide.param master blocks[12] @"blocks.12.attn1.to_q.weight" : tensor<64x64xf32>
megaslide.param master embeddings @"patch_embedding.bias" : tensor<64xf32>
megaslide.param frozen embeddings @pos_embed : tensor<1x32x64xbf16>
megaslide.param master head @"proj_out.weight" : tensor<64x64xf32>
func.func @params() {
  return
}
