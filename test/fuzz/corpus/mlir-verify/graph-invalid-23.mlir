func.func @split_uneven(%x: tensor<1x5xbf16>) {
  %s:2 = megaslide.split %x : tensor<1x5xbf16> -> tensor<1x2xbf16>, tensor<1x3xbf16>
  return
}
