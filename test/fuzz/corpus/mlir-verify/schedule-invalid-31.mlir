func.func @empty_join() {
  %0 = msched.join
  return
}
