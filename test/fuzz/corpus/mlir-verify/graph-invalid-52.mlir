func.func @embedding_table(%ids: tensor<2xi64>, %table: tensor<640xbf16>) {
  %y = megaslide.embedding %ids, %table : (tensor<2xi64>, tensor<640xbf16>) -> tensor<2x64xbf16>
  return
}
