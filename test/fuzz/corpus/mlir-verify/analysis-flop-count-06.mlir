func.func @norms(%x: tensor<2x32x64xbf16>, %g: tensor<64xbf16>) {
  %y = megaslide.layer_norm %x : (tensor<2x32x64xbf16>) -> tensor<2x32x64xbf16>
  %z = megaslide.layer_norm %x, %g, %g
      : (tensor<2x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>) -> tensor<2x32x64xbf16>
  %dx = megaslide.layer_norm_grad %x, %y : (tensor<2x32x64xbf16>, tensor<2x32x64xbf16>) -> tensor<2x32x64xbf16>
  %dx2, %dg, %db = megaslide.layer_norm_grad %x, %z, %g, %g
      : (tensor<2x32x64xbf16>, tensor<2x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>)
        -> (tensor<2x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>)
  %r = megaslide.rms_norm %x : (tensor<2x32x64xbf16>) -> tensor<2x32x64xbf16>
  %rg = megaslide.rms_norm %x, %g : (tensor<2x32x64xbf16>, tensor<64xbf16>) -> tensor<2x32x64xbf16>
  %dr = megaslide.rms_norm_grad %x, %r : (tensor<2x32x64xbf16>, tensor<2x32x64xbf16>) -> tensor<2x32x64xbf16>
  %dr2, %dg2 = megaslide.rms_norm_grad %x, %rg, %g
      : (tensor<2x32x64xbf16>, tensor<2x32x64xbf16>, tensor<64xbf16>) -> (tensor<2x32x64xbf16>, tensor<64xbf16>)
  return
}
