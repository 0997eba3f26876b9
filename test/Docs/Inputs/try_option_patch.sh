#!/usr/bin/env bash
# Tries a patch that adds a planning option (docs/AddingAnOption.md) the
# way a contributor would: applies it to a copy of the tree, builds the
# copy (ccache serves what the patch does not change), shows the option as
# a megaslide-plan flag, a Python / C API key, a megaslide-opt option and
# in the listing, and runs the tests the patch adds. Nothing else is
# edited, so this shows that the patch's files are all it takes.
#   usage: try_option_patch.sh PATCH OPTION-NAME
# Takes minutes (a configure and a build), so CI does not run it.
set -euo pipefail
patch=$(realpath "$1")
option=$2
key=${option//-/_}
src=$(cd "$(dirname "$0")/../../.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/megaslide-option.XXXXXX")
git -C "$src" ls-files -z --cached --others --exclude-standard |
  (cd "$src" && tar --null -T - -cf -) | tar -xf - -C "$work"
(cd "$work" && git apply "$patch")
# Paths relative to the copy, as scripts/build.sh has them for the tree.
export CCACHE_BASEDIR=$work
python=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')
cmake -G Ninja -S "$work" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
  -DPython3_EXECUTABLE="$python" > "$work/configure.log"
cmake --build "$work/build" -j"${JOBS:-2}" --target megaslide-plan \
  megaslide-opt _megaslide megaslide-option-reference
bin=$work/build/bin
echo "== megaslide-plan flag"
"$bin/megaslide-plan" --help | grep -e "--$option"
echo "== Python and C API key"
PYTHONPATH=$work/build/python_packages "$python" -c \
  "import megaslide; print(megaslide.PLAN_OPTIONS['$key'])"
echo "== megaslide-opt (pipelines and passes)"
"$bin/megaslide-opt" --help | grep -e "--$option=" | tr -s ' '
echo "== listing ($work/build/docs/PipelineOptions.md)"
grep -e "\`$option\`" "$work/build/docs/PipelineOptions.md"
echo "== the patch's tests"
tests=$(sed -nE 's#^\+\+\+ b/(test/.*\.(mlir|test))$#\1#p' "$patch")
/usr/lib/llvm-22/bin/lit -v ${tests:+$(printf "$work/build/%s " $tests)}
echo "ok: $work"
