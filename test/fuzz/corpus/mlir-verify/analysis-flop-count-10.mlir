megaslide.param master head @w : tensor<64x64xf32>
megaslide.param moment head @w.exp_avg of @w : tensor<64x64xf32>
megaslide.param moment head @w.exp_avg_sq of @w : tensor<64x64xf32>

func.func @flow_and_adamw(%x0: tensor<1x16x2x8x8xbf16>, %t: tensor<1xf32>, %pred: tensor<1x32x2x8x8xbf16>,
                          %g: tensor<64x64xbf16>, %step: tensor<i64>) -> tensor<f32> {
  %xt = megaslide.flow_interpolate %x0, %x0, %t
      : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1xf32>) -> tensor<1x16x2x8x8xbf16>
  %loss = megaslide.flow_matching_loss %pred, %x0, %xt
      : (tensor<1x32x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<f32>
  %dp = megaslide.flow_matching_loss_grad %pred, %x0, %xt
      : (tensor<1x32x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<1x32x2x8x8xbf16>
  %p = megaslide.load @w : tensor<64x64xf32>
  %m = megaslide.load @w.exp_avg : tensor<64x64xf32>
  %v = megaslide.load @w.exp_avg_sq : tensor<64x64xf32>
  %p1, %m1, %v1 = megaslide.adamw %p, %g, %m, %v, %step
      : tensor<64x64xf32>, tensor<64x64xbf16>, tensor<64x64xf32>, tensor<64x64xf32>, tensor<i64>
  return %loss : tensor<f32>
}
