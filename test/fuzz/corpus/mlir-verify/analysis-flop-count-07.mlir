func.func @elementwise(%x: tensor<1x32x64xbf16>, %v: tensor<1x64xbf16>, %b: tensor<64xbf16>,
                       %q: tensor<1x32x4x16xbf16>) {
  %m = megaslide.modulate %x, %v, %v
      : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x64xbf16>) -> tensor<1x32x64xbf16>
  %dm:3 = megaslide.modulate_grad %x, %v, %m
      : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>)
        -> (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x64xbf16>)
  %g = megaslide.gate %x, %v : (tensor<1x32x64xbf16>, tensor<1x64xbf16>) -> tensor<1x32x64xbf16>
  %dg:2 = megaslide.gate_grad %x, %v, %g
      : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>) -> (tensor<1x32x64xbf16>, tensor<1x64xbf16>)
  %ge = megaslide.gelu %x : tensor<1x32x64xbf16>
  %dge = megaslide.gelu_grad %x, %ge : tensor<1x32x64xbf16>
  %s = megaslide.silu %x : tensor<1x32x64xbf16>
  %ds = megaslide.silu_grad %x, %s : tensor<1x32x64xbf16>
  %a = megaslide.add %x, %s : tensor<1x32x64xbf16>
  %ba = megaslide.bias_add %x, %b : (tensor<1x32x64xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  %dba = megaslide.bias_add_grad %ba : tensor<1x32x64xbf16> -> tensor<64xbf16>
  %r = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>} : tensor<1x32x4x16xbf16>
  %ri = megaslide.rope3d %r {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>, inverse} : tensor<1x32x4x16xbf16>
  return
}
