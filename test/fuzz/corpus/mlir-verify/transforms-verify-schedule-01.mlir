module @store_left {
  megaslide.param master blocks[0] @w : tensor<16x16xf32>
  func.func @train_step(%p: tensor<16x16xf32>) {
    megaslide.store %p, @w : tensor<16x16xf32>
    return
  }
}
