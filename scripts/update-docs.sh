#!/usr/bin/env bash
# Copies the references the build generates from TableGen (dialects, passes)
# into docs/reference/, where test/Docs/reference_current.test keeps them
# current.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${MEGASLIDE_BUILD_DIR:-$root/build}
mkdir -p "$root/docs/reference"
cp "$build/docs/Dialects/"*.md "$build/docs/Passes/"*.md "$root/docs/reference/"
echo "updated: $(ls "$root/docs/reference" | tr '\n' ' ')"
