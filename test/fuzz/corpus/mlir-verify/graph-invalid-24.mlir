func.func @split_scalar(%x: tensor<bf16>) {
  %s = megaslide.split %x : tensor<bf16> -> tensor<bf16>
  return
}
