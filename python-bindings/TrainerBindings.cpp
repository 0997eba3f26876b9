//===- TrainerBindings.cpp - megaslide.Trainer over the runtime -----------===//
//
// A training session (runtime/train/Session) driven from Python: the plan
// comes as its JSON text (compiled through the C API or read from a file),
// numpy arrays go in and out. No MLIR here.
//
//===----------------------------------------------------------------------===//

#include "host/Weights.h"
#include "trace/ChromeTrace.h"
#include "train/Session.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>

namespace py = pybind11;
using namespace megaslide;

namespace {

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

[[noreturn]] void raise(llvm::Error err) {
  throw std::invalid_argument(llvm::toString(std::move(err)));
}

template <typename T> T check(llvm::Expected<T> value) {
  if (!value)
    raise(value.takeError());
  return std::move(*value);
}

std::string shapeText(llvm::ArrayRef<int64_t> shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

class Trainer {
public:
  Trainer(const std::string &planJson, const std::string &source,
          const std::string &backend, uint64_t seed,
          const std::string &hardwarePath) {
    exec::ExecPlan plan = check(exec::parseExecPlan(planJson, source));
    train::SessionOptions options;
    options.backend = backend;
    options.seed = seed;
    options.hardwarePath = hardwarePath;
    session = check(train::Session::create(std::move(plan), options));
  }

  /// Throws unless the backend holds the model state (cpu, cuda): sim
  /// replays the schedule without allocating it.
  void requireState(const char *what) const {
    if (!session->backend().computesLoss())
      throw std::invalid_argument(
          std::string(what) + ": the " + session->backend().name() +
          " backend holds no model state (it predicts timing only); use "
          "backend='cpu' or 'cuda'");
  }

  py::dict inputShapes() const {
    py::dict shapes;
    for (int64_t id : session->plan().inputs) {
      const exec::Value &v = session->plan().values[id];
      if (v.name != "step")
        shapes[py::str(v.name)] = py::tuple(py::cast(v.type.shape));
    }
    return shapes;
  }

  py::dict parameters() const {
    requireState("parameters");
    py::dict out;
    for (const host::HostTensor &t : session->state().tensors) {
      if (t.param->role == "moment")
        continue;
      FloatArray a(t.param->type.shape);
      std::copy(t.data.begin(), t.data.end(), a.mutable_data());
      out[py::str(t.param->name)] = a;
    }
    return out;
  }

  void loadParameters(const py::dict &params) {
    requireState("load_parameters");
    for (const auto &[key, value] : params) {
      std::string name = py::cast<std::string>(key);
      host::HostTensor *t = session->state().find(name);
      if (!t || t->param->role == "moment")
        throw std::invalid_argument("load_parameters: the plan has no "
                                    "parameter '" + name + "'");
      FloatArray a = py::cast<FloatArray>(value);
      std::vector<int64_t> shape(a.shape(), a.shape() + a.ndim());
      if (shape != t->param->type.shape)
        throw std::invalid_argument(
            "load_parameters: '" + name + "' has shape " + shapeText(shape) +
            "; the plan expects " + shapeText(t->param->type.shape));
      std::copy(a.data(), a.data() + a.size(), t->data.begin());
    }
  }

  exec::StepInputs stepInputs(const py::dict &arrays) const {
    exec::StepInputs inputs;
    for (int64_t id : session->plan().inputs) {
      const exec::Value &v = session->plan().values[id];
      if (v.name == "step")
        continue;
      if (!arrays.contains(v.name))
        throw std::invalid_argument("missing step input '" + v.name + "'");
      FloatArray a = py::cast<FloatArray>(arrays[py::str(v.name)]);
      std::vector<int64_t> shape(a.shape(), a.shape() + a.ndim());
      if (shape != v.type.shape)
        throw std::invalid_argument("step input '" + v.name + "' has shape " +
                                    shapeText(shape) + "; the plan expects " +
                                    shapeText(v.type.shape));
      inputs[v.name].assign(a.data(), a.data() + a.size());
    }
    return inputs;
  }

  py::tuple gradients(const py::dict &arrays) {
    requireState("gradients");
    exec::StepInputs inputs = stepInputs(arrays);
    std::map<std::string, std::vector<float>> grads;
    exec::StepOptions options;
    options.applyUpdates = false;
    options.onGradient = [&](llvm::StringRef name, llvm::ArrayRef<float> g) {
      grads[name.str()].assign(g.begin(), g.end());
    };
    exec::StepResult result = [&] {
      py::gil_scoped_release release;
      return check(session->runStep(inputs, options));
    }();
    py::dict out;
    for (auto &[name, g] : grads) {
      const host::HostTensor *t = session->state().find(name);
      FloatArray a(t->param->type.shape);
      std::copy(g.begin(), g.end(), a.mutable_data());
      out[py::str(name)] = a;
    }
    return py::make_tuple(result.loss, out);
  }

  py::dict step(const py::object &arrays, const std::string &tracePath) {
    bool trace = !tracePath.empty();
    // Created first, so an unwritable path fails before the step is taken.
    std::unique_ptr<trace::ChromeTrace> writer;
    if (trace)
      writer = check(trace::ChromeTrace::create(
          tracePath, "megaslide.Trainer " + session->plan().model + " (" +
                         session->backend().name() + ")"));
    exec::StepResult result;
    if (arrays.is_none()) {
      py::gil_scoped_release release;
      result = check(session->trainStep(trace));
    } else {
      exec::StepInputs inputs = stepInputs(py::cast<py::dict>(arrays));
      exec::StepOptions options;
      options.trace = trace;
      py::gil_scoped_release release;
      result = check(session->runStep(inputs, options));
    }
    if (writer) {
      for (const exec::TraceSpan &span : result.spans)
        writer->complete(span);
      writer->setOtherData("backend", session->backend().name());
      writer->setOtherData("model", session->plan().model);
      writer->setOtherData("step", session->state().step);
      writer->setOtherData("step_seconds", result.seconds);
      if (llvm::Error err = writer->finish())
        raise(std::move(err));
    }
    py::dict out;
    if (session->backend().computesLoss())
      out["loss"] = result.loss;
    else
      out["loss"] = py::none();
    out["seconds"] = result.seconds;
    out["step"] = session->state().step;
    out["planned_peak_bytes"] = result.memory.plannedArenaBytes;
    out["measured_peak_bytes"] = result.memory.measuredArenaBytes;
    out["planned_live_bytes"] = result.memory.plannedLiveBytes;
    out["measured_live_bytes"] = result.memory.measuredLiveBytes;
    return out;
  }

  void loadWeights(const std::string &path) {
    requireState("load_weights");
    py::gil_scoped_release release;
    if (llvm::Error err = host::loadWeights(path, session->state()))
      raise(std::move(err));
  }

  void saveWeights(const std::string &dir, const std::string &dtype,
                   uint64_t maxShardBytes) {
    requireState("save_weights");
    host::SaveWeightsOptions options;
    if (dtype == "f32")
      options.dtype = host::StDType::F32;
    else if (dtype == "bf16")
      options.dtype = host::StDType::BF16;
    else
      throw std::invalid_argument("save_weights: dtype must be 'f32' or "
                                  "'bf16', got '" +
                                  dtype + "'");
    if (maxShardBytes == 0)
      throw std::invalid_argument("save_weights: max_shard_bytes must be "
                                  "positive");
    options.maxShardBytes = maxShardBytes;
    py::gil_scoped_release release;
    if (llvm::Error err =
            host::saveWeights(session->plan(), session->state(), dir, options))
      raise(std::move(err));
  }

  void savePlan(const std::string &path) const {
    if (llvm::Error err = exec::saveExecPlan(session->plan(), path))
      raise(std::move(err));
  }

  std::string planJson() const { return exec::serialize(session->plan()); }
  bool computesLoss() const { return session->backend().computesLoss(); }
  int64_t stepCount() const { return session->state().step; }
  std::string backendName() const { return session->backend().name(); }

private:
  std::unique_ptr<train::Session> session;
};

} // namespace

/// Registers megaslide._megaslide.Trainer (wrapped by megaslide.Trainer).
void defineTrainer(py::module_ &m) {
  py::class_<Trainer>(m, "Trainer")
      .def(py::init<const std::string &, const std::string &,
                    const std::string &, uint64_t, const std::string &>(),
           py::arg("plan_json"), py::arg("source"), py::arg("backend"),
           py::arg("seed"), py::arg("hardware_path"))
      .def("input_shapes", &Trainer::inputShapes)
      .def("parameters", &Trainer::parameters)
      .def("load_parameters", &Trainer::loadParameters, py::arg("params"))
      .def("gradients", &Trainer::gradients, py::arg("inputs"))
      .def("step", &Trainer::step, py::arg("inputs"), py::arg("trace"))
      .def("load_weights", &Trainer::loadWeights, py::arg("path"))
      .def("save_weights", &Trainer::saveWeights, py::arg("dir"),
           py::arg("dtype"), py::arg("max_shard_bytes"))
      .def("save_plan", &Trainer::savePlan, py::arg("path"))
      .def("plan_json", &Trainer::planJson)
      .def_property_readonly("computes_loss", &Trainer::computesLoss)
      .def_property_readonly("step_count", &Trainer::stepCount)
      .def_property_readonly("backend", &Trainer::backendName);
}
