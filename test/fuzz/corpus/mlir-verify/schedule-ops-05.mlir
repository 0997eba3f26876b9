func.func @timepoints() -> !msched.timepoint {
  %a = msched.record compute
  %b = msched.record h2d
  %c = msched.record d2h
  %d = msched.record host
  msched.wait %b compute
  msched.wait %a d2h
  msched.wait %c host
  msched.wait %d h2d
  %one = msched.join %a
  %all = msched.join %a, %b, %c, %d
  return %all : !msched.timepoint
}
