func.func @inclusive_end() {
  msched.pack {alignment = 256 : i64, sizes = array<i64: 256, 256>,
               starts = array<i64: 0, 2>, ends = array<i64: 2, 4>,
               offsets = array<i64: 0, 0>, arena_size = 256 : i64}
  return
}
