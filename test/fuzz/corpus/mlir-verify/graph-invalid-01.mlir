megaslide.param gradient head @w.grad : tensor<4xf32>
