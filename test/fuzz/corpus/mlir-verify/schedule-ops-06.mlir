func.func @annotations(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
  %d = msched.h2d %x {msched.stream = 1 : i32, msched.offsets = array<i64: 0>} : tensor<1x8x16xbf16>
  %s = megaslide.silu %d {msched.stream = 0 : i32, msched.offsets = array<i64: 256>, msched.checkpoint = 0 : i64} : tensor<1x8x16xbf16>
  return %s : tensor<1x8x16xbf16>
}
