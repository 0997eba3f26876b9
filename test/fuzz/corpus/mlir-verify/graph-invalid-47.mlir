func.func @timestep_batch(%t: tensor<2xf32>) {
  %e = megaslide.timestep_embedding %t : tensor<2xf32> -> tensor<3x256xbf16>
  return
}
