func.func @zero_budget() {
  msched.budget_check @device_arena budget(0)
  return
}
