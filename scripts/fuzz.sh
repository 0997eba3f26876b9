#!/usr/bin/env bash
# Runs MegaSlide's libFuzzer targets (test/fuzz, docs/Testing.md) for a
# bounded time and fails on any crash, sanitizer report, leak or timeout.
#
#   scripts/fuzz.sh [TARGET...]     (default: every target)
#
# Targets: the folders of test/fuzz/corpus/, one per fuzz target of
# test/fuzz/CMakeLists.txt, built by the sanitize build (scripts/sanitize.sh builds them into build-sanitize/;
# $MEGASLIDE_FUZZ_BUILD_DIR names another clang build). For each target the
# script first replays test/fuzz/regressions/<target>/ (every crash found so
# far must stay fixed), then fuzzes a scratch copy of
# test/fuzz/corpus/<target>/ for at most FUZZ_RUNS executions (default
# 100000) and FUZZ_SECONDS seconds (default 60), whichever comes first.
# A crashing input is left in <build>/fuzz/<target>/artifacts/; fix the
# bug, then copy the input into test/fuzz/regressions/<target>/.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${MEGASLIDE_FUZZ_BUILD_DIR:-$root/build-sanitize}
runs=${FUZZ_RUNS:-100000}
seconds=${FUZZ_SECONDS:-60}
# Every target has a seed corpus, test/fuzz/corpus/<target>/.
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for corpus in "$root"/test/fuzz/corpus/*/; do
    targets+=("$(basename "$corpus")")
  done
fi

# Abort (and so fail) on the first sanitizer report; ASan's leak check
# stays on: LLVM's process-wide state is reachable at exit, not leaked.
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_stack_use_after_return=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

status=0
total=0
for target in "${targets[@]}"; do
  bin="$build/bin/megaslide-fuzz-$target"
  if [ ! -x "$bin" ]; then
    echo "fuzz.sh: $bin not found; build it with scripts/sanitize.sh" >&2
    status=1
    continue
  fi
  work="$build/fuzz/$target"
  rm -rf "$work"
  mkdir -p "$work/corpus" "$work/artifacts"
  cp "$root/test/fuzz/corpus/$target/"* "$work/corpus/"
  regressions="$root/test/fuzz/regressions/$target"
  flags=(-timeout=10 -rss_limit_mb=4096 -artifact_prefix="$work/artifacts/")

  echo "==== fuzz $target"
  if compgen -G "$regressions/*" > /dev/null; then
    if ! "$bin" "${flags[@]}" "$regressions"/* > "$work/regressions.log" 2>&1; then
      tail -n 40 "$work/regressions.log"
      echo "FAIL: a regression input of $target crashes again (log: $work/regressions.log)"
      status=1
      continue
    fi
    echo "regressions: $(ls "$regressions" | wc -l) inputs replayed, no crash"
  fi
  start=$(date +%s)
  if "$bin" "${flags[@]}" -runs="$runs" -max_total_time="$seconds" \
      -print_final_stats=1 "$work/corpus" > "$work/fuzz.log" 2>&1; then
    result=ok
  else
    result=FAIL
    status=1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/fuzz.log" | tail -1)
  execs=${execs:-0}
  total=$((total + execs))
  echo "$target: $execs executions in $(($(date +%s) - start)) s," \
    "corpus $(ls "$work/corpus" | wc -l) inputs: $result"
  if [ $result = FAIL ]; then
    grep -m1 -A30 -E "ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:|deadly signal|fuzz-[a-z-]+:" "$work/fuzz.log"
    echo "crash input(s): $(ls "$work/artifacts")  (in $work/artifacts; log: $work/fuzz.log)"
    echo "fix the bug, then copy the input into test/fuzz/regressions/$target/"
  fi
done
echo
echo "fuzz.sh: $total executions in all"
[ $status -eq 0 ] && echo "Fuzzing: no crash." || echo "Fuzzing: FAILED."
exit $status
