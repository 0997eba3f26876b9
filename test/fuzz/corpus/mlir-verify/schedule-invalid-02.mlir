func.func @zero_alignment() {
  msched.pack {alignment = 0 : i64, sizes = array<i64: 1024>, starts = array<i64: 0>, ends = array<i64: 2>}
  return
}
