func.func @timestep_odd(%t: tensor<2xf32>) {
  %e = megaslide.timestep_embedding %t : tensor<2xf32> -> tensor<2x255xbf16>
  return
}
