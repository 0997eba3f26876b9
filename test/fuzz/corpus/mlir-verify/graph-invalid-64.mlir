func.func @layer_norm_one_affine(%x: tensor<1x32x64xbf16>, %g: tensor<64xbf16>) {
  %y = megaslide.layer_norm %x, %g : (tensor<1x32x64xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  return
}
