func.func @timestep_period(%t: tensor<2xf32>) {
  %e = megaslide.timestep_embedding %t {max_period = 1.0 : f64} : tensor<2xf32> -> tensor<2x256xbf16>
  return
}
