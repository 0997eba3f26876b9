func.func @concat_type(%a: tensor<1x4xbf16>, %b: tensor<1x2xf16>) {
  %y = megaslide.concat %a, %b : tensor<1x4xbf16>, tensor<1x2xf16> -> tensor<1x6xbf16>
  return
}
