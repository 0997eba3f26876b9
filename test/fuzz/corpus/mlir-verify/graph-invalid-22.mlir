func.func @split_none(%x: tensor<1x4xbf16>) {
  "megaslide.split"(%x) : (tensor<1x4xbf16>) -> ()
  return
}
