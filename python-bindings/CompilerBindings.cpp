//===- CompilerBindings.cpp - IR, pipelines, kernels and NVRTC ------------===//
//
// The compiler entry points that need MLIR go through the C API
// (include/megaslide/CAPI/MegaSlide.h: text in, text out); NVRTC and the
// device probe are runtime code (no MLIR). Each C API wrapper returns
// (status, output, error) and its Python wrapper in the megaslide package
// turns a non-zero status into the right exception, so the rules live in
// Python alone.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cuda/CudaBackend.h"
#include "megaslide/runtime/cuda/Nvrtc.h"
#include "megaslide/CAPI/MegaSlide.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace {

using Status = std::tuple<int, std::string, std::string>;

/// Calls a C API function `call(&output, &error)` without the GIL (a
/// pipeline over the 105B module runs for seconds) and takes ownership of
/// both strings.
template <typename Call> Status callCapi(Call &&call) {
  char *output = nullptr, *error = nullptr;
  int rc;
  {
    py::gil_scoped_release release;
    rc = call(&output, &error);
  }
  std::unique_ptr<char, decltype(&megaslideFreeString)> outputOwner(
      output, megaslideFreeString),
      errorOwner(error, megaslideFreeString);
  return {rc, output ? output : "", error ? error : ""};
}

Status buildModule(const std::string &model, int64_t frames, int64_t height,
                   int64_t width, bool latent, int64_t batch, int64_t textLen,
                   const std::string &precision) {
  return callCapi([&](char **out, char **err) {
    return megaslideBuildModule(model.c_str(), frames, height, width, latent,
                                batch, textLen, precision.c_str(), out, err);
  });
}

Status parseModule(const std::string &ir, const std::string &source) {
  return callCapi([&](char **out, char **err) {
    return megaslideParseModule(ir.c_str(), source.c_str(), out, err);
  });
}

Status runPipeline(const std::string &ir, const std::string &source,
                   const std::string &pipeline) {
  return callCapi([&](char **out, char **err) {
    return megaslideRunPipeline(ir.c_str(), source.c_str(), pipeline.c_str(),
                                out, err);
  });
}

Status emitDsaKernels(const std::string &ir, const std::string &source) {
  return callCapi([&](char **out, char **err) {
    return megaslideEmitDsaKernelsJson(ir.c_str(), source.c_str(), out, err);
  });
}

Status memoryPlan(const std::string &model, int64_t frames, int64_t height,
                  int64_t width, bool latent, int64_t batch, int64_t textLen,
                  const std::string &options) {
  return callCapi([&](char **out, char **err) {
    return megaslideMemoryPlanJson(model.c_str(), frames, height, width, latent,
                                   batch, textLen, options.c_str(), out, err);
  });
}

/// (available, why not, NVRTC version).
std::tuple<bool, std::string, std::string> nvrtcStatus() {
  std::string why;
  bool available = megaslide::cuda::nvrtcAvailable(&why);
  return {available, why,
          available ? megaslide::cuda::nvrtcVersionString() : ""};
}

/// One NVRTC compilation: cubin (bytes), ptx, log, error (the compiler log
/// when it failed), from_cache and the ptxas resources per kernel.
py::dict compileCuda(const std::string &source, const std::string &name,
                     const std::string &arch,
                     const std::vector<std::string> &options) {
  megaslide::cuda::CompileResult result;
  {
    py::gil_scoped_release release;
    result = megaslide::cuda::compileCuda(source, name, arch, options);
  }
  py::list resources;
  for (const megaslide::cuda::KernelResources &r :
       megaslide::cuda::parsePtxasLog(result.log)) {
    py::dict k;
    k["kernel"] = r.kernel;
    k["registers"] = r.registers;
    k["shared_bytes"] = r.sharedBytes;
    k["stack_bytes"] = r.stackBytes;
    k["spill_stores"] = r.spillStores;
    k["spill_loads"] = r.spillLoads;
    resources.append(k);
  }
  py::dict out;
  out["cubin"] = py::bytes(result.cubin);
  out["ptx"] = result.ptx;
  out["log"] = result.log;
  out["error"] = result.error;
  out["from_cache"] = result.fromCache;
  out["resources"] = resources;
  return out;
}

/// Theoretical sm_90 occupancy of a kernel with these resources.
py::dict occupancySm90(int registers, int sharedBytes, int threads,
                       int dynamicSharedBytes) {
  megaslide::cuda::KernelResources r;
  r.registers = registers;
  r.sharedBytes = sharedBytes;
  megaslide::cuda::Occupancy occ =
      megaslide::cuda::occupancySm90(r, threads, dynamicSharedBytes);
  py::dict out;
  out["blocks_per_sm"] = occ.blocksPerSm;
  out["warps_per_sm"] = occ.warpsPerSm;
  out["fraction"] = occ.fraction;
  out["limiter"] = occ.limiter;
  return out;
}

} // namespace

/// Registers the compiler, NVRTC and device-probe functions of _megaslide.
void defineCompiler(py::module_ &m) {
  m.def("build_module", &buildModule, py::arg("model"), py::arg("frames"),
        py::arg("height"), py::arg("width"), py::arg("latent"),
        py::arg("batch"), py::arg("text_len"), py::arg("precision"),
        "(status, module text, error): megaslideBuildModule.");
  m.def("parse_module", &parseModule, py::arg("ir"), py::arg("source"),
        "(status, printed module, diagnostics): megaslideParseModule.");
  m.def("run_pipeline", &runPipeline, py::arg("ir"), py::arg("source"),
        py::arg("pipeline"),
        "(status, {ir, remarks, warnings} JSON, error): megaslideRunPipeline.");
  m.def("emit_dsa_kernels", &emitDsaKernels, py::arg("ir"), py::arg("source"),
        "(status, {kernels} JSON, error): megaslideEmitDsaKernelsJson.");
  m.def("memory_plan_json", &memoryPlan, py::arg("model"), py::arg("frames"),
        py::arg("height"), py::arg("width"), py::arg("latent"),
        py::arg("batch"), py::arg("text_len"), py::arg("options"),
        "(status, JSON, error): megaslideMemoryPlanJson.");
  m.def("nvrtc_status", &nvrtcStatus,
        "(available, why not, version) of the NVRTC library.");
  m.def("compile_cuda", &compileCuda, py::arg("source"), py::arg("name"),
        py::arg("arch"), py::arg("options"),
        "NVRTC compilation with the on-disk kernel cache.");
  m.def("occupancy_sm90", &occupancySm90, py::arg("registers"),
        py::arg("shared_bytes"), py::arg("threads"),
        py::arg("dynamic_shared_bytes"),
        "Theoretical occupancy of one H100/H200 SM.");
  m.def(
      "cuda_device_status",
      [] {
        std::string why;
        bool available = megaslide::cuda::cudaDeviceAvailable(&why);
        return std::make_tuple(available, why);
      },
      "(available, why not) of a CUDA device for the cuda backend.");
}
