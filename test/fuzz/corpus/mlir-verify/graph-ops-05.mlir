func.func @layer_norm(%x: tensor<1x32x64xbf16>, %g: tensor<64xbf16>, %b: tensor<64xbf16>) {
  %y = megaslide.layer_norm %x {eps = 1.0e-06 : f64} : (tensor<1x32x64xbf16>) -> tensor<1x32x64xbf16>
  %z = megaslide.layer_norm %x, %g, %b {eps = 1.0e-05 : f64}
      : (tensor<1x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  %dx = megaslide.layer_norm_grad %x, %y : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>) -> tensor<1x32x64xbf16>
  %dx2, %dg, %db = megaslide.layer_norm_grad %x, %z, %g, %b {eps = 1.0e-05 : f64}
      : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>)
        -> (tensor<1x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>)
  return
}
