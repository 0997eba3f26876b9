func.func @flow_timesteps(%x: tensor<2x16x2x8x8xbf16>, %t: tensor<1xf32>) {
  %xt = megaslide.flow_interpolate %x, %x, %t
      : (tensor<2x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<1xf32>) -> tensor<2x16x2x8x8xbf16>
  return
}
