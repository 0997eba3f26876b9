func.func @modulate_grad_scale(%x: tensor<1x32x64xbf16>, %s: tensor<1x64xbf16>) {
  %dx, %dshift, %dscale = megaslide.modulate_grad %x, %s, %x
      : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>)
        -> (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>)
  return
}
