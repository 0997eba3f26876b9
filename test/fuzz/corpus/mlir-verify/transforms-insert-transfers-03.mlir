module {
  func.func @step() {
    return
  }
}
