megaslide.param master head @w : tensor<4xbf16>
