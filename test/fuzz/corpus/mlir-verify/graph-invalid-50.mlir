func.func @timestep_rank(%t: tensor<2x1xf32>) {
  %e = megaslide.timestep_embedding %t : tensor<2x1xf32> -> tensor<2x256xbf16>
  return
}
