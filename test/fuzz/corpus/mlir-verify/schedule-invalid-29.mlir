func.func private @k(tensor<4xf32>) -> tensor<4xf32>
func.func @launch_operand_types(%x: tensor<4xbf16>) {
  %0 = msched.launch @k(%x) : (tensor<4xbf16>) -> tensor<4xf32>
  return
}
