module @packing {
  func.func @train_step() {
    %a = megaslide.zeros {msched.stream = 0 : i32} : tensor<256xf32>
    %b = megaslide.zeros {msched.stream = 0 : i32} : tensor<60xf32>
    %c = megaslide.zeros {msched.stream = 0 : i32} : tensor<128xf32>
    %d = megaslide.zeros {msched.stream = 0 : i32} : tensor<64xf32>
    %0 = msched.d2h %a {msched.stream = 2 : i32} : tensor<256xf32>
    %1 = msched.d2h %c {msched.stream = 2 : i32} : tensor<128xf32>
    %e = megaslide.zeros {msched.stream = 0 : i32} : tensor<16xbf16>
    %2 = msched.d2h %b {msched.stream = 2 : i32} : tensor<60xf32>
    %3 = msched.d2h %e {msched.stream = 2 : i32} : tensor<16xbf16>
    %4 = msched.d2h %d {msched.stream = 2 : i32} : tensor<64xf32>
    %f = megaslide.zeros {msched.stream = 0 : i32} : tensor<384xf32>
    %g = megaslide.zeros {msched.stream = 0 : i32} : tensor<256xf32>
    %5 = msched.d2h %f {msched.stream = 2 : i32} : tensor<384xf32>
    %6 = msched.d2h %g {msched.stream = 2 : i32} : tensor<256xf32>
    return {msched.stream = 3 : i32}
  }
}
