func.func @store_unknown(%x: tensor<4xf32>) {
  megaslide.store %x, @nope : tensor<4xf32>
  return
}
