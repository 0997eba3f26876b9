//===- HardwareFlag.cpp - The --hw flag -----------------------------------===//

#include "megaslide/Tools/HardwareFlag.h"

using namespace llvm;

cl::OptionCategory megaslide::tools::hardwareCategory("Hardware options");

cl::opt<std::string> megaslide::tools::hardwareFile(
    "hw", cl::cat(hardwareCategory),
    cl::desc("Hardware description (JSON; default: built-in H200 + 1.5 TB "
             "host; configs/hardware/ holds others, docs/CostModel.md)"),
    cl::value_desc("FILE"));
