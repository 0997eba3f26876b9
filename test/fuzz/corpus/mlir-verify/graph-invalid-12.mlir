megaslide.param master head @w : tensor<4xf32>
func.func @store_type(%x: tensor<4xbf16>) {
  megaslide.store %x, @w : tensor<4xbf16>
  return
}
