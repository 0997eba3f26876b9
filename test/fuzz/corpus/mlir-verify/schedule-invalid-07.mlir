func.func @negative_start() {
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024>,
               starts = array<i64: -1>, ends = array<i64: 2>}
  return
}
