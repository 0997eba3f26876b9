#!/usr/bin/env bash
# Copies what the build generates from TableGen and the tree keeps: the
# references (dialects, passes) into docs/reference/, and the runtime's op
# vocabulary, which the runtime-only build compiles without TableGen, into
# include/megaslide/runtime/plan/Ops.def (docs/AddingAnOp.md).
# test/Docs/reference_current.test keeps both current.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${MEGASLIDE_BUILD_DIR:-$root/build}
mkdir -p "$root/docs/reference"
cp "$build/docs/Dialects/"*.md "$build/docs/Passes/"*.md "$root/docs/reference/"
ops=include/megaslide/runtime/plan/Ops.def
cp "$build/tools/megaslide-tblgen/Ops.def" "$root/$ops"
echo "updated: $(ls "$root/docs/reference" | tr '\n' ' ')$ops"
