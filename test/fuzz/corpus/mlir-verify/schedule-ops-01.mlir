func.func @pack() {
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, 512>,
               starts = array<i64: 0, 1>, ends = array<i64: 2, 3>}
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, 512>,
               starts = array<i64: 0, 1>, ends = array<i64: 2, 3>,
               offsets = array<i64: 0, 1024>, arena_size = 1536 : i64}
  msched.pack {alignment = 64 : i64, sizes = array<i64>, starts = array<i64>, ends = array<i64>}
  return
}
