//===- Libraries.h - Where the CUDA libraries are --------------*- C++ -*-===//
//
// One search for the libraries the runtime dlopens (cuBLASLt, NVRTC), so
// that NVRTC, which builds without the cuda backend (MegaSlideCudaJit),
// looks where the backend looks.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CUDA_LIBRARIES_H
#define MEGASLIDE_RUNTIME_CUDA_LIBRARIES_H

#include <string>
#include <vector>

namespace megaslide::cuda {

/// Where a CUDA library `sonames` (most wanted first) may be, in the order
/// to try: each soname as is (the loader's path: LD_LIBRARY_PATH, ldconfig,
/// a copy already loaded, e.g. by torch), then every file of those names
/// that exists in a toolkit folder (lib64, lib, targets/<arch>-linux/lib of
/// $CUDA_HOME, $CUDA_PATH, /usr/local/cuda) or in a pip wheel's
/// (nvidia/*/lib of the site-packages of $VIRTUAL_ENV, $CONDA_PREFIX,
/// $PYTHONPATH, ~/.local, /usr/local and /usr: where torch's CUDA
/// libraries are installed).
std::vector<std::string>
cudaLibraryCandidates(const std::vector<std::string> &sonames);

} // namespace megaslide::cuda

#endif // MEGASLIDE_RUNTIME_CUDA_LIBRARIES_H
