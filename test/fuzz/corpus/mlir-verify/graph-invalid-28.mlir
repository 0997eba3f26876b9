func.func @concat_scalar(%x: tensor<bf16>) {
  %y = megaslide.concat %x, %x : tensor<bf16>, tensor<bf16> -> tensor<2xbf16>
  return
}
