func.func @negative_offset() {
  msched.pack {alignment = 256 : i64, sizes = array<i64: 256>,
               starts = array<i64: 0>, ends = array<i64: 2>,
               offsets = array<i64: -256>, arena_size = 256 : i64}
  return
}
