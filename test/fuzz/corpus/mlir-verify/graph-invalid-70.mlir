func.func @layer_norm_grad_one_affine(%x: tensor<1x32x64xbf16>, %g: tensor<64xbf16>) {
  %dx, %dg = megaslide.layer_norm_grad %x, %x, %g
      : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>, tensor<64xbf16>) -> (tensor<1x32x64xbf16>, tensor<64xbf16>)
  return
}
