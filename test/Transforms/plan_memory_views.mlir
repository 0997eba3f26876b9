// RUN: megaslide-opt %s --megaslide-plan-memory | FileCheck %s

// Tests that a device reshape of a value that is not on the device (a
// batch argument) is a buffer of its own rather than a view, and that
// planning it does not crash.
// CHECK: msched.resource @device_arena device size(512)
// CHECK-LABEL: func.func @train_step
// CHECK: megaslide.reshape %arg0 {msched.offsets = array<i64: 0>, msched.stream = 0 : i32}
module {
  func.func @train_step(%arg0: tensor<1x8x32xbf16>) -> tensor<8x32xbf16> {
    %r = megaslide.reshape %arg0 {msched.stream = 0 : i32} : tensor<1x8x32xbf16> -> tensor<8x32xbf16>
    %h = msched.d2h %r {msched.stream = 2 : i32} : tensor<8x32xbf16>
    return {msched.stream = 3 : i32} %h : tensor<8x32xbf16>
  }
}
