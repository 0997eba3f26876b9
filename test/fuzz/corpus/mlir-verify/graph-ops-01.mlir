megaslide.param master blocks[0] @w : tensor<64xf32>
megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<64xf32>
megaslide.param moment blocks[0] @w.exp_avg_sq of @w : tensor<64xf32>

func.func @load_store_adamw(%g: tensor<64xbf16>, %step: tensor<i64>) {
  %p = megaslide.load @w : tensor<64xf32>
  %m = megaslide.load @w.exp_avg : tensor<64xf32>
  %v = megaslide.load @w.exp_avg_sq : tensor<64xf32>
  %p1, %m1, %v1 = megaslide.adamw %p, %g, %m, %v, %step
      : tensor<64xf32>, tensor<64xbf16>, tensor<64xf32>, tensor<64xf32>, tensor<i64>
  %p2, %m2, %v2 = megaslide.adamw %p1, %g, %m1, %v1, %step
      {lr = 2.0e-04 : f64, beta1 = 0.8 : f64, beta2 = 0.95 : f64,
       eps = 1.0e-06 : f64, weight_decay = 0.01 : f64}
      : tensor<64xf32>, tensor<64xbf16>, tensor<64xf32>, tensor<64xf32>, tensor<i64>
  megaslide.store %p2, @w : tensor<64xf32>
  megaslide.store %m2, @w.exp_avg : tensor<64xf32>
  megaslide.store %v2, @w.exp_avg_sq : tensor<64xf32>
  return
}
