//===- TrainerBindings.cpp - megaslide.Trainer over the runtime -----------===//
//
// A training session (runtime/train/Session) driven from Python: the plan
// comes as its JSON text (compiled through the C API or read from a file),
// numpy arrays go in and out. No MLIR here.
//
//===----------------------------------------------------------------------===//

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
          const std::string &backend, uint64_t seed) {
    exec::ExecPlan plan = check(exec::parseExecPlan(planJson, source));
    train::SessionOptions options;
    options.backend = backend;
    options.seed = seed;
    session = check(train::Session::create(std::move(plan), options));
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

  py::dict step(const py::object &arrays) {
    exec::StepResult result;
    if (arrays.is_none()) {
      py::gil_scoped_release release;
      result = check(session->trainStep(/*trace=*/false));
    } else {
      exec::StepInputs inputs = stepInputs(py::cast<py::dict>(arrays));
      py::gil_scoped_release release;
      result = check(session->runStep(inputs, exec::StepOptions()));
    }
    py::dict out;
    out["loss"] = result.loss;
    out["seconds"] = result.seconds;
    out["step"] = session->state().step;
    out["planned_peak_bytes"] = result.memory.plannedArenaBytes;
    out["measured_peak_bytes"] = result.memory.measuredArenaBytes;
    out["planned_live_bytes"] = result.memory.plannedLiveBytes;
    out["measured_live_bytes"] = result.memory.measuredLiveBytes;
    return out;
  }

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
                    const std::string &, uint64_t>(),
           py::arg("plan_json"), py::arg("source"), py::arg("backend"),
           py::arg("seed"))
      .def("input_shapes", &Trainer::inputShapes)
      .def("parameters", &Trainer::parameters)
      .def("load_parameters", &Trainer::loadParameters, py::arg("params"))
      .def("gradients", &Trainer::gradients, py::arg("inputs"))
      .def("step", &Trainer::step, py::arg("inputs"))
      .def_property_readonly("step_count", &Trainer::stepCount)
      .def_property_readonly("backend", &Trainer::backendName);
}
