#!/usr/bin/env bash
# One command on a fresh Debian 12 machine: install dependencies, build,
# and run the main job on its built-in default: plan the 105B preset at
# 81 frames x 720 x 1280.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${MEGASLIDE_BUILD_DIR:-$root/build}

"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
echo
"$build/bin/megaslide-plan" --model megaslide-105b --frames 81 --height 720 --width 1280
