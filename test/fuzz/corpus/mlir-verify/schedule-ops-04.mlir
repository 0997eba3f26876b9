func.func private @dsa3d_fwd_0(tensor<1x32x4x16xbf16>, tensor<1x4x2x2x2x2x2xi32>)
    -> (tensor<1x32x4x16xbf16>, tensor<1x32x4xf32>)
func.func private @barrier()

func.func @launch(%q: tensor<1x32x4x16xbf16>, %off: tensor<1x4x2x2x2x2x2xi32>) -> tensor<1x32x4x16xbf16> {
  %o:2 = msched.launch @dsa3d_fwd_0(%q, %off)
      : (tensor<1x32x4x16xbf16>, tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x32x4xf32>)
  msched.launch @barrier() : () -> ()
  return %o#0 : tensor<1x32x4x16xbf16>
}
