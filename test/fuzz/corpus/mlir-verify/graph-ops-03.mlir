func.func @embeddings(%x: tensor<1x16x2x8x8xbf16>, %w: tensor<64x16x1x2x2xbf16>, %b: tensor<64xbf16>,
                      %t: tensor<2xf32>, %ids: tensor<2xi64>, %table: tensor<1001x64xbf16>) {
  %tok = megaslide.patch_embed %x, %w, %b
      : (tensor<1x16x2x8x8xbf16>, tensor<64x16x1x2x2xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  %dw, %db = megaslide.patch_embed_grad %x, %tok
      : (tensor<1x16x2x8x8xbf16>, tensor<1x32x64xbf16>) -> (tensor<64x16x1x2x2xbf16>, tensor<64xbf16>)
  %lat = megaslide.unpatchify %tok {grid = array<i64: 2, 4, 4>, patch = array<i64: 1, 2, 2>}
      : tensor<1x32x64xbf16> -> tensor<1x16x2x8x8xbf16>
  %tok2 = megaslide.patchify %lat {patch = array<i64: 1, 2, 2>}
      : tensor<1x16x2x8x8xbf16> -> tensor<1x32x64xbf16>
  %e0 = megaslide.timestep_embedding %t : tensor<2xf32> -> tensor<2x256xbf16>
  %e1 = megaslide.timestep_embedding %t {time_scale = 1000.0 : f64, max_period = 5000.0 : f64}
      : tensor<2xf32> -> tensor<2x256xf32>
  %rows = megaslide.embedding %ids, %table : (tensor<2xi64>, tensor<1001x64xbf16>) -> tensor<2x64xbf16>
  %dtable = megaslide.embedding_grad %ids, %rows : (tensor<2xi64>, tensor<2x64xbf16>) -> tensor<1001x64xbf16>
  return
}
