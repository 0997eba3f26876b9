megaslide.param frozen embeddings @pos_embed : tensor<1x32x64xbf16>
func.func @adamw_frozen(%g: tensor<1x32x64xbf16>, %step: tensor<i64>) {
  msched.host_adamw @pos_embed, %g, %step : tensor<1x32x64xbf16>, tensor<i64>
  return
}
