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

llvm_config.with_system_environment(["HOME", "INCLUDE", "LIB", "TMP", "TEMP"])
llvm_config.use_default_substitutions()

if config.has_cuda:
    config.available_features.add("cuda")

tool_dirs = [config.megaslide_tools_dir, config.llvm_tools_dir]
tools = ["megaslide-opt", "megaslide-plan"]
llvm_config.add_tool_substitutions(tools, tool_dirs)
llvm_config.with_environment("PATH", config.llvm_tools_dir, append_path=True)
llvm_config.with_environment(
    "PYTHONPATH", os.path.join(config.megaslide_obj_root, "python_packages"),
    append_path=True)
