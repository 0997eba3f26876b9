func.func @overlap_with_lower_neighbour() {
  msched.pack {alignment = 256 : i64, sizes = array<i64: 512, 256, 256>,
               starts = array<i64: 0, 0, 1>, ends = array<i64: 5, 5, 5>,
               offsets = array<i64: 0, 1024, 256>, arena_size = 1280 : i64}
  return
}
