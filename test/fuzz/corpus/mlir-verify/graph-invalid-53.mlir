func.func @embedding_grad_rows(%ids: tensor<2xi64>, %dy: tensor<3x64xbf16>) {
  %dt = megaslide.embedding_grad %ids, %dy : (tensor<2xi64>, tensor<3x64xbf16>) -> tensor<10x64xbf16>
  return
}
