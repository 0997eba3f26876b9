megaslide.param master blocks[-1] @w : tensor<4xf32>
