func.func @conditioning(%t: tensor<2xf32>, %ids: tensor<2xi64>, %table: tensor<1001x64xbf16>) {
  %e = megaslide.timestep_embedding %t : tensor<2xf32> -> tensor<2x256xbf16>
  %rows = megaslide.embedding %ids, %table : (tensor<2xi64>, tensor<1001x64xbf16>) -> tensor<2x64xbf16>
  %dt = megaslide.embedding_grad %ids, %rows : (tensor<2xi64>, tensor<2x64xbf16>) -> tensor<1001x64xbf16>
  return
}
