func.func @adamw_unknown(%g: tensor<64x64xbf16>, %step: tensor<i64>) {
  msched.host_adamw @nope, %g, %step : tensor<64x64xbf16>, tensor<i64>
  return
}
