func.func @concat_rank(%a: tensor<1x4xbf16>, %b: tensor<4xbf16>) {
  %y = megaslide.concat %a, %b : tensor<1x4xbf16>, tensor<4xbf16> -> tensor<1x8xbf16>
  return
}
