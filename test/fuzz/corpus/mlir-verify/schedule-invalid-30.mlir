func.func private @k(tensor<4xf32>) -> tensor<4xf32>
func.func @launch_result_types(%x: tensor<4xf32>) {
  %0:2 = msched.launch @k(%x) : (tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>)
  return
}
