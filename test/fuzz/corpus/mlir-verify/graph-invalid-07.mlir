megaslide.param frozen head @ids : tensor<4xi32>
