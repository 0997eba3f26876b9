func.func @valid_reuse() {
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, 1024, 0>,
               starts = array<i64: 0, 3, 1>, ends = array<i64: 2, 4, 4>,
               offsets = array<i64: 0, 0, 0>, arena_size = 1024 : i64}
  return
}
