module @scheduled {
  msched.resource @weight_staging pinned size(1088) category("pinned staging")
  msched.resource @gradient_staging pinned size(1088) category("pinned staging")
  megaslide.param master blocks[0] @w0 : tensor<16x16xf32>
  megaslide.param master blocks[0] @b0 : tensor<16xf32>
  megaslide.param master blocks[1] @w1 : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>, %noise: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<f32> {
    %0 = msched.h2d %x {msched.stream = 1 : i32} : tensor<1x8x16xbf16>
    %1 = msched.record h2d
    %2 = msched.h2d %noise {msched.stream = 1 : i32} : tensor<1x8x16xbf16>
    %3 = msched.record h2d
    %4 = msched.fetch @w0 {megaslide.layer = 0 : i64, msched.stream = 1 : i32} : tensor<16x16xbf16>
    %5 = msched.record h2d
    %6 = msched.fetch @b0 {megaslide.layer = 0 : i64, msched.stream = 1 : i32} : tensor<16xbf16>
    %7 = msched.record h2d
    %8 = msched.fetch @w1 {megaslide.layer = 1 : i64, msched.stream = 1 : i32} : tensor<16x16xbf16>
    %9 = msched.record h2d
    msched.wait %1 compute
    msched.wait %5 compute
    msched.wait %7 compute
    %10 = megaslide.linear %0, %4, %6 {megaslide.layer = 0 : i64, msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>, tensor<16xbf16>) -> tensor<1x8x16xbf16>
    msched.wait %9 compute
    %11 = megaslide.linear %10, %8 {megaslide.layer = 1 : i64, msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    msched.wait %3 compute
    %12 = megaslide.flow_matching_loss %11, %0, %2 {msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
    %13 = msched.record compute
    %14 = megaslide.flow_matching_loss_grad %11, %0, %2 {msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16>
    %15 = megaslide.linear_grad_data %14, %8 {megaslide.layer = 1 : i64, msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %dw1 = megaslide.linear_grad_params %10, %14 {megaslide.layer = 1 : i64, msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<16x16xbf16>
    %16 = msched.record compute
    msched.wait %16 d2h
    %17 = msched.d2h %dw1 {megaslide.layer = 1 : i64, msched.stream = 2 : i32} : tensor<16x16xbf16>
    %18 = msched.record d2h
    msched.wait %18 host
    msched.host_adamw @w1, %17, %step {lr = 1.000000e-05 : f64, megaslide.layer = 1 : i64, msched.stream = 3 : i32} : tensor<16x16xbf16>, tensor<i64>
    %dw0, %db0 = megaslide.linear_grad_params %0, %15 {megaslide.layer = 0 : i64, msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> (tensor<16x16xbf16>, tensor<16xbf16>)
    %19 = msched.record compute
    msched.wait %19 d2h
    %20 = msched.d2h %dw0 {megaslide.layer = 0 : i64, msched.stream = 2 : i32} : tensor<16x16xbf16>
    %21 = msched.record d2h
    msched.wait %21 host
    msched.host_adamw @w0, %20, %step {lr = 1.000000e-05 : f64, megaslide.layer = 0 : i64, msched.stream = 3 : i32} : tensor<16x16xbf16>, tensor<i64>
    %22 = msched.d2h %db0 {megaslide.layer = 0 : i64, msched.stream = 2 : i32} : tensor<16xbf16>
    %23 = msched.record d2h
    msched.wait %23 host
    msched.host_adamw @b0, %22, %step {lr = 1.000000e-05 : f64, megaslide.layer = 0 : i64, msched.stream = 3 : i32} : tensor<16xbf16>, tensor<i64>
    msched.wait %13 d2h
    %24 = msched.d2h %12 {msched.stream = 2 : i32} : tensor<f32>
    %25 = msched.record d2h
    msched.wait %25 host
    return {msched.stream = 3 : i32} %24 : tensor<f32>
  }
}
