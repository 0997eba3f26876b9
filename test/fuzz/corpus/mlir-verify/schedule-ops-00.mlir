msched.resource @device_arena device size(1048576) category("device arena")
msched.resource @weight_staging pinned size(8388608) category("pinned staging")
msched.resource @os_allowance host size(64000000000) category("OS and runtime allowance")
msched.resource @scratch transient size(0) category("scratch")
func.func @resources() {
  msched.budget_check @device_arena budget(141000000000)
  return
}
