#!/usr/bin/env bash
# Copies the references generated from TableGen by the build into docs/reference/,
# where a lit test (test/Docs/reference_current.test) keeps them current.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${MEGASLIDE_BUILD_DIR:-$root/build}
mkdir -p "$root/docs/reference"
cp "$build/docs/Dialects/"*.md "$root/docs/reference/"
echo "updated: $(ls "$root/docs/reference")"
