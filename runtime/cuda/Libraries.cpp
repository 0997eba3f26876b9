//===- Libraries.cpp - Where the CUDA libraries are -----------------------===//

#include "megaslide/runtime/cuda/Libraries.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/ADT/StringRef.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>

namespace megaslide::cuda {

namespace {

std::string envOr(const char *var) {
  const char *v = std::getenv(var);
  return v && *v ? v : "";
}

} // namespace

std::vector<std::string>
cudaLibraryCandidates(const std::vector<std::string> &sonames) {
  namespace fs = std::filesystem;
  std::vector<std::string> names = sonames;
  std::vector<fs::path> dirs;
#if defined(__aarch64__)
  const char *target = "targets/sbsa-linux/lib";
#else
  const char *target = "targets/x86_64-linux/lib";
#endif
  // The toolkit: lib64 (runfile, .deb), lib (conda, some tarballs), the
  // per-architecture folder those two link to.
  std::vector<std::string> homes;
  for (const char *var : {"CUDA_HOME", "CUDA_PATH"})
    if (std::string dir = envOr(var); !dir.empty())
      homes.push_back(dir);
  homes.push_back("/usr/local/cuda");
  for (const std::string &home : homes)
    for (const char *sub : {"lib64", "lib", target})
      dirs.push_back(fs::path(home) / sub);
  // NVIDIA's pip wheels, as torch installs them: <site>/nvidia/<pkg>/lib
  // (cublas/lib for CUDA 12, cu13/lib for CUDA 13).
  std::vector<fs::path> sites;
  for (const char *var : {"VIRTUAL_ENV", "CONDA_PREFIX"})
    if (std::string prefix = envOr(var); !prefix.empty())
      sites.push_back(prefix);
  if (std::string home = envOr("HOME"); !home.empty())
    sites.push_back(fs::path(home) / ".local");
  sites.push_back("/usr/local");
  sites.push_back("/usr");
  std::vector<fs::path> siteDirs;
  std::string pythonPath = envOr("PYTHONPATH"); // outlives the split
  for (llvm::StringRef entry : llvm::split(pythonPath, ':'))
    if (!entry.empty())
      siteDirs.push_back(entry.str());
  std::error_code ec;
  for (const fs::path &prefix : sites) {
    // <prefix>/lib/python3.X/{site,dist}-packages, and Debian's
    // <prefix>/lib/python3/dist-packages.
    for (fs::directory_iterator it(prefix / "lib", ec), end; !ec && it != end;
         it.increment(ec))
      if (llvm::StringRef(it->path().filename().string())
              .starts_with("python3"))
        for (const char *packages : {"site-packages", "dist-packages"})
          siteDirs.push_back(it->path() / packages);
  }
  for (const fs::path &site : siteDirs) {
    std::vector<fs::path> wheels;
    for (fs::directory_iterator it(site / "nvidia", ec), end; !ec && it != end;
         it.increment(ec))
      wheels.push_back(it->path() / "lib");
    std::sort(wheels.begin(), wheels.end()); // directory order is arbitrary
    dirs.insert(dirs.end(), wheels.begin(), wheels.end());
  }
  for (const fs::path &dir : dirs)
    for (const std::string &so : sonames) {
      std::string path = (dir / so).string();
      if (fs::exists(path, ec) && !llvm::is_contained(names, path))
        names.push_back(path);
    }
  return names;
}

} // namespace megaslide::cuda
