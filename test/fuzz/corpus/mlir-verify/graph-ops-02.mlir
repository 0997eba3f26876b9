func.func @structural(%x: tensor<1x128xf32>) -> tensor<1x128xbf16> {
  %c = megaslide.cast %x : tensor<1x128xf32> -> tensor<1x128xbf16>
  %r = megaslide.reshape %c : tensor<1x128xbf16> -> tensor<2x4x16xbf16>
  %s:2 = megaslide.split %c : tensor<1x128xbf16> -> tensor<1x64xbf16>, tensor<1x64xbf16>
  %z = megaslide.zeros : tensor<1x32xbf16>
  %y = megaslide.concat %s#1, %z, %s#0 : tensor<1x64xbf16>, tensor<1x32xbf16>, tensor<1x64xbf16> -> tensor<1x160xbf16>
  %s2:2 = megaslide.split %r : tensor<2x4x16xbf16> -> tensor<2x4x8xbf16>, tensor<2x4x8xbf16>
  %s1 = megaslide.split %c : tensor<1x128xbf16> -> tensor<1x128xbf16>
  return %s1 : tensor<1x128xbf16>
}
