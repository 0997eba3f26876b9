func.func @flow_noise(%x: tensor<1x16x2x8x8xbf16>, %n: tensor<1x16x2x8x4xbf16>, %t: tensor<1xf32>) {
  %xt = megaslide.flow_interpolate %x, %n, %t
      : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x4xbf16>, tensor<1xf32>) -> tensor<1x16x2x8x8xbf16>
  return
}
