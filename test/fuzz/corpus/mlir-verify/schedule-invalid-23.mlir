func.func @d2h_type(%x: tensor<4xbf16>) {
  %0 = "msched.d2h"(%x) : (tensor<4xbf16>) -> tensor<8xbf16>
  return
}
