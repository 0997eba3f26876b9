# -*- Python -*-
# lit configuration of MegaSlide's IR and tool tests.

import os

import lit.formats
from lit.llvm import llvm_config
from lit.llvm.subst import ToolSubst

config.name = "MegaSlide"
config.test_format = lit.formats.ShTest(not llvm_config.use_lit_shell)
config.suffixes = [".mlir", ".test", ".json"]
config.excludes = ["lib", "unit", "python", "Inputs", "CMakeLists.txt",
                   "lit.cfg.py", "lit.site.cfg.py"]
config.test_source_root = os.path.dirname(__file__)
config.test_exec_root = os.path.join(config.megaslide_obj_root, "test")

config.substitutions.append(("%PATH%", config.environment["PATH"]))
config.substitutions.append(("%configs", os.path.join(config.megaslide_src_root, "configs")))
config.substitutions.append(("%python", config.python_executable))
config.substitutions.append(("%megaslide_src", config.megaslide_src_root))
config.substitutions.append(("%megaslide_obj", config.megaslide_obj_root))
config.substitutions.append(("%megaslide_version", config.megaslide_version))

llvm_config.with_system_environment(["HOME", "INCLUDE", "LIB", "TMP", "TEMP"])
llvm_config.use_default_substitutions()

if config.has_cuda:
    config.available_features.add("cuda")

# The Python module is built by scripts/build.sh but not in the sanitize
# build (scripts/sanitize.sh says why); tests that import it require this.
_package = os.path.join(config.megaslide_obj_root, "python_packages", "megaslide")
if os.path.isdir(_package) and any(
        n.startswith("_megaslide.") and n.endswith(".so") for n in os.listdir(_package)):
    config.available_features.add("python-module")


def _nvrtc_loadable():
    """NVRTC compiles CUDA C++ without a GPU (docs/Architecture.md,
    "Toolchain")."""
    import ctypes
    import glob
    homes = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    names = ["libnvrtc.so", "libnvrtc.so.13"]
    names += [p for h in homes if h
              for p in sorted(glob.glob(os.path.join(h, "lib64", "libnvrtc.so*")))
              if "builtins" not in p]
    for name in names:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            pass
    return False


def _find_cuobjdump():
    """cuobjdump comes from PyPI (nvidia-cuda-cuobjdump), not the toolkit."""
    import shutil
    import subprocess
    found = shutil.which("cuobjdump")
    if found:
        return found
    # Look inside the wheel of the interpreter the build uses.
    probe = ("import glob, os, nvidia; print(next(iter(sorted(p for d in "
             "nvidia.__path__ for p in glob.glob(os.path.join(d, '*', 'bin', "
             "'cuobjdump')))), ''))")
    try:
        out = subprocess.run([config.python_executable, "-c", probe],
                             capture_output=True, text=True, timeout=60)
        path = out.stdout.strip()
        return path if out.returncode == 0 and os.access(path, os.X_OK) else None
    except (OSError, subprocess.SubprocessError):
        return None


if _nvrtc_loadable():
    config.available_features.add("nvrtc")
_cuobjdump = _find_cuobjdump()
# cuobjdump -sass runs nvdisasm (nvidia-cuda-nvdisasm), found next to it or
# on PATH.
if _cuobjdump and (
        os.access(os.path.join(os.path.dirname(_cuobjdump), "nvdisasm"), os.X_OK)
        or __import__("shutil").which("nvdisasm")):
    config.available_features.add("cuobjdump")
    config.substitutions.append(("%cuobjdump", _cuobjdump))
    llvm_config.with_environment("PATH", os.path.dirname(_cuobjdump),
                                 append_path=True)

tool_dirs = [config.megaslide_tools_dir, config.llvm_tools_dir]
tools = ["megaslide-opt", "megaslide-plan", "megaslide-run", "megaslide-translate",
         "megaslide-calibrate", "megaslide-report", "megaslide-tblgen"]
llvm_config.add_tool_substitutions(tools, tool_dirs)
llvm_config.with_environment("PATH", config.llvm_tools_dir, append_path=True)
llvm_config.with_environment(
    "PYTHONPATH", os.path.join(config.megaslide_obj_root, "python_packages"),
    append_path=True)
