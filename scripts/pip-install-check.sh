#!/usr/bin/env bash
# Checks the packaging: `pip install .` into a fresh virtual environment,
# then the Python tests (test/python) against the installed package, not
# the build tree. Tests that drive the command-line tools skip: the wheel
# has only the module. Prints the time of each phase.
#
#   scripts/pip-install-check.sh [--clean]
#
# --clean removes build-python/ (the CMake build directory of pip builds,
# pyproject.toml) first, for a build from scratch; without it, pip rebuilds
# only what changed. Build requirements come pinned from
# scripts/requirements-python-build.txt and the build runs with
# --no-build-isolation, so pip fetches nothing else; numpy and pytest come
# from the interpreter's own site-packages (--system-site-packages; install
# them with scripts/install-deps.sh). The venv is $MEGASLIDE_VENV, default
# build-venv/. CCACHE_BASEDIR is the repository root, so ccache serves
# objects that scripts/build.sh compiled with the same flags.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')
venv=${MEGASLIDE_VENV:-$root/build-venv}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root}
# scikit-build-core would take the compilers from Python's sysconfig (g++);
# the same command as build/'s (CMake's default c++) lets ccache hit.
export CC=${CC:-cc} CXX=${CXX:-c++}

clean=0
for arg in "$@"; do
  case $arg in
    --clean) clean=1 ;;
    *) echo "usage: $0 [--clean]" >&2; exit 2 ;;
  esac
done

now() { date +%s.%N; }
seconds() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
start=$(now)

[ $clean -eq 1 ] && rm -rf "$root/build-python"
rm -rf "$venv"
"$python" -m venv --system-site-packages "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q -r "$root/scripts/requirements-python-build.txt"
venv_done=$(now)

echo "==== pip install . (build directory build-python/)"
(cd "$root" && "${pip[@]}" install --no-build-isolation .)
install_done=$(now)

# From outside the repository and without PYTHONPATH, so the import can
# only find the installed package.
cd "$venv"
unset PYTHONPATH
location=$("$venv/bin/python" -c 'import megaslide; print(megaslide.__file__)')
case $location in
  "$venv"/*) echo "megaslide imported from $location" ;;
  *) echo "error: megaslide imported from $location, not from $venv" >&2
     exit 1 ;;
esac
# Every module of the source package, its stub and marker.
for f in $(cd "$root/python-bindings/megaslide" && ls *.py *.pyi py.typed); do
  [ -f "$(dirname "$location")/$f" ] ||
    { echo "error: the installed package lacks $f" >&2; exit 1; }
done
# The console scripts of pyproject.toml; --help needs no torch.
for tool in megaslide-prepare megaslide-export; do
  "$venv/bin/$tool" --help >/dev/null ||
    { echo "error: the console script $tool does not run" >&2; exit 1; }
done

echo "==== pytest (installed package)"
status=0
MEGASLIDE_TOOLS_DIR="$venv/no-tools" "$venv/bin/python" -m pytest -q \
  -p no:cacheprovider "$root/test/python" || status=$?
tests_done=$(now)

echo
echo "pip-install-check: venv $(seconds "$start" "$venv_done") s," \
  "pip install $(seconds "$venv_done" "$install_done") s," \
  "pytest $(seconds "$install_done" "$tests_done") s," \
  "total $(seconds "$start" "$tests_done") s"
exit $status
