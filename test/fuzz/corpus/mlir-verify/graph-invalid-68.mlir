func.func @layer_norm_result(%x: tensor<1x32x64xbf16>) {
  %y = megaslide.layer_norm %x : (tensor<1x32x64xbf16>) -> tensor<32x64xbf16>
  return
}
