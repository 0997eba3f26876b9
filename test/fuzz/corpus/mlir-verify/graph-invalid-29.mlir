func.func @concat_leading(%a: tensor<1x4xbf16>, %b: tensor<2x4xbf16>) {
  %y = megaslide.concat %a, %b : tensor<1x4xbf16>, tensor<2x4xbf16> -> tensor<1x8xbf16>
  return
}
