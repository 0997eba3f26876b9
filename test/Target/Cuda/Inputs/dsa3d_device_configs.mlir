// 3D-DSA configurations of the device check (scripts/device-check.sh):
// small ones are checked whole against a NumPy reference, the 105B one on a
// sample of tiles, and timed.
// Not a lit test (Inputs/ is excluded).

// the tiny model's geometry
func.func @small_d16(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x32x4x16xbf16>, %v: tensor<1x32x4x16xbf16>, %do: tensor<1x32x4x16xbf16>) {
  %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 2, 4, 4>, window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, radius = 1 : i64} : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x4x2x2x2x2x2xi32>
  %o, %lse = megaslide.dsa3d %q, %k, %v, %off {grid = array<i64: 2, 4, 4>, window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>} : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %k, %v, %off, %o, %lse, %do {grid = array<i64: 2, 4, 4>, window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>} : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x4x2x2x2x2x2xi32>, tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>, tensor<1x32x4x16xbf16>) -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
  return
}

// partial border tiles, 45-key windows in one 48-key chunk, f16
func.func @borders_d64_f16(%q: tensor<1x315x2x64xf16>, %k: tensor<1x315x2x64xf16>, %v: tensor<1x315x2x64xf16>, %do: tensor<1x315x2x64xf16>) {
  %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 5, 7, 9>, window = array<i64: 3, 3, 5>, tile = array<i64: 2, 3, 4>, radius = 1 : i64} : (tensor<1x315x2x64xf16>, tensor<1x315x2x64xf16>) -> tensor<1x2x3x3x3x3x2xi32>
  %o, %lse = megaslide.dsa3d %q, %k, %v, %off {grid = array<i64: 5, 7, 9>, window = array<i64: 3, 3, 5>, tile = array<i64: 2, 3, 4>} : (tensor<1x315x2x64xf16>, tensor<1x315x2x64xf16>, tensor<1x315x2x64xf16>, tensor<1x2x3x3x3x3x2xi32>) -> (tensor<1x315x2x64xf16>, tensor<1x2x315xf32>)
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %k, %v, %off, %o, %lse, %do {grid = array<i64: 5, 7, 9>, window = array<i64: 3, 3, 5>, tile = array<i64: 2, 3, 4>} : (tensor<1x315x2x64xf16>, tensor<1x315x2x64xf16>, tensor<1x315x2x64xf16>, tensor<1x2x3x3x3x3x2xi32>, tensor<1x315x2x64xf16>, tensor<1x2x315xf32>, tensor<1x315x2x64xf16>) -> (tensor<1x315x2x64xf16>, tensor<1x315x2x64xf16>, tensor<1x315x2x64xf16>)
  return
}

// 144-key windows: two full 64-key chunks and a masked partial one, two stages
func.func @chunks_d128(%q: tensor<1x1152x2x128xbf16>, %k: tensor<1x1152x2x128xbf16>, %v: tensor<1x1152x2x128xbf16>, %do: tensor<1x1152x2x128xbf16>) {
  %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 6, 12, 16>, window = array<i64: 3, 6, 8>, tile = array<i64: 2, 3, 4>, radius = 2 : i64} : (tensor<1x1152x2x128xbf16>, tensor<1x1152x2x128xbf16>) -> tensor<1x2x3x4x4x3x2xi32>
  %o, %lse = megaslide.dsa3d %q, %k, %v, %off {grid = array<i64: 6, 12, 16>, window = array<i64: 3, 6, 8>, tile = array<i64: 2, 3, 4>} : (tensor<1x1152x2x128xbf16>, tensor<1x1152x2x128xbf16>, tensor<1x1152x2x128xbf16>, tensor<1x2x3x4x4x3x2xi32>) -> (tensor<1x1152x2x128xbf16>, tensor<1x2x1152xf32>)
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %k, %v, %off, %o, %lse, %do {grid = array<i64: 6, 12, 16>, window = array<i64: 3, 6, 8>, tile = array<i64: 2, 3, 4>} : (tensor<1x1152x2x128xbf16>, tensor<1x1152x2x128xbf16>, tensor<1x1152x2x128xbf16>, tensor<1x2x3x4x4x3x2xi32>, tensor<1x1152x2x128xbf16>, tensor<1x2x1152xf32>, tensor<1x1152x2x128xbf16>) -> (tensor<1x1152x2x128xbf16>, tensor<1x1152x2x128xbf16>, tensor<1x1152x2x128xbf16>)
  return
}

// 256-query tiles in two query blocks of 8 warps
func.func @qblocks_d32(%q: tensor<1x2048x1x32xbf16>, %k: tensor<1x2048x1x32xbf16>, %v: tensor<1x2048x1x32xbf16>, %do: tensor<1x2048x1x32xbf16>) {
  %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 8, 16, 16>, window = array<i64: 4, 8, 8>, tile = array<i64: 4, 8, 8>, radius = 1 : i64} : (tensor<1x2048x1x32xbf16>, tensor<1x2048x1x32xbf16>) -> tensor<1x1x2x2x2x4x2xi32>
  %o, %lse = megaslide.dsa3d %q, %k, %v, %off {grid = array<i64: 8, 16, 16>, window = array<i64: 4, 8, 8>, tile = array<i64: 4, 8, 8>} : (tensor<1x2048x1x32xbf16>, tensor<1x2048x1x32xbf16>, tensor<1x2048x1x32xbf16>, tensor<1x1x2x2x2x4x2xi32>) -> (tensor<1x2048x1x32xbf16>, tensor<1x1x2048xf32>)
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %k, %v, %off, %o, %lse, %do {grid = array<i64: 8, 16, 16>, window = array<i64: 4, 8, 8>, tile = array<i64: 4, 8, 8>} : (tensor<1x2048x1x32xbf16>, tensor<1x2048x1x32xbf16>, tensor<1x2048x1x32xbf16>, tensor<1x1x2x2x2x4x2xi32>, tensor<1x2048x1x32xbf16>, tensor<1x1x2048xf32>, tensor<1x2048x1x32xbf16>) -> (tensor<1x2048x1x32xbf16>, tensor<1x2048x1x32xbf16>, tensor<1x2048x1x32xbf16>)
  return
}

// head dim 96 (32-key chunks), window = grid along t
func.func @d96(%q: tensor<1x210x2x96xbf16>, %k: tensor<1x210x2x96xbf16>, %v: tensor<1x210x2x96xbf16>, %do: tensor<1x210x2x96xbf16>) {
  %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 5, 6, 7>, window = array<i64: 5, 3, 3>, tile = array<i64: 3, 3, 3>, radius = 2 : i64} : (tensor<1x210x2x96xbf16>, tensor<1x210x2x96xbf16>) -> tensor<1x2x2x2x3x5x2xi32>
  %o, %lse = megaslide.dsa3d %q, %k, %v, %off {grid = array<i64: 5, 6, 7>, window = array<i64: 5, 3, 3>, tile = array<i64: 3, 3, 3>} : (tensor<1x210x2x96xbf16>, tensor<1x210x2x96xbf16>, tensor<1x210x2x96xbf16>, tensor<1x2x2x2x3x5x2xi32>) -> (tensor<1x210x2x96xbf16>, tensor<1x2x210xf32>)
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %k, %v, %off, %o, %lse, %do {grid = array<i64: 5, 6, 7>, window = array<i64: 5, 3, 3>, tile = array<i64: 3, 3, 3>} : (tensor<1x210x2x96xbf16>, tensor<1x210x2x96xbf16>, tensor<1x210x2x96xbf16>, tensor<1x2x2x2x3x5x2xi32>, tensor<1x210x2x96xbf16>, tensor<1x2x210xf32>, tensor<1x210x2x96xbf16>) -> (tensor<1x210x2x96xbf16>, tensor<1x210x2x96xbf16>, tensor<1x210x2x96xbf16>)
  return
}

// head dim 256 (32-key chunks, fewer stages)
func.func @d256(%q: tensor<1x256x1x256xbf16>, %k: tensor<1x256x1x256xbf16>, %v: tensor<1x256x1x256xbf16>, %do: tensor<1x256x1x256xbf16>) {
  %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 4, 8, 8>, window = array<i64: 2, 4, 4>, tile = array<i64: 2, 4, 4>, radius = 1 : i64} : (tensor<1x256x1x256xbf16>, tensor<1x256x1x256xbf16>) -> tensor<1x1x2x2x2x2x2xi32>
  %o, %lse = megaslide.dsa3d %q, %k, %v, %off {grid = array<i64: 4, 8, 8>, window = array<i64: 2, 4, 4>, tile = array<i64: 2, 4, 4>} : (tensor<1x256x1x256xbf16>, tensor<1x256x1x256xbf16>, tensor<1x256x1x256xbf16>, tensor<1x1x2x2x2x2x2xi32>) -> (tensor<1x256x1x256xbf16>, tensor<1x1x256xf32>)
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %k, %v, %off, %o, %lse, %do {grid = array<i64: 4, 8, 8>, window = array<i64: 2, 4, 4>, tile = array<i64: 2, 4, 4>} : (tensor<1x256x1x256xbf16>, tensor<1x256x1x256xbf16>, tensor<1x256x1x256xbf16>, tensor<1x1x2x2x2x2x2xi32>, tensor<1x256x1x256xbf16>, tensor<1x1x256xf32>, tensor<1x256x1x256xbf16>) -> (tensor<1x256x1x256xbf16>, tensor<1x256x1x256xbf16>, tensor<1x256x1x256xbf16>)
  return
}

// the 105B video DiT at 720p, 81 frames (timed, and checked on a sample of tiles)
func.func @video_105b(%q: tensor<1x75600x96x128xbf16>, %k: tensor<1x75600x96x128xbf16>, %v: tensor<1x75600x96x128xbf16>, %do: tensor<1x75600x96x128xbf16>) {
  %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 21, 45, 80>, window = array<i64: 9, 15, 24>, tile = array<i64: 3, 5, 8>, radius = 4 : i64} : (tensor<1x75600x96x128xbf16>, tensor<1x75600x96x128xbf16>) -> tensor<1x96x7x9x10x9x2xi32>
  %o, %lse = megaslide.dsa3d %q, %k, %v, %off {grid = array<i64: 21, 45, 80>, window = array<i64: 9, 15, 24>, tile = array<i64: 3, 5, 8>} : (tensor<1x75600x96x128xbf16>, tensor<1x75600x96x128xbf16>, tensor<1x75600x96x128xbf16>, tensor<1x96x7x9x10x9x2xi32>) -> (tensor<1x75600x96x128xbf16>, tensor<1x96x75600xf32>)
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %k, %v, %off, %o, %lse, %do {grid = array<i64: 21, 45, 80>, window = array<i64: 9, 15, 24>, tile = array<i64: 3, 5, 8>} : (tensor<1x75600x96x128xbf16>, tensor<1x75600x96x128xbf16>, tensor<1x75600x96x128xbf16>, tensor<1x96x7x9x10x9x2xi32>, tensor<1x75600x96x128xbf16>, tensor<1x96x75600xf32>, tensor<1x75600x96x128xbf16>) -> (tensor<1x75600x96x128xbf16>, tensor<1x75600x96x128xbf16>, tensor<1x75600x96x128xbf16>)
  return
}
