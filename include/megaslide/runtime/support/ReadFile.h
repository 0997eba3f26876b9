//===- ReadFile.h - Reading the user's files with bounds --------*- C++ -*-===//
//
// A path the user names, or a file found in a folder of theirs, may be
// anything: a FIFO, on which open() and read() block until a writer comes
// (forever, for `mkfifo x.safetensors`); /dev/zero through a symlink, which
// reads without end; or a 10 GB file where a step name was expected. Every
// file MegaSlide reads goes through openRegularFile: it opens without
// blocking and refuses anything but a regular file, naming the file and
// what it is. Documents read whole go through readBoundedFile, which reads
// at most the bound of their format (the limits below, listed in
// docs/Runtime.md), so no input costs more memory than its format allows.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_SUPPORT_READFILE_H
#define MEGASLIDE_RUNTIME_SUPPORT_READFILE_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <string>

namespace megaslide {

/// Largest documents read whole, by format. Each is far above what the
/// tools write for the largest configuration they plan (1024 layers) and
/// small enough that a bad file is refused before it costs real memory.
/// An execution plan (the 52-layer 105B plan is 4.1 MB of JSON).
inline constexpr uint64_t kMaxExecPlanBytes = 256ull << 20;
/// A model config (config.json of diffusers: about 1 KB).
inline constexpr uint64_t kMaxModelConfigBytes = 1ull << 20;
/// A hardware description (docs/CostModel.md: about 1 KB).
inline constexpr uint64_t kMaxHardwareModelBytes = 1ull << 20;
/// A weights index (diffusion_pytorch_model.safetensors.index.json: about
/// 100 bytes per tensor).
inline constexpr uint64_t kMaxWeightsIndexBytes = 64ull << 20;
/// A checkpoint's manifest.json and trainer.json (under 1 KB each).
inline constexpr uint64_t kMaxCheckpointJsonBytes = 1ull << 20;
/// A checkpoint folder's `latest` file: one step-N folder name.
inline constexpr uint64_t kMaxCheckpointLatestBytes = 4096;

/// Opens `path` read-only without blocking and returns its descriptor
/// (O_CLOEXEC, blocking again) if it is a regular file; `size` receives its
/// size. Anything else (FIFO, socket, device, directory) is refused before
/// a byte is read, also when reached through a symlink. Errors name the
/// file: "cannot open <what> '<path>': <reason>".
llvm::Expected<int> openRegularFile(llvm::StringRef path, llvm::StringRef what,
                                    uint64_t &size);

/// The contents of regular file `path`, refused with an error naming the
/// file and the limit when it holds more than `maxBytes` bytes: at most
/// `maxBytes + 1` bytes are ever read, also from files whose size stat
/// does not know (/proc) or that grow while being read. `what` names the
/// document in errors ("execution plan" gives "cannot read execution plan
/// '<path>': ..."); empty gives "cannot read '<path>': ...".
llvm::Expected<std::string>
readBoundedFile(llvm::StringRef path, uint64_t maxBytes, llvm::StringRef what);

} // namespace megaslide

#endif // MEGASLIDE_RUNTIME_SUPPORT_READFILE_H
