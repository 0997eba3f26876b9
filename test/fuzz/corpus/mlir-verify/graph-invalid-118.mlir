func.func @flow_scalar(%x: tensor<bf16>, %t: tensor<1xf32>) {
  %xt = megaslide.flow_interpolate %x, %x, %t : (tensor<bf16>, tensor<bf16>, tensor<1xf32>) -> tensor<bf16>
  return
}
