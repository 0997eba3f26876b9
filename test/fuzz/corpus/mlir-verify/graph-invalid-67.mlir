func.func @layer_norm_eps(%x: tensor<1x32x64xbf16>) {
  %y = megaslide.layer_norm %x {eps = 0.0 : f64} : (tensor<1x32x64xbf16>) -> tensor<1x32x64xbf16>
  return
}
