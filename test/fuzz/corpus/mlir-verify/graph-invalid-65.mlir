func.func @layer_norm_affine_shape(%x: tensor<1x32x64xbf16>, %g: tensor<32xbf16>) {
  %y = megaslide.layer_norm %x, %g, %g
      : (tensor<1x32x64xbf16>, tensor<32xbf16>, tensor<32xbf16>) -> tensor<1x32x64xbf16>
  return
}
