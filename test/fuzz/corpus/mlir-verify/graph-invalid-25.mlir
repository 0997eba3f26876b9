func.func @split_shape(%x: tensor<1x4xbf16>) {
  %s:2 = megaslide.split %x : tensor<1x4xbf16> -> tensor<1x2xbf16>, tensor<2x2xbf16>
  return
}
