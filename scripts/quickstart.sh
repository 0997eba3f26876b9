#!/usr/bin/env bash
# One command on a fresh Debian 12 machine: install dependencies, build,
# and run the main job on its built-in default: plan the 105B preset at
# 81 frames x 720 x 1280, simulate its step on an H200, then train the tiny
# preset for 200 steps on the CPU.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${MEGASLIDE_BUILD_DIR:-$root/build}

"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
echo
"$build/bin/megaslide-plan" --model megaslide-105b --frames 81 --height 720 --width 1280
echo
"$build/bin/megaslide-run" --model megaslide-105b --backend sim --frames 81 --height 720 --width 1280 --steps 1 --trace "$build/megaslide-105b-sim.trace.json"
echo
"$build/bin/megaslide-run" --model tiny --backend cpu --steps 200 --lr-schedule warmup-cosine --warmup-steps 20 --max-grad-norm 1.0 --metrics "$build/tiny-cpu.metrics.jsonl" --report "$build/tiny-cpu.html" --trace "$build/tiny-cpu.trace.json"
