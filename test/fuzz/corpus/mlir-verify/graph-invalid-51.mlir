func.func @embedding_result(%ids: tensor<2xi64>, %table: tensor<10x64xbf16>) {
  %y = megaslide.embedding %ids, %table : (tensor<2xi64>, tensor<10x64xbf16>) -> tensor<2x32xbf16>
  return
}
