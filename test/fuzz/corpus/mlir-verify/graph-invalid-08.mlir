func.func @load_unknown() -> tensor<4xf32> {
  %0 = megaslide.load @nope : tensor<4xf32>
  return %0 : tensor<4xf32>
}
