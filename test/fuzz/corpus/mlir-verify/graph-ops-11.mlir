func.func @flow_matching(%x0: tensor<1x16x2x8x8xbf16>, %noise: tensor<1x16x2x8x8xbf16>, %t: tensor<1xf32>,
                         %pred: tensor<1x32x2x8x8xbf16>) -> tensor<f32> {
  %xt = megaslide.flow_interpolate %x0, %noise, %t
      : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1xf32>) -> tensor<1x16x2x8x8xbf16>
  %loss = megaslide.flow_matching_loss %xt, %x0, %noise
      : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<f32>
  %dp = megaslide.flow_matching_loss_grad %pred, %x0, %noise
      : (tensor<1x32x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<1x32x2x8x8xbf16>
  return %loss : tensor<f32>
}
