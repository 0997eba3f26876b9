func.func @add_types(%a: tensor<4xbf16>, %b: tensor<4xf32>) {
  %y = "megaslide.add"(%a, %b) : (tensor<4xbf16>, tensor<4xf32>) -> tensor<4xbf16>
  return
}
