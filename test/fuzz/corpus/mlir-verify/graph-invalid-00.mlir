megaslide.param moment blocks[0] @w.exp_avg : tensor<4xf32>
