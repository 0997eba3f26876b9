func.func @gate_grad_dx(%x: tensor<1x32x64xbf16>, %g: tensor<1x64xbf16>, %dx: tensor<1x64xbf16>) {
  %a, %b = megaslide.gate_grad %x, %g, %x
      : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>) -> (tensor<1x64xbf16>, tensor<1x64xbf16>)
  return
}
