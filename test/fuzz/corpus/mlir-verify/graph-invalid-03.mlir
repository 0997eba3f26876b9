megaslide.param master blocks @w : tensor<4xf32>
