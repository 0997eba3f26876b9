func.func @launch_unknown(%x: tensor<4xf32>) {
  %0 = msched.launch @nope(%x) : (tensor<4xf32>) -> tensor<4xf32>
  return
}
