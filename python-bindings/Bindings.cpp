//===- Bindings.cpp - The _megaslide Python extension ---------------------===//
//
// Thin wrappers over the C API and the CPU 3D-DSA kernels; user-facing
// argument checking and the dict-shaped results live in the megaslide
// package (docs/Python.md). The kernel wrappers still check dtypes and
// shapes because a wrong buffer would be read out of bounds, not merely
// misread.
//
//===----------------------------------------------------------------------===//

#include "megaslide/CAPI/MegaSlide.h"
#include "megaslide/runtime/cpu/AdamW.h"
#include "megaslide/runtime/cpu/Dsa3d.h"
#include "megaslide/runtime/cpu/Gemm.h"
#include "megaslide/runtime/cpu/Isa.h"
#include "megaslide/runtime/cpu/LeanAdamW.h"
#include "megaslide/runtime/host/Weights.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using OwnedString = std::unique_ptr<char, decltype(&megaslideFreeString)>;

std::string modelInfoJson(const std::string &model, int64_t frames,
                          int64_t height, int64_t width, bool latent,
                          int64_t batch, int64_t textLen) {
  char *json = nullptr, *error = nullptr;
  int rc = megaslideModelInfoJson(model.c_str(), frames, height, width, latent,
                                  batch, textLen, &json, &error);
  OwnedString jsonOwner(json, megaslideFreeString);
  OwnedString errorOwner(error, megaslideFreeString);
  if (rc != 0)
    throw std::invalid_argument(error);
  return json;
}

std::string planJson(const std::string &model, int64_t frames, int64_t height,
                     int64_t width, bool latent, int64_t batch, int64_t textLen,
                     const std::string &options) {
  char *json = nullptr, *error = nullptr;
  int rc = megaslidePlanJson(model.c_str(), frames, height, width, latent,
                             batch, textLen, options.c_str(), &json, &error);
  OwnedString jsonOwner(json, megaslideFreeString);
  OwnedString errorOwner(error, megaslideFreeString);
  if (rc != 0)
    throw std::invalid_argument(error);
  return json;
}

/// The plan options' keys, types and defaults (megaslidePlanOptionsJson).
std::string planOptionsJson() {
  char *json = nullptr;
  megaslidePlanOptionsJson(&json);
  OwnedString jsonOwner(json, megaslideFreeString);
  return json;
}

//===----------------------------------------------------------------------===//
// 3D-DSA over numpy arrays in the layout [B, H, T, Y, X, D]
//===----------------------------------------------------------------------===//

using megaslide::cpu::Dsa3dConfig;
using megaslide::cpu::dsa3dPythonLayout;
using Triple = std::array<int64_t, 3>;
using FloatArray = py::array_t<float, py::array::c_style>;
using IntArray = py::array_t<int32_t, py::array::c_style>;

/// A shape as Python prints a tuple ("(2, 3)", "(3,)"), since these
/// messages name numpy arrays' shapes; the C++ side prints "[2, 3]"
/// (support/Shape.h).
std::string tupleString(const std::vector<int64_t> &shape) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < shape.size(); ++i)
    os << (i ? ", " : "") << shape[i];
  os << (shape.size() == 1 ? ",)" : ")");
  return os.str();
}

std::vector<int64_t> shapeOf(const py::array &a) {
  return std::vector<int64_t>(a.shape(), a.shape() + a.ndim());
}

/// Requires a C-contiguous array of exactly element type Elem (no casts:
/// a float64 array silently rounded to float32 would hide a user error).
template <typename Elem>
void checkArray(const py::array &a, const char *name,
                const std::vector<int64_t> &shape) {
  if (!py::isinstance<py::array_t<Elem>>(a))
    throw py::type_error(std::string(name) + " must have dtype " +
                         py::str(py::dtype::of<Elem>()).cast<std::string>() +
                         ", got " + py::str(a.dtype()).cast<std::string>());
  if (!py::isinstance<py::array_t<Elem, py::array::c_style>>(a))
    throw py::value_error(std::string(name) + " must be C-contiguous");
  if (shapeOf(a) != shape)
    throw py::value_error(std::string(name) + " has shape " +
                          tupleString(shapeOf(a)) + ", expected " +
                          tupleString(shape));
}

const float *floatData(const py::array &a, const char *name,
                       const std::vector<int64_t> &shape) {
  checkArray<float>(a, name, shape);
  return static_cast<const float *>(a.data());
}

/// The kernel configuration of q [B, H, T, Y, X, D]; checks it.
Dsa3dConfig dsa3dConfig(const py::array &q, Triple window, Triple tile,
                        double scale) {
  if (q.ndim() != 6)
    throw py::value_error("q must have shape (B, H, T, Y, X, D), got " +
                          tupleString(shapeOf(q)));
  Dsa3dConfig cfg;
  cfg.batch = q.shape(0);
  cfg.heads = q.shape(1);
  cfg.T = q.shape(2);
  cfg.Y = q.shape(3);
  cfg.X = q.shape(4);
  cfg.headDim = q.shape(5);
  cfg.window = window;
  cfg.tile = tile;
  cfg.scale = scale;
  std::string error = cfg.validate();
  if (!error.empty())
    throw py::value_error(error);
  return cfg;
}

std::vector<int64_t> offsetsShape(const Dsa3dConfig &cfg) {
  Triple n = cfg.numTiles();
  return {cfg.batch, cfg.heads, n[0], n[1], n[2], cfg.window[0], 2};
}

/// Forward; returns (out [B, H, T, Y, X, D], lse [B, H, T, Y, X]).
py::tuple dsa3dForward(const py::array &q, const py::array &k,
                       const py::array &v, const py::array &offsets,
                       Triple window, Triple tile, double scale) {
  Dsa3dConfig cfg = dsa3dConfig(q, window, tile, scale);
  std::vector<int64_t> shape = shapeOf(q);
  const float *qd = floatData(q, "q", shape), *kd = floatData(k, "k", shape),
              *vd = floatData(v, "v", shape);
  checkArray<int32_t>(offsets, "offsets", offsetsShape(cfg));
  const auto *od = static_cast<const int32_t *>(offsets.data());
  FloatArray out(shape);
  FloatArray lse(std::vector<int64_t>(shape.begin(), shape.end() - 1));
  float *outd = out.mutable_data(), *lsed = lse.mutable_data();
  {
    py::gil_scoped_release release;
    megaslide::cpu::dsa3dForward(
        cfg, dsa3dPythonLayout(qd, cfg), dsa3dPythonLayout(kd, cfg),
        dsa3dPythonLayout(vd, cfg), od, dsa3dPythonLayout(outd, cfg), lsed);
  }
  return py::make_tuple(out, lse);
}

/// Backward from the forward's out and lse; returns (dq, dk, dv).
py::tuple dsa3dBackward(const py::array &q, const py::array &k,
                        const py::array &v, const py::array &offsets,
                        const py::array &out, const py::array &dOut,
                        const py::array &lse, Triple window, Triple tile,
                        double scale) {
  Dsa3dConfig cfg = dsa3dConfig(q, window, tile, scale);
  std::vector<int64_t> shape = shapeOf(q);
  const float *qd = floatData(q, "q", shape), *kd = floatData(k, "k", shape),
              *vd = floatData(v, "v", shape),
              *outd = floatData(out, "out", shape),
              *dOutd = floatData(dOut, "d_out", shape),
              *lsed = floatData(
                  lse, "lse",
                  std::vector<int64_t>(shape.begin(), shape.end() - 1));
  checkArray<int32_t>(offsets, "offsets", offsetsShape(cfg));
  const auto *od = static_cast<const int32_t *>(offsets.data());
  FloatArray dq(shape), dk(shape), dv(shape);
  float *dqd = dq.mutable_data(), *dkd = dk.mutable_data(),
        *dvd = dv.mutable_data();
  {
    py::gil_scoped_release release;
    megaslide::cpu::dsa3dBackward(
        cfg, dsa3dPythonLayout(qd, cfg), dsa3dPythonLayout(kd, cfg),
        dsa3dPythonLayout(vd, cfg), od, dsa3dPythonLayout(outd, cfg),
        dsa3dPythonLayout(dOutd, cfg), lsed, dsa3dPythonLayout(dqd, cfg),
        dsa3dPythonLayout(dkd, cfg), dsa3dPythonLayout(dvd, cfg));
  }
  return py::make_tuple(dq, dk, dv);
}

/// Block-matching offsets, int32 [B, H, nT, nY, nX, kt, 2].
IntArray dsa3dOffsets(const py::array &q, const py::array &k, Triple window,
                      Triple tile, int64_t radius) {
  // The scale does not enter block matching; 1 keeps validate() happy.
  Dsa3dConfig cfg = dsa3dConfig(q, window, tile, 1.0);
  if (radius < 0)
    throw py::value_error("radius must be non-negative, got " +
                          std::to_string(radius));
  std::vector<int64_t> shape = shapeOf(q);
  const float *qd = floatData(q, "q", shape), *kd = floatData(k, "k", shape);
  IntArray offsets(offsetsShape(cfg));
  int32_t *od = offsets.mutable_data();
  {
    py::gil_scoped_release release;
    megaslide::cpu::dsa3dOffsets(cfg, dsa3dPythonLayout(qd, cfg),
                                 dsa3dPythonLayout(kd, cfg), radius, od);
  }
  return offsets;
}

//===----------------------------------------------------------------------===//
// Host AdamW over numpy arrays, in place (runtime/cpu/AdamW.cpp)
//===----------------------------------------------------------------------===//

/// Requires a C-contiguous, writeable float32 array of `shape` (a copy
/// would receive the update and be thrown away, so nothing is converted).
float *mutableFloatData(py::array &a, const char *name,
                        const std::vector<int64_t> &shape) {
  checkArray<float>(a, name, shape);
  if (!a.writeable())
    throw py::value_error(std::string(name) + " must be writeable");
  return static_cast<float *>(a.mutable_data());
}

/// A checked, contiguous buffer: its name for errors and its byte range.
/// (Sizes come from the checked dtype: pybind11 2.10's itemsize() misreads
/// numpy 2's descriptors.)
struct NamedBuffer {
  const char *name;
  uintptr_t begin, bytes;
};

/// Throws if two of the buffers share a byte: the kernel updates in place
/// and assumes no aliasing.
void checkDisjoint(const std::vector<NamedBuffer> &buffers) {
  for (size_t i = 0; i < buffers.size(); ++i)
    for (size_t j = i + 1; j < buffers.size(); ++j) {
      const NamedBuffer &a = buffers[i], &b = buffers[j];
      if (a.bytes && b.bytes && a.begin < b.begin + b.bytes &&
          b.begin < a.begin + a.bytes)
        throw py::value_error(std::string(a.name) + " and " + b.name +
                              " overlap in memory");
    }
}

/// One AdamW step over master, exp_avg, exp_avg_sq (float32, updated in
/// place) with grad as bf16 bits (uint16) or float32 and an optional bf16
/// (uint16) working copy written from the new master.
void adamwStep(py::array master, py::array expAvg, py::array expAvgSq,
               const py::array &grad, std::optional<py::array> working,
               int64_t step, double lr, double beta1, double beta2, double eps,
               double weightDecay) {
  if (step < 1)
    throw py::value_error("step must be >= 1 (1-based), got " +
                          std::to_string(step));
  std::vector<int64_t> shape = shapeOf(master);
  float *p = mutableFloatData(master, "master", shape);
  float *m = mutableFloatData(expAvg, "exp_avg", shape);
  float *v = mutableFloatData(expAvgSq, "exp_avg_sq", shape);
  bool bf16Grad = py::isinstance<py::array_t<uint16_t>>(grad);
  if (bf16Grad)
    checkArray<uint16_t>(grad, "grad", shape);
  else if (py::isinstance<py::array_t<float>>(grad))
    checkArray<float>(grad, "grad", shape);
  else
    throw py::type_error("grad must have dtype uint16 (bf16 bits) or "
                         "float32, got " +
                         py::str(grad.dtype()).cast<std::string>());
  auto range = [n = static_cast<uintptr_t>(master.size())](
                   const char *name, const void *data, size_t elemBytes) {
    return NamedBuffer{name, reinterpret_cast<uintptr_t>(data), n * elemBytes};
  };
  std::vector<NamedBuffer> buffers = {
      range("master", p, 4), range("exp_avg", m, 4), range("exp_avg_sq", v, 4),
      range("grad", grad.data(), bf16Grad ? 2 : 4)};
  uint16_t *w = nullptr;
  if (working) {
    checkArray<uint16_t>(*working, "working", shape);
    if (!working->writeable())
      throw py::value_error("working must be writeable");
    w = static_cast<uint16_t *>(working->mutable_data());
    buffers.push_back(range("working", w, 2));
  }
  checkDisjoint(buffers);
  megaslide::cpu::AdamWHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weightDecay = weightDecay;
  h.step = step;
  int64_t n = master.size();
  py::gil_scoped_release release;
  if (bf16Grad)
    megaslide::cpu::adamwStep(h, n, p, m, v,
                              static_cast<const uint16_t *>(grad.data()), w);
  else
    megaslide::cpu::adamwStep(h, n, p, m, v,
                              static_cast<const float *>(grad.data()), w);
}

/// Writeable, C-contiguous array of T and `shape`, as a pointer.
template <typename T>
T *mutableData(py::array &a, const char *name,
               const std::vector<int64_t> &shape) {
  checkArray<T>(a, name, shape);
  if (!a.writeable())
    throw py::value_error(std::string(name) + " must be writeable");
  return static_cast<T *>(a.mutable_data());
}

megaslide::cpu::AdamWHyper leanHyper(int64_t step, double lr, double beta1,
                                     double beta2, double eps,
                                     double weightDecay) {
  if (step < 1)
    throw py::value_error("step must be >= 1 (1-based)");
  megaslide::cpu::AdamWHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weightDecay = weightDecay;
  h.step = step;
  return h;
}

/// cpu::adamw8bitStep in place over 1-D arrays (float32 master and grad,
/// uint8 codes, float32 absmax per cpu::kQuantBlock): the int8-moments
/// update, for tests against a reference written from its definition.
void adamw8bitStep(py::array master, py::array mCodes, py::array mAbsmax,
                   py::array vCodes, py::array vAbsmax, const py::array &grad,
                   int64_t step, double lr, double beta1, double beta2,
                   double eps, double weightDecay) {
  std::vector<int64_t> shape = {static_cast<int64_t>(master.size())},
                       blocks = {megaslide::cpu::quantBlocks(shape[0])};
  float *p = mutableData<float>(master, "master", shape);
  uint8_t *mc = mutableData<uint8_t>(mCodes, "m_codes", shape);
  float *ma = mutableData<float>(mAbsmax, "m_absmax", blocks);
  uint8_t *vc = mutableData<uint8_t>(vCodes, "v_codes", shape);
  float *va = mutableData<float>(vAbsmax, "v_absmax", blocks);
  checkArray<float>(grad, "grad", shape);
  megaslide::cpu::AdamWHyper h =
      leanHyper(step, lr, beta1, beta2, eps, weightDecay);
  py::gil_scoped_release release;
  megaslide::cpu::adamw8bitStep(h, shape[0], p, mc, ma, vc, va,
                                static_cast<const float *>(grad.data()));
}

/// cpu::factoredStatsStep then cpu::adamwFactoredStep in place over a 2-D
/// float32 master and grad, bf16 bits (uint16) m, float32 row and column
/// statistics: the factored-moments update of a matrix, for tests.
void adamwFactoredStep(py::array master, py::array m, py::array rowStat,
                       py::array colStat, const py::array &grad, int64_t step,
                       double lr, double beta1, double beta2, double eps,
                       double weightDecay) {
  std::vector<int64_t> shape = shapeOf(master);
  if (shape.size() != 2)
    throw py::value_error("master must be 2-D");
  float *p = mutableData<float>(master, "master", shape);
  uint16_t *mb = mutableData<uint16_t>(m, "m", shape);
  float *r = mutableData<float>(rowStat, "row_stat", {shape[0]});
  float *c = mutableData<float>(colStat, "col_stat", {shape[1]});
  checkArray<float>(grad, "grad", shape);
  megaslide::cpu::AdamWHyper h =
      leanHyper(step, lr, beta1, beta2, eps, weightDecay);
  megaslide::cpu::FactoredShape f{shape[0], shape[1]};
  const float *g = static_cast<const float *>(grad.data());
  py::gil_scoped_release release;
  megaslide::cpu::factoredStatsStep(h, f, g, r, c);
  megaslide::cpu::adamwFactoredStep(h, f, 0, shape[0] * shape[1], p, mb, r, c,
                                    megaslide::cpu::factoredRowTotal(f, r), g);
}

/// Registers the host AdamW binding (kept apart from the other bindings).
void defineAdamW(py::module_ &m) {
  m.def(
      "_dynamic_map",
      [](bool isSigned) {
        const std::array<float, 256> &map =
            megaslide::cpu::dynamicMap(isSigned);
        // Bytes, not an array: pybind11 2.10 builds numpy 2 arrays with
        // wrong strides (see NamedBuffer).
        return py::bytes(reinterpret_cast<const char *>(map.data()),
                         sizeof(map));
      },
      py::arg("signed"),
      "bitsandbytes' create_dynamic_map(signed) as int8-moments codes it "
      "(runtime/cpu/LeanAdamW.h), 256 float32 as bytes; for tests.");
  m.def("_adamw8bit_step", &adamw8bitStep, py::arg("master"),
        py::arg("m_codes"), py::arg("m_absmax"), py::arg("v_codes"),
        py::arg("v_absmax"), py::arg("grad"), py::arg("step"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"),
        "int8-moments' AdamW step in place (cpu::adamw8bitStep); for tests.");
  m.def("_adamw_factored_step", &adamwFactoredStep, py::arg("master"),
        py::arg("m"), py::arg("row_stat"), py::arg("col_stat"), py::arg("grad"),
        py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"),
        "factored-moments' AdamW step of a matrix in place; for tests.");
  m.def("adamw_step", &adamwStep, py::arg("master"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("grad"), py::arg("working"),
        py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"),
        "Host AdamW step in place on float32 master, exp_avg, exp_avg_sq; "
        "grad uint16 (bf16 bits) or float32; working: None or uint16 "
        "(bf16 of the new master). Use megaslide.adamw_step.");
  m.def(
      "cpu_isa",
      [] { return megaslide::cpu::cpuIsaName(megaslide::cpu::cpuIsa()); },
      "Instruction set of the cpu kernels' loops (AdamW, the vector math) on "
      "this CPU under MEGASLIDE_CPU_ISA: avx512, avx2 or generic.");
  m.def("gemm_isa", &megaslide::cpu::gemmIsaName,
        "Instruction set of oneDNN's GEMM kernels here (avx512_core, avx2, "
        "sse41, ...).");
  m.def(
      "architecture_keys",
      [] {
        std::vector<std::string> keys;
        for (llvm::StringRef k : megaslide::host::architectureKeys())
          keys.push_back(k.str());
        return keys;
      },
      "The model config keys that fix the weights' shapes and the forward's "
      "meaning: weights whose config.json differs in one are refused.");
}

} // namespace

void defineTrainer(py::module_ &m);  // TrainerBindings.cpp
void defineCompiler(py::module_ &m); // CompilerBindings.cpp

std::string execPlanJson(const std::string &model, int64_t frames,
                         int64_t height, int64_t width, bool latent,
                         int64_t batch, int64_t textLen,
                         const std::string &options) {
  char *json = nullptr, *error = nullptr;
  int rc = megaslideExecPlanJson(model.c_str(), frames, height, width, latent,
                                 batch, textLen, options.c_str(), &json,
                                 &error);
  OwnedString jsonOwner(json, megaslideFreeString);
  OwnedString errorOwner(error, megaslideFreeString);
  if (rc != 0)
    throw std::invalid_argument(error);
  return json;
}

PYBIND11_MODULE(_megaslide, m) {
  // Here rather than at the first kernel, which would have to abort.
  if (const char *error = megaslide::cpu::cpuSettingsError())
    throw std::invalid_argument(error);
  m.doc() = "Native core of the megaslide package (use `import megaslide`).";
  m.attr("__version__") = megaslideVersion();
  m.def("model_info_json", &modelInfoJson, py::arg("model"), py::arg("frames"),
        py::arg("height"), py::arg("width"), py::arg("latent"),
        py::arg("batch"), py::arg("text_len"),
        "JSON text of the model part of megaslide-plan --format json.");
  m.def("plan_options_json", &planOptionsJson,
        "JSON list of the plan options (megaslidePlanOptionsJson).");
  m.def("plan_json", &planJson, py::arg("model"), py::arg("frames"),
        py::arg("height"), py::arg("width"), py::arg("latent"),
        py::arg("batch"), py::arg("text_len"), py::arg("options"),
        "JSON text of megaslide-plan --format json.");
  m.def("dsa3d_forward", &dsa3dForward, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("offsets"), py::arg("window"), py::arg("tile"),
        py::arg("scale"),
        "3D-DSA forward on float32 [B, H, T, Y, X, D]: (out, lse).");
  m.def("dsa3d_backward", &dsa3dBackward, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("offsets"), py::arg("out"), py::arg("d_out"),
        py::arg("lse"), py::arg("window"), py::arg("tile"), py::arg("scale"),
        "3D-DSA backward from the forward's out and lse: (dq, dk, dv).");
  m.def("dsa3d_offsets", &dsa3dOffsets, py::arg("q"), py::arg("k"),
        py::arg("window"), py::arg("tile"), py::arg("radius"),
        "3D-DSA block-matching offsets, int32 [B, H, nT, nY, nX, kt, 2].");
  m.def("exec_plan_json", &execPlanJson, py::arg("model"), py::arg("frames"),
        py::arg("height"), py::arg("width"), py::arg("latent"),
        py::arg("batch"), py::arg("text_len"), py::arg("options"),
        "The execution plan of a training step (docs/ExecutionPlan.md).");
  defineAdamW(m);
  defineTrainer(m);
  defineCompiler(m);
}
