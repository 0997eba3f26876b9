megaslide.param frozen embeddings @pos_embed : tensor<1x8x16xbf16>
megaslide.param master head @gamma : tensor<16xf32>
func.func @train_step(%x: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<1x8x16xbf16> {
  %pos = megaslide.load @pos_embed : tensor<1x8x16xbf16>
  %a = megaslide.add %x, %pos : tensor<1x8x16xbf16>
  %g = megaslide.load @gamma : tensor<16xf32>
  %a32 = megaslide.cast %a : tensor<1x8x16xbf16> -> tensor<1x8x16xf32>
  %n = megaslide.rms_norm %a32, %g : (tensor<1x8x16xf32>, tensor<16xf32>) -> tensor<1x8x16xf32>
  %gb = megaslide.cast %g : tensor<16xf32> -> tensor<16xbf16>
  %m = megaslide.rms_norm %a, %gb : (tensor<1x8x16xbf16>, tensor<16xbf16>) -> tensor<1x8x16xbf16>
  return %m : tensor<1x8x16xbf16>
}
