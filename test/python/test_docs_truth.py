"""README.md and the hand-written docs (docs/*.md, docs/dialects/*.md) name
only what exists: every repository path and link, every flag given to a
megaslide tool and every model preset (docs/Testing.md, "Docs that name
what exists"). docs/reference/ is generated and kept current by
test/Docs/reference_current.test.

What is read: inline code spans, fenced code blocks (one logical line at a
time) and Markdown links; prose outside backticks is not parsed.
"""
import fnmatch
import functools
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

import megaslide
from conftest import TOOLS_DIR

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "docs" / "dialects").glob("*.md"))]

# Folders the build makes, not the repository: a doc names them by these
# roots, and what lies below depends on what was built and run.
BUILD_ROOTS = {
    "build": "scripts/build.sh's build tree",
    "build-runtime": "scripts/build.sh --runtime-only's build tree",
    "build-bundle": "the device bundle (scripts/device-bundle.sh)",
    "build-sanitize": "the ASan+UBSan build (scripts/sanitize.sh)",
    "build-python": "pip install .'s build tree (pyproject.toml build-dir)",
}
# The top-level entries of the design card this project was built from:
# the tree must keep each, and a doc's path from one is checked even if the
# tree lost it.
DESIGN_ROOTS = {"CMakeLists.txt", "include", "lib", "tools", "dialects",
                "runtime", "test", "python-bindings", "docs"}
# Flags a page names that no megaslide tool or script declares, with
# whose they are.
OTHERS = {
    ("docs/ExitCodes.md", "--nosuch"): "none: the error an unknown flag gets",
    ("docs/AddingAnOption.md", "--max-offloaded-blocks"):
        "the option the page's example patch adds",
    ("docs/AddingAPass.md", "--debug-only"):
        "LLVM's, only where LLVM has assertions (Debian's has not), as the "
        "page says",
    ("docs/Runtime.md", "--as-needed"): "the linker's",
    ("docs/Runtime.md", "--gc-sections"): "the linker's",
    ("docs/Testing.md", "--screenshot"): "Chromium's",
    ("docs/Testing.md", "--window-size"): "Chromium's",
    ("docs/Testing.md", "--dump-dom"): "Chromium's",
}
# Flags a tool declares but its --help-hidden does not list: options
# outside the tool's categories, which cl::HideUnrelatedOptions hides.
# Each must still be declared where it says.
UNLISTED = {
    ("megaslide-plan", "--print-option-reference"):
        "tools/common/PlanFlags.cpp",
}
# The megaslide tools that are Python modules (pyproject.toml's scripts).
PYTHON_TOOLS = {"megaslide-prepare": "megaslide.prepare",
                "megaslide-export": "megaslide.export"}

FLAG = re.compile(r"^--[A-Za-z][\w-]*")
# Where one command of a line ends and the next begins.
SEPARATOR = re.compile(r"\|\||&&|[|;(){}]|\$\(")
# Words before a command's program: variable assignments, wrappers and
# the head of a lit RUN line (`// RUN: not megaslide-opt ...`).
PREFIX = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*|env|sudo|time|exec|"
                    r"\+?//|RUN:|not|!)$")


def tracked():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True,
                         text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [f for f in out.stdout.split("\n") if f]


@functools.lru_cache(maxsize=None)
def tree():
    """Tracked files and the folders that hold them."""
    files = set(tracked())
    folders = {str(p) for f in files for p in pathlib.PurePath(f).parents}
    return files, folders - {"."}


def parts(text):
    """`text` with its fenced blocks blanked (line numbers kept), and (line
    number, text, in a fenced block) of each code span and of each logical
    line of a fenced block (continuation lines joined)."""
    out, prose, block, start = [], [], None, 0
    for number, line in enumerate(text.split("\n"), 1):
        if re.match(r"\s*(```|~~~)", line):
            if block is None:
                block, start = [], number + 1
            else:
                joined = "\n".join(block).replace("\\\n", " ")
                for offset, logical in enumerate(joined.split("\n")):
                    out.append((start + offset, logical, True))
                block = None
            prose.append("")
        elif block is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
    lines = "\n".join(prose)
    for m in re.finditer(r"(`+)(.+?)\1", lines, re.S):
        number = lines.count("\n", 0, m.start()) + 1
        out.append((number, m.group(2).replace("\n", " ").strip(), False))
    return lines, sorted(out)


def code(text):
    return parts(text)[1]


def links(text):
    """(line number, target) of each Markdown link outside fenced blocks
    that is not a URL."""
    prose = parts(text)[0]
    for m in re.finditer(r"\]\(([^)\s]+)\)", prose):
        if not re.match(r"[a-z]+:", m.group(1)):
            yield prose.count("\n", 0, m.start()) + 1, m.group(1)


@functools.lru_cache(maxsize=None)
def anchors(path):
    """The anchors GitHub gives the headings of the page at `path`."""
    seen, out = {}, set()
    for line in parts(path.read_text())[0].split("\n"):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower())
            slug = slug.replace(" ", "-")
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


@functools.lru_cache(maxsize=None)
def path_regex():
    roots = {f.split("/")[0] for f in tree()[0]}
    roots |= set(BUILD_ROOTS) | DESIGN_ROOTS
    alternatives = "|".join(sorted(map(re.escape, roots), key=len,
                                   reverse=True))
    # Not preceded by a character that makes it a suffix of a longer path
    # (`$build/bin`, `my-build/x`); `{h,cpp}` is part of it.
    return re.compile(r"(?<![\w./$~-])(?:\./)?(?:%s)"
                      r"(?:/(?:\{[^{}\s]*\}|[^\s`'\"),;=])*)?" % alternatives)


def path_tokens(span):
    """The words of `span` that start at a top-level entry of the tree, of
    the design card or at a build root: `runtime/cpu/Gemm.cpp`,
    `configs/*.json`, `build/bin/`."""
    for m in path_regex().finditer(span):
        word = m.group(0)
        if "/" in word or word in tree()[0]:
            yield word


def expand(path):
    """`a.{h,cpp}` -> `a.h`, `a.cpp`."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [e for alt in m.group(1).split(",")
            for e in expand(path[:m.start()] + alt + path[m.end():])]


def path_problem(word):
    """Why `word`, a path a doc names, is not in the tree; None if it is."""
    path = word[2:] if word.startswith("./") else word
    name = None
    if "::" in path:  # a pytest id: test/python/test_x.py::test_y
        path, name = path.split("::", 1)
    path = re.sub(r":\d+$", "", path).rstrip(".:")
    if path.split("/")[0] in BUILD_ROOTS:
        return None
    files, folders = tree()
    for one in expand(path):
        # `<Dialect>` and globs match one path component or more.
        pattern = re.sub(r"<[^<>/]+>", "*", one.rstrip("/"))
        pattern = pattern.replace("**/", "*")
        if any(c in pattern for c in "*?["):
            if not fnmatch.filter(files | folders, pattern):
                return f"'{one}' matches nothing in the tree"
            continue
        if one.endswith("/"):
            if pattern not in folders:
                return f"'{one}' is not a folder of the tree"
            continue
        if pattern in files or pattern in folders:
            if name and not re.search(
                    r"def %s\b" % re.escape(name.split("[")[0]),
                    (ROOT / pattern).read_text()):
                return f"'{word}': {pattern} has no test {name}"
            continue
        # A component named without its extension (runtime/train/Session).
        if not any(f.startswith(pattern + ".") and "/" not in
                   f[len(pattern):] for f in files):
            return f"'{one}' is not in the tree"
    return None


def test_every_path_a_doc_names_is_in_the_tree():
    problems = []
    for doc in DOCS:
        rel = doc.relative_to(ROOT)
        text = doc.read_text()
        for number, span, _ in code(text):
            for word in path_tokens(span):
                why = path_problem(word)
                if why:
                    problems.append(f"{rel}:{number}: {why}")
        for number, target in links(text):
            path, _, anchor = target.partition("#")
            where = os.path.normpath(os.path.join(rel.parent, path))
            if where.split("/")[0] in BUILD_ROOTS:
                continue
            if not (ROOT / where).exists():
                problems.append(f"{rel}:{number}: link to '{target}': "
                                f"{where} does not exist")
            elif anchor and where.endswith(".md") and \
                    anchor not in anchors(ROOT / where):
                problems.append(f"{rel}:{number}: link to '{target}': "
                                f"{where} has no heading #{anchor}")
    assert not problems, "\n".join(problems)


def test_the_design_cards_layout_is_kept():
    files, folders = tree()
    missing = sorted(root for root in DESIGN_ROOTS
                     if root not in files | folders)
    assert not missing, f"the design card's top-level entries {missing} " \
        "are not in the tree"


def test_build_roots_are_ignored_by_git():
    # Nothing the repository tracks can hide behind the build roots.
    files = tree()[0]
    for root, why in BUILD_ROOTS.items():
        assert not any(f.split("/")[0] == root for f in files), (root, why)
        ignored = subprocess.run(["git", "check-ignore", "-q", root + "/"],
                                 cwd=ROOT)
        assert ignored.returncode == 0, f"{root}/ ({why}) is not ignored"


# --------------------------------------------------------------------------
# Flags and presets
# --------------------------------------------------------------------------


def commands(span):
    """(program, words) of each command in a line or span; program is ''
    where the words start with a flag (a flag named on its own)."""
    for part in SEPARATOR.split(span):
        words = [w.strip("'\"") for w in part.split()]
        while words and PREFIX.match(words[0]):
            words = words[1:]
        if not words:
            continue
        if FLAG.match(words[0]):
            yield "", words
        elif os.path.basename(words[0]) in ("python", "python3") and \
                len(words) > 1:
            if words[1] == "-m" and len(words) > 2:
                module = words[2]
                yield {m: t for t, m in PYTHON_TOOLS.items()}.get(
                    module, module), words[3:]
            else:
                yield words[1], words[2:]
        else:
            yield words[0], words[1:]


def flag_names(words):
    """The flags among `words`, placeholders (`--megaslide-PASS`) left out;
    a family (`--dsa-*`) as its prefix and `*`."""
    return [m.group(0) for m in (re.match(r"--[A-Za-z][\w-]*\*?", w)
                                 for w in words)
            if m and not re.search(r"[A-Z]{2}", m.group(0))]


def help_flags(text):
    return set(re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", text))


def tools():
    """The megaslide tools of the build tree and the Python ones; libFuzzer
    targets (scripts/fuzz.sh runs them) are left out."""
    return {p.name for p in TOOLS_DIR.iterdir()
            if p.name.startswith("megaslide-") and
            not p.name.startswith("megaslide-fuzz-")} | set(PYTHON_TOOLS)


@functools.lru_cache(maxsize=None)
def tool_flags(tool):
    """The flags `tool` declares: what --help-hidden lists (LLVM tools),
    or --help (GoogleTest binaries, Python tools, megaslide-membw), with
    UNLISTED; and for megaslide-run the other trainers' flags it answers
    (--print-ecosystem-flags)."""
    if tool in PYTHON_TOOLS:
        command = [sys.executable, "-m", PYTHON_TOOLS[tool], "--help"]
    else:
        path = os.fspath(TOOLS_DIR / tool)
        llvm = (ROOT / "tools" / tool).is_dir()
        command = [path, "--help-hidden" if llvm else "--help"]
    out = subprocess.run(command, capture_output=True, text=True)
    flags = help_flags(out.stdout + out.stderr)
    assert flags, f"{' '.join(command)} lists no flags:\n{out.stderr}"
    for (name, flag), home in UNLISTED.items():
        if name == tool:
            assert f'"{flag[2:]}"' in (ROOT / home).read_text(), (flag, home)
            flags.add(flag)
    if tool == "megaslide-run":
        table = subprocess.run([command[0], "--print-ecosystem-flags"],
                               capture_output=True, text=True).stdout
        flags |= set(re.findall(r"^\| `(--[\w-]+)`", table, re.M))
    return flags


def script_flags():
    """Every `--name` in the sources of scripts/ and benchmarks/."""
    flags = set()
    for f in tree()[0]:
        if f.startswith(("scripts/", "benchmarks/")):
            flags |= help_flags((ROOT / f).read_text(errors="replace"))
    return flags


def script(program):
    """The script of scripts/ or benchmarks/ that `program` runs, named by
    its path or, where that is unique, by its file name; None if none."""
    path = program[2:] if program.startswith("./") else program
    scripts = [f for f in tree()[0]
               if f.startswith(("scripts/", "benchmarks/"))]
    if path in scripts:
        return path
    named = [f for f in scripts if os.path.basename(f) == path]
    return named[0] if len(named) == 1 else None


def answers(flags, flag):
    if flag.endswith("*"):
        return any(f.startswith(flag[:-1]) for f in flags)
    # megaslide-run answers a flag's `_` spelling with the flag (docs/
    # Training.md, "Flags of other trainers"); docs show such spellings.
    return flag in flags or flag.replace("_", "-") in flags


def flag_problems(where, span, names, union):
    """Why the flags in `span` (a code line or span at `where`, page:line)
    are not declared by the program they are given to."""
    problems = []
    for program, words in commands(span):
        name = os.path.basename(program)
        if program == "":  # named on their own: any tool's, any script's
            declared = union
        elif name in names:
            declared = tool_flags(name)
        elif re.fullmatch(r"(\./)?build/bin/megaslide-[\w-]+", program) \
                and not name.startswith("megaslide-fuzz-"):
            problems.append(f"{where}: no tool {name} in {TOOLS_DIR}")
            continue
        elif script(program):
            declared = help_flags((ROOT / script(program)).read_text())
        else:
            continue  # another program's flags, or not a command
        for flag in flag_names(words):
            if not answers(declared, flag) and \
                    (where.split(":")[0], flag) not in OTHERS:
                problems.append(f"{where}: {flag} is not a flag of "
                                f"{program or 'any tool or script'}")
    return problems


def test_every_flag_a_doc_gives_a_tool_is_declared():
    if not TOOLS_DIR.is_dir():
        pytest.skip(f"no tools at {TOOLS_DIR}; build them or set "
                    "MEGASLIDE_TOOLS_DIR")
    names = tools()
    union = script_flags()
    for name in names:
        union |= tool_flags(name)
    problems = []
    for doc in DOCS:
        rel = doc.relative_to(ROOT)
        for number, span, _ in code(doc.read_text()):
            problems += flag_problems(f"{rel}:{number}", span, names, union)
    # No exception outlives the line it was made for.
    problems += [f"{page}: no longer names {flag} (OTHERS)"
                 for page, flag in OTHERS
                 if flag not in (ROOT / page).read_text()]
    assert not problems, "\n".join(problems)


def presets():
    return {p.stem for p in (ROOT / "configs").glob("*.json")}


def preset_mentions(span):
    """Model names in `span`: the value of --model (unless a file) given to
    a megaslide tool or on its own (`--model tiny`), and the `model`
    argument of the Python functions that take one first."""
    for program, words in commands(span):
        if program and not os.path.basename(program).startswith("megaslide-"):
            continue
        for i, word in enumerate(words):
            value = None
            # On its own, the value is one word between flags: not the
            # message `--model is required ...`.
            if word == "--model" and i + 1 < len(words) and (
                    program or i + 2 == len(words) or
                    FLAG.match(words[i + 2])):
                value = words[i + 1]
            elif word.startswith("--model="):
                value = word.split("=", 1)[1]
            # Not a config file or a placeholder (FILE).
            if value and re.fullmatch(r"[a-z0-9][a-z0-9.-]*", value) and \
                    not value.endswith(".json"):
                yield value
    for m in re.finditer(r"\bmegaslide\.(\w+)\(\s*[\"']([^\"']+)[\"']", span):
        function = getattr(megaslide, m.group(1), None)
        if callable(function) and \
                next(iter(inspect.signature(function).parameters)) == "model" \
                and not re.search(r"/|\.json$", m.group(2)):
            yield m.group(2)


def preset_lists(prose):
    """(line number, name) of each name in a list of presets in `prose`:
    "presets `a`, `b` and `c`", "a **preset name**: `a`, `b`", and the first
    column of a table headed `preset`."""
    regex = re.compile(r"\bpreset(?:s|\s+name)?\**(?:\s+as\s+JSON)?:?\s+"
                       r"((?:`[^`]+`(?:,?\s+(?:and\s+)?)?)+)")
    for m in regex.finditer(prose):
        number = prose.count("\n", 0, m.start()) + 1
        for name in re.findall(r"`([^`]+)`", m.group(1)):
            yield number, name
    in_table = False
    for number, line in enumerate(prose.split("\n"), 1):
        if re.match(r"\|\s*preset\s*\|", line):
            in_table = True
        elif in_table and line.startswith("|"):
            m = re.match(r"\|\s*`([^`]+)`", line)
            if m:
                yield number, m.group(1)
        else:
            in_table = False


def test_every_preset_a_doc_names_exists():
    names = presets()
    problems = []
    for doc in DOCS:
        rel = doc.relative_to(ROOT)
        prose, spans = parts(doc.read_text())
        for number, span, _ in spans:
            problems += [f"{rel}:{number}: no preset '{name}'"
                         for name in preset_mentions(span)
                         if name not in names]
        problems += [f"{rel}:{number}: no preset '{name}'"
                     for number, name in preset_lists(prose)
                     if name not in names]
    assert not problems, "\n".join(problems)
