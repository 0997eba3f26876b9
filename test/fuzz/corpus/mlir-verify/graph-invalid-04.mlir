megaslide.param master embeddings[0] @w : tensor<4xf32>
