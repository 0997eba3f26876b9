"""Faults a long run must survive without losing the user's files.

Issue 11 of the tracker lists them; each section below covers one item,
says which, and holds its own helpers after the shared ones. Sections:

* Full disk (item 2). Every writer of every tool (megaslide-plan
  --emit-mlir and --format html -o, megaslide-run --save-plan, --trace and
  --save-weights, megaslide-opt -o, megaslide-translate --emit-dsa-kernels
  -o DIR) runs against an existing destination on a disk that fills up
  midway, two ways: a real small tmpfs (skipped, with the reason, where the
  machine does not allow mounting) and the MEGASLIDE_FAULT_WRITE_LIMIT seam
  of support/AtomicFile (always runs; docs/Testing.md). Each asserts exit 1,
  a message naming the file and "No space left on device", no "LLVM
  ERROR", the destination byte-identical and no temporary left.
* Output permissions (item 2): megaslide-opt -o keeps a 0600 file 0600
  and gives a new file 0666 & ~umask.
* Folders of failed saves (item 14): a --save-weights (and a Python
  Trainer.save_weights) that fails leaves no folder it created.

Inputs are made once per module by the tools themselves from the tiny
preset at 5 x 32 x 32, as in test_bad_input.py.
"""

import contextlib
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import types
import uuid

import pytest

from conftest import tool_path

SMALL = ["--frames", "5", "--height", "32", "--width", "32"]
RUN = ["--model", "tiny", *SMALL, "--no-progress"]
FAULT_ENV = "MEGASLIDE_FAULT_WRITE_LIMIT"
ENOSPC = "No space left on device"

# What crashes leave behind: LLVM's signal handler and fatal errors,
# assertions, sanitizers.
CRASH_SIGNS = ("LLVM ERROR", "Stack dump", "PLEASE submit a bug report",
               "Assertion", "Segmentation fault", "AddressSanitizer",
               "runtime error:", "terminate called")


# ---------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------

def run_tool(tool, args, env=None, timeout=300, umask=None):
    full_env = dict(os.environ)
    full_env.pop(FAULT_ENV, None)
    full_env.update(env or {})
    result = subprocess.run(
        [tool_path(tool), *map(os.fspath, args)], capture_output=True,
        timeout=timeout, env=full_env,
        preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)
    result.out = (result.stdout + result.stderr).decode("utf-8", "replace")
    return result


def check_failure(result, code, *messages):
    """Exit `code` (never a signal), every message in the output, no
    crash and no LLVM fatal error."""
    text = result.out
    assert result.returncode >= 0, (
        f"killed by signal {-result.returncode}:\n{text}")
    for sign in CRASH_SIGNS:
        assert sign not in text, f"crash signature {sign!r}:\n{text}"
    assert result.returncode == code, (
        f"exit {result.returncode}, expected {code}:\n{text}")
    for message in messages:
        assert message in text, f"{message!r} not in:\n{text}"


def tree_hashes(root):
    """Every file and folder under `root` (or `root` itself, a file), with
    the SHA-256 and mode of files."""
    root = pathlib.Path(root)
    paths = [root] if root.is_file() else sorted(root.rglob("*"))
    out = {}
    for path in paths:
        if path.is_file():
            out[str(path)] = (hashlib.sha256(path.read_bytes()).hexdigest(),
                              path.stat().st_mode)
        else:
            out[str(path)] = "dir"
    return out


def temporaries(folder):
    return sorted(p.name for p in pathlib.Path(folder).rglob("*")
                  if ".tmp-" in p.name)


def output_bytes(path):
    path = pathlib.Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The module of tiny as built (megaslide-opt's input), a planned module
    with 3D-DSA ops (megaslide-translate's) and a folder of weights."""
    d = tmp_path_factory.mktemp("fault-inputs")
    r = run_tool("megaslide-plan", ["--model", "tiny", *SMALL, "--emit-mlir",
                                    d / "tiny.mlir", "-o", d / "report.txt"])
    assert r.returncode == 0, r.out
    # A grid large enough for the 3D-DSA window (as test_bad_input.py).
    r = run_tool("megaslide-plan",
                 ["--model", "tiny", "--frames", "17", "--height", "128",
                  "--width", "128", "--dsa-window", "3,5,5", "--dsa-tile",
                  "1,4,4", "--emit-plan-mlir", d / "dsa.mlir", "-o",
                  d / "report-dsa.txt"])
    assert r.returncode == 0, r.out
    return types.SimpleNamespace(dir=d, mlir=d / "tiny.mlir",
                                 dsa=d / "dsa.mlir")


# ---------------------------------------------------------------------------
# Full disk (issue 11, item 2): the user's files stay byte-identical
# ---------------------------------------------------------------------------

# (id, tool, arguments with {out} and {mlir}/{dsa}, what {out} is)
FULL_DISK_CASES = [
    ("plan --emit-mlir", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--emit-mlir", "{out}", "-o", "/dev/null"],
     "file"),
    ("plan --format html -o", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--format", "html", "-o", "{out}"], "file"),
    ("run --save-plan", "megaslide-run",
     [*RUN, "--steps", "0", "--save-plan", "{out}"], "file"),
    ("run --trace", "megaslide-run",
     [*RUN, "--steps", "1", "--trace", "{out}"], "file"),
    ("opt -o", "megaslide-opt",
     ["{mlir}", "-o", "{out}"], "file"),
    ("translate -o DIR", "megaslide-translate",
     ["--emit-dsa-kernels", "{dsa}", "-o", "{out}"], "dir"),
    ("run --save-weights", "megaslide-run",
     [*RUN, "--steps", "1", "--save-weights", "{out}"], "dir"),
]


def case_args(args, inputs, out):
    return [a.format(out=out, mlir=inputs.mlir, dsa=inputs.dsa) for a in args]


def earlier_output(tool, args, inputs, out, kind):
    """What a user has at `out`: the files of an earlier run, a quarter of
    the size of the new ones (a smaller model, an older version), so that
    they differ from what the failing run would write and so that writing
    over them in place, as the tools once did, also runs out of space.
    Returns the size of a complete new output."""
    r = run_tool(tool, case_args(args, inputs, out))
    assert r.returncode == 0, r.out
    size = output_bytes(out)
    files = [out] if kind == "file" else sorted(
        p for p in pathlib.Path(out).rglob("*") if p.is_file())
    for f in files:
        data = f.read_bytes()
        f.write_bytes(data[:len(data) // 4] +
                      b"\n// the user's earlier output\n")
    return size


@contextlib.contextmanager
def small_tmpfs(where, size="32m"):
    """A tmpfs of `size` mounted at `where`; skips the test where mounting
    is not permitted (not root, no CAP_SYS_ADMIN, a locked-down container)."""
    where.mkdir()
    if not shutil.which("mount"):
        pytest.skip("no mount command: cannot make a small file system")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}",
                        "megaslide-fault-test", os.fspath(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here "
                    f"(mount: {r.stderr.strip() or r.returncode}); the "
                    f"{FAULT_ENV} seam covers the same cases")
    try:
        yield where
    finally:
        subprocess.run(["umount", os.fspath(where)], capture_output=True)


def fill(folder, leave):
    """Fills the file system of `folder` up, then frees about `leave`
    bytes (whole 4 KiB pages), so the next writes fail partway."""
    filler = pathlib.Path(folder) / f"filler-{uuid.uuid4().hex}"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 12):
            while True:
                try:
                    f.write(chunk[:size])
                except OSError:
                    break
    total = filler.stat().st_size
    os.truncate(filler, max(0, total - (leave // 4096) * 4096))


@pytest.mark.parametrize("way", ["tmpfs", "seam"])
@pytest.mark.parametrize("name,tool,args,kind", FULL_DISK_CASES,
                         ids=[c[0] for c in FULL_DISK_CASES])
def test_full_disk_keeps_existing_output(inputs, tmp_path, way, name, tool,
                                         args, kind):
    env = {}
    if way == "tmpfs":
        stack = contextlib.ExitStack()
        disk = stack.enter_context(small_tmpfs(tmp_path / "disk"))
    else:
        stack = contextlib.nullcontext()
        disk = tmp_path
    with stack:
        out = disk / "out" / ("kernels" if kind == "dir" else "output")
        out.parent.mkdir()
        size = earlier_output(tool, args, inputs, out, kind)
        # Half of the new output fits: the disk fills up in the middle.
        if way == "tmpfs":
            fill(disk, size // 2)
        else:
            env[FAULT_ENV] = str(size // 2)
        before = tree_hashes(out.parent)
        result = run_tool(tool, case_args(args, inputs, out), env=env)
        named = f"'{out}'" if kind == "file" else f"'{out}/"
        check_failure(result, 1, named, ENOSPC)
        assert tree_hashes(out.parent) == before
        assert temporaries(out.parent) == []


def test_full_disk_seam_is_exact(inputs, tmp_path):
    """The seam counts bytes: a limit the output fits in lets it through."""
    out = tmp_path / "plan.json"
    args = [*RUN, "--steps", "0", "--save-plan", out]
    assert run_tool("megaslide-run", args).returncode == 0
    size = out.stat().st_size
    out.unlink()
    result = run_tool("megaslide-run", args, env={FAULT_ENV: str(size)})
    assert result.returncode == 0, result.out
    assert out.stat().st_size == size
    check_failure(run_tool("megaslide-run", args,
                           env={FAULT_ENV: str(size - 1)}), 1,
                  f"cannot write '{out}': {ENOSPC}")
    assert out.stat().st_size == size


def test_full_disk_on_stdout_is_an_error(inputs):
    """A report sent to a full device by the shell: an error, not LLVM's
    fatal 'IO failure on output stream'."""
    if not os.access("/dev/full", os.W_OK):
        pytest.skip("no /dev/full")
    with open("/dev/full", "wb") as full:
        result = subprocess.run(
            [tool_path("megaslide-plan"), "--model", "tiny", *SMALL],
            stdout=full, stderr=subprocess.PIPE, timeout=300)
    result.out = result.stderr.decode("utf-8", "replace")
    check_failure(result, 1, f"cannot write to standard output: {ENOSPC}")


# ---------------------------------------------------------------------------
# Output permissions (issue 11, item 2)
# ---------------------------------------------------------------------------

def test_opt_keeps_the_mode_of_its_output(inputs, tmp_path):
    out = tmp_path / "private.mlir"
    out.write_text("the user's earlier output\n")
    out.chmod(0o600)
    result = run_tool("megaslide-opt", [inputs.mlir, "-o", out])
    assert result.returncode == 0, result.out
    assert out.stat().st_mode & 0o7777 == 0o600
    assert "module" in out.read_text()


def test_new_outputs_follow_the_umask(inputs, tmp_path):
    for tool, args in [
            ("megaslide-opt", [inputs.mlir, "-o", tmp_path / "new.mlir"]),
            ("megaslide-run", [*RUN, "--steps", "0", "--save-plan",
                               tmp_path / "new.json"])]:
        result = run_tool(tool, args, umask=0o027)
        assert result.returncode == 0, result.out
    for name in ("new.mlir", "new.json"):
        assert (tmp_path / name).stat().st_mode & 0o7777 == 0o640, name


def test_output_into_read_only_file_system(inputs, tmp_path):
    """EROFS is named as such, before any planning work."""
    with small_tmpfs(tmp_path / "ro", size="1m") as ro:
        r = subprocess.run(["mount", "-o", "remount,ro", os.fspath(ro)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
        out = ro / "report.html"
        result = run_tool("megaslide-plan", ["--model", "tiny", *SMALL,
                                             "--format", "html", "-o", out])
        check_failure(result, 1, f"cannot write '{out}': Read-only file "
                                 "system")


# ---------------------------------------------------------------------------
# Folders of failed saves (issue 11, item 14)
# ---------------------------------------------------------------------------

def test_failed_save_weights_leaves_no_folder_it_created(tmp_path):
    out = tmp_path / "new" / "nested" / "weights"
    result = run_tool("megaslide-run",
                      [*RUN, "--steps", "1", "--save-weights", out],
                      env={FAULT_ENV: "1000"})
    check_failure(result, 1, f"'{out}/", ENOSPC)
    assert not (tmp_path / "new").exists()
    assert list(tmp_path.iterdir()) == []


def test_failed_python_save_weights_leaves_no_folder_it_created(tmp_path):
    """host::saveWeights itself, through Trainer.save_weights (the seam is
    read once per process: the save runs in a child interpreter)."""
    plan = tmp_path / "plan.json"
    r = run_tool("megaslide-run", [*RUN, "--steps", "0", "--save-plan", plan])
    assert r.returncode == 0, r.out
    out = tmp_path / "new" / "nested" / "weights"
    script = (
        "import sys, megaslide\n"
        "t = megaslide.Trainer(plan_json=open(sys.argv[1]).read())\n"
        "try:\n"
        "    t.save_weights(sys.argv[2])\n"
        "except ValueError as e:\n"
        "    print(e)\n"
        "    sys.exit(1)\n")
    env = dict(os.environ, **{FAULT_ENV: "1000"})
    result = subprocess.run([sys.executable, "-c", script, os.fspath(plan),
                             os.fspath(out)], capture_output=True, env=env,
                            timeout=300)
    result.out = (result.stdout + result.stderr).decode("utf-8", "replace")
    check_failure(result, 1, f"'{out}/", ENOSPC)
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
