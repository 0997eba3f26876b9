func.func @reversed_lifetime() {
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, 512>,
               starts = array<i64: 0, 3>, ends = array<i64: 2, 2>}
  return
}
