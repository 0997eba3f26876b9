megaslide.param master head @w : tensor<4xf32>
megaslide.param master head @w2 of @w : tensor<4xf32>
