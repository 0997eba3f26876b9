func.func @rms_norm_scalar(%x: tensor<bf16>, %g: tensor<1xbf16>) {
  %y = megaslide.rms_norm %x, %g : (tensor<bf16>, tensor<1xbf16>) -> tensor<bf16>
  return
}
