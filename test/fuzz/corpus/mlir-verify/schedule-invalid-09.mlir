func.func @no_arena_size() {
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, 512>,
               starts = array<i64: 0, 1>, ends = array<i64: 2, 3>,
               offsets = array<i64: 0, 1024>}
  return
}
