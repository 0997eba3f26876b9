func.func @elementwise(%x: tensor<2x384xbf16>, %table: tensor<384xbf16>) -> tensor<384xbf16> {
  %g = megaslide.gelu %x : tensor<2x384xbf16>
  %dg = megaslide.gelu_grad %x, %g : tensor<2x384xbf16>
  %s = megaslide.silu %dg : tensor<2x384xbf16>
  %ds = megaslide.silu_grad %dg, %s : tensor<2x384xbf16>
  %a = megaslide.add %ds, %x : tensor<2x384xbf16>
  %ba = megaslide.bias_add %a, %table : (tensor<2x384xbf16>, tensor<384xbf16>) -> tensor<2x384xbf16>
  %db = megaslide.bias_add_grad %ba : tensor<2x384xbf16> -> tensor<384xbf16>
  return %db : tensor<384xbf16>
}
