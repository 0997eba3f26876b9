megaslide.param master blocks[0] @w : tensor<64x64xf32>
megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<64x64xf32>
megaslide.param moment blocks[0] @w.exp_avg_sq of @w : tensor<64x64xf32>

func.func @host_adamw(%g: tensor<64x64xbf16>, %step: tensor<i64>) {
  msched.host_adamw @w, %g, %step : tensor<64x64xbf16>, tensor<i64>
  msched.host_adamw @w, %g, %step {lr = 1.0e-05 : f64, beta1 = 0.8 : f64,
      beta2 = 0.95 : f64, eps = 1.0e-06 : f64, weight_decay = 0.01 : f64}
      : tensor<64x64xbf16>, tensor<i64>
  msched.host_adamw @w, %g, %step {lr = 1.0e-04 : f64, beta1 = 0.9 : f64}
      : tensor<64x64xbf16>, tensor<i64>
  return
}
