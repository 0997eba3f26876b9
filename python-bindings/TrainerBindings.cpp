//===- TrainerBindings.cpp - megaslide.Trainer over the runtime -----------===//
//
// A training session (runtime/train/Session) driven from Python: the plan
// comes as its JSON text (compiled through the C API or read from a file),
// numpy arrays go in and out. No MLIR here.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cpu/Convert.h"
#include "megaslide/runtime/dist/Collectives.h"
#include "megaslide/runtime/host/Weights.h"
#include "megaslide/runtime/plan/ExecPlanJson.h"
#include "megaslide/runtime/trace/ChromeTrace.h"
#include "megaslide/runtime/train/Session.h"
#include "megaslide/runtime/train/TrainingRun.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "llvm/ADT/STLExtras.h"

#include <atomic>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>

namespace py = pybind11;
using namespace megaslide;

namespace {

using FloatArray =
    py::array_t<float, py::array::c_style | py::array::forcecast>;

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

/// Serialises the calls on one Trainer. A second thread waits for the
/// first call to end; it waits without the GIL, since the holder releases
/// the GIL while it computes and needs it back to return. A call from the
/// thread that holds the Trainer (a finaliser run inside a call) raises
/// instead of deadlocking.
class CallGuard {
public:
  CallGuard(std::mutex &mutex, std::atomic<std::thread::id> &owner,
            const char *what)
      : mutex(mutex), owner(owner) {
    if (owner.load() == std::this_thread::get_id())
      throw std::runtime_error(std::string(what) +
                               ": this thread is already inside a call on "
                               "this Trainer");
    if (!mutex.try_lock()) {
      py::gil_scoped_release release;
      mutex.lock();
    }
    owner.store(std::this_thread::get_id());
  }
  ~CallGuard() {
    owner.store(std::thread::id());
    mutex.unlock();
  }
  CallGuard(const CallGuard &) = delete;
  CallGuard &operator=(const CallGuard &) = delete;

private:
  std::mutex &mutex;
  std::atomic<std::thread::id> &owner;
};

/// Raises a KeyboardInterrupt (or another signal handler's exception)
/// that is pending before a step starts: a Ctrl-C pressed while this
/// thread waited for another's step stops here, not one step later.
void checkSignals() {
  if (PyErr_CheckSignals() != 0)
    throw py::error_already_set();
}

class Trainer {
public:
  Trainer(const std::string &planJson, const std::string &source,
          const std::string &backend, uint64_t seed,
          const std::string &hardwarePath, const py::dict &recipe,
          const std::string &valData, const py::dict &runOptions) {
    // One process per Trainer: under a launcher each rank would train on
    // its own, silently (docs/Python.md, "Under mpirun").
    llvm::Expected<dist::World> world = dist::worldFromEnvironment();
    if (!world)
      raise(world.takeError());
    if (world->size > 1)
      throw std::runtime_error(
          "megaslide.Trainer runs in one process, and this is rank " +
          std::to_string(world->rank) + " of " + std::to_string(world->size) +
          " started by " + world->launcher +
          ": data-parallel training is megaslide-run's (mpirun -np N "
          "megaslide-run ...; docs/Distributed.md)");
    // The run's outputs first: a folder held by another run, or an
    // unwritable log, fails before the plan is loaded.
    train::RunOptions o;
    o.spell = train::pythonSpelling;
    o.toolName = "megaslide.Trainer";
    // resume() may come before the first step.
    o.refuseEarlierRunAtOpen = false;
    for (const auto &[key, value] : runOptions) {
      std::string k = py::cast<std::string>(key);
      if (k == "checkpoint_dir")
        o.checkpointDir = py::cast<std::string>(value);
      else if (k == "checkpoint_every")
        o.checkpointEvery = py::cast<int64_t>(value);
      else if (k == "overwrite_checkpoints")
        o.overwriteCheckpoints = py::cast<bool>(value);
      else if (k == "metrics")
        o.metricsPath = py::cast<std::string>(value);
      else if (k == "report")
        o.reportPath = py::cast<std::string>(value);
      else if (k == "val_every")
        o.valEvery = py::cast<int64_t>(value);
      else if (k == "max_nonfinite_steps")
        o.maxNonFiniteSteps = py::cast<int64_t>(value);
      else
        throw std::invalid_argument("unknown run option '" + k + "'");
    }
    if (recipe.contains("lr_decay_steps"))
      o.lrDecaySteps = py::cast<int64_t>(recipe["lr_decay_steps"]);
    if (!o.checkpointDir.empty() && backend == "sim")
      throw std::invalid_argument("checkpoint_dir: the sim backend holds no "
                                  "model state to checkpoint");
    if (o.valEvery && valData.empty())
      throw std::invalid_argument("val_every needs val_data");
    run = check(train::TrainingRun::open(std::move(o)));
    exec::ExecPlan plan = check(exec::parseExecPlan(planJson, source));
    train::SessionOptions options;
    options.backend = backend;
    options.seed = seed;
    options.hardwarePath = hardwarePath;
    options.recipe = recipeOf(recipe);
    // The plan's header says what it was compiled for (megaslide-exec reads
    // the same); a recipe asking for something else is an error, not a
    // silent second truth.
    train::Recipe &r = options.recipe;
    if (recipe.contains("grad_accum") && r.gradAccum != plan.gradAccum)
      throw std::invalid_argument(
          "grad_accum " + std::to_string(r.gradAccum) +
          " differs from the plan's " + std::to_string(plan.gradAccum) +
          " (compile the plan with grad_accum)");
    if (recipe.contains("ema_bf16") && r.emaBf16 != (plan.emaDtype == "bf16"))
      throw std::invalid_argument("ema_bf16 differs from the plan's EMA dtype "
                                  "'" + plan.emaDtype + "'");
    r.gradAccum = plan.gradAccum;
    r.emaBf16 = plan.emaDtype == "bf16";
    options.valDataDir = valData;
    session = check(train::Session::create(std::move(plan), options));
    run->attach(*session);
  }

  /// The recipe of megaslide.Trainer's keyword arguments, already type
  /// checked in Python (megaslide/_trainer.py); ranges are Session's.
  static train::Recipe recipeOf(const py::dict &d) {
    train::Recipe r;
    for (const auto &[key, value] : d) {
      std::string k = py::cast<std::string>(key);
      if (k == "lr_schedule") {
        std::string name = py::cast<std::string>(value);
        std::optional<train::LrSchedule> v = train::parseLrSchedule(name);
        if (!v)
          throw std::invalid_argument(
              "lr_schedule must be constant, warmup-constant, warmup-cosine "
              "or warmup-linear, got '" +
              name + "'");
        r.lrSchedule = *v;
      } else if (k == "timestep_sampling") {
        std::string name = py::cast<std::string>(value);
        std::optional<train::TimestepSampling> v =
            train::parseTimestepSampling(name);
        if (!v)
          throw std::invalid_argument("timestep_sampling must be uniform or "
                                      "logit-normal, got '" +
                                      name + "'");
        r.timesteps = *v;
      } else if (k == "weighting_scheme") {
        std::string name = py::cast<std::string>(value);
        std::optional<train::LossWeighting> v = train::parseLossWeighting(name);
        if (!v)
          throw std::invalid_argument("weighting_scheme must be " +
                                      train::lossWeightingNames() + ", got '" +
                                      name + "'");
        r.weighting = *v;
      } else if (k == "warmup_steps") {
        r.warmupSteps = py::cast<int64_t>(value);
      } else if (k == "lr_decay_steps") {
        r.decaySteps = py::cast<int64_t>(value);
      } else if (k == "grad_accum") {
        r.gradAccum = py::cast<int64_t>(value);
      } else if (k == "min_lr") {
        r.minLr = py::cast<double>(value);
      } else if (k == "max_grad_norm") {
        r.maxGradNorm = py::cast<double>(value);
      } else if (k == "ema_decay") {
        r.emaDecay = py::cast<double>(value);
      } else if (k == "ema_warmup") {
        r.emaWarmup = py::cast<bool>(value);
      } else if (k == "ema_bf16") {
        r.emaBf16 = py::cast<bool>(value);
      } else if (k == "logit_mean") {
        r.logitMean = py::cast<double>(value);
      } else if (k == "logit_std") {
        r.logitStd = py::cast<double>(value);
      } else if (k == "flow_shift") {
        r.flowShift = py::cast<double>(value);
      } else if (k == "min_timestep") {
        r.minTimestep = py::cast<double>(value);
      } else if (k == "max_timestep") {
        r.maxTimestep = py::cast<double>(value);
      } else if (k == "boundary") {
        r.boundary = py::cast<double>(value);
      } else {
        throw std::invalid_argument("unknown recipe option '" + k + "'");
      }
    }
    return r;
  }

  CallGuard guard(const char *what) const {
    return CallGuard(mutex, owner, what);
  }

  /// Throws once close() has ended the run.
  train::TrainingRun &openRun(const char *what) const {
    if (!run)
      throw std::invalid_argument(std::string(what) +
                                  ": the Trainer is closed");
    return *run;
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

  /// Whether the caller gives step input `name`: not the optimizer step
  /// and not a weighted loss's weights, which the session derives (from
  /// HostState::step and the timesteps).
  static bool given(llvm::StringRef name) {
    return name != "step" && name != exec::kLossWeightsInput;
  }

  py::dict inputShapes() const {
    py::dict shapes;
    for (int64_t id : session->plan().inputs) {
      const exec::Value &v = session->plan().values[id];
      if (given(v.name))
        shapes[py::str(v.name)] = py::tuple(py::cast(v.type.shape));
    }
    return shapes;
  }

  py::dict parameters() const {
    CallGuard lock = guard("parameters");
    requireState("parameters");
    py::dict out;
    for (const host::HostTensor &t : session->state().tensors) {
      if (t.param->role == "moment" || t.param->role == "ema")
        continue;
      FloatArray a(t.param->type.shape);
      std::copy(t.data.begin(), t.data.end(), a.mutable_data());
      out[py::str(t.param->name)] = a;
    }
    return out;
  }

  void loadParameters(const py::dict &params) {
    // Converted before the lock: converting may run Python code.
    std::vector<std::pair<std::string, FloatArray>> arrays;
    for (const auto &[key, value] : params)
      arrays.emplace_back(py::cast<std::string>(key),
                          py::cast<FloatArray>(value));
    CallGuard lock = guard("load_parameters");
    requireState("load_parameters");
    for (const auto &[name, a] : arrays) {
      host::HostTensor *t = session->state().find(name);
      if (!t || t->param->role == "moment" || t->param->role == "ema")
        throw std::invalid_argument("load_parameters: the plan has no "
                                    "parameter '" +
                                    name + "'");
      std::vector<int64_t> shape(a.shape(), a.shape() + a.ndim());
      if (shape != t->param->type.shape)
        throw std::invalid_argument(
            "load_parameters: '" + name + "' has shape " + shapeText(shape) +
            "; the plan expects " + shapeText(t->param->type.shape));
      std::copy(a.data(), a.data() + a.size(), t->data.begin());
    }
  }

  /// The step inputs of `arrays`, checked: exactly the plan's inputs a
  /// caller gives (given()), each
  /// a numpy array of the plan's shape and of dtype float32 (an integer
  /// dtype for an integer input, e.g. DiT's class labels), nothing cast
  /// silently; timesteps in [0, 1], the flow-matching time of
  /// flow_interpolate (x_t = (1 - t) x0 + t noise). Reads only the plan,
  /// which no call changes, so it runs before the Trainer is locked.
  exec::StepInputs stepInputs(const py::dict &arrays, const char *method,
                              int64_t microBatches = 1) const {
    const exec::ExecPlan &plan = session->plan();
    std::string names;
    for (int64_t id : plan.inputs)
      if (given(plan.values[id].name))
        names += (names.empty() ? "" : ", ") + plan.values[id].name;
    for (const auto &item : arrays) {
      std::string key = py::str(item.first);
      if (!given(key) || llvm::none_of(plan.inputs, [&](int64_t id) {
            return plan.values[id].name == key;
          }))
        throw py::type_error(std::string(method) +
                             "() got an unexpected input '" + key +
                             "'; the plan takes " + names);
    }
    exec::StepInputs inputs;
    for (int64_t id : plan.inputs) {
      const exec::Value &v = plan.values[id];
      if (!given(v.name))
        continue;
      if (!arrays.contains(v.name)) {
        if (v.name == "timesteps" && std::string(method) == "step")
          continue; // the recipe's timestep sampling
        throw std::invalid_argument("missing step input '" + v.name + "'");
      }
      py::object value = arrays[py::str(v.name)];
      if (!py::isinstance<py::array>(value))
        throw py::type_error(
            "step input '" + v.name + "' must be a numpy.ndarray, got " +
            py::str(py::type::handle_of(value).attr("__name__"))
                .cast<std::string>());
      py::array array = py::reinterpret_borrow<py::array>(value);
      bool integer =
          v.type.dtype == exec::DType::I64 || v.type.dtype == exec::DType::I32;
      char kind = array.dtype().kind();
      if (integer ? kind != 'i' && kind != 'u'
                  : !array.dtype().is(py::dtype::of<float>()))
        throw py::type_error(
            "step input '" + v.name + "' must have " +
            (integer ? "an integer dtype" : "dtype float32") + ", got " +
            py::str(array.dtype()).cast<std::string>() +
            (integer ? "" : " (convert with .astype(np.float32))"));
      std::vector<int64_t> shape(array.shape(), array.shape() + array.ndim());
      std::vector<int64_t> expected = v.type.shape;
      expected[0] *= microBatches; // grad_accum micro-batches, in order
      if (shape != expected)
        throw std::invalid_argument(
            "step input '" + v.name + "' has shape " + shapeText(shape) +
            "; the plan expects " + shapeText(expected) +
            (microBatches > 1 ? " (grad_accum micro-batches of " +
                                    shapeText(v.type.shape) + ")"
                              : std::string()));
      std::vector<float> &data = inputs[v.name];
      if (integer) {
        // Exact in fp32 up to 2^24: far above any class count.
        using I64Array =
            py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
        I64Array ints = I64Array::ensure(array);
        if (!ints)
          throw py::error_already_set();
        for (py::ssize_t i = 0; i < ints.size(); ++i) {
          int64_t x = ints.data()[i];
          if (x < 0 || x > (int64_t(1) << 24))
            throw std::invalid_argument(
                "step input '" + v.name + "' must hold class labels in [0, " +
                std::to_string(int64_t(1) << 24) + "], got " +
                std::to_string(x) + " at flat index " + std::to_string(i));
          data.push_back(static_cast<float>(x));
        }
        continue;
      }
      FloatArray a = FloatArray::ensure(array);
      if (!a)
        throw py::error_already_set();
      data.assign(a.data(), a.data() + a.size());
      if (v.name == "timesteps")
        for (size_t i = 0; i < data.size(); ++i)
          if (!(data[i] >= 0.0f && data[i] <= 1.0f))
            throw std::invalid_argument(
                "step input 'timesteps' must be in [0, 1] (the flow-matching "
                "time t of x_t = (1 - t) x0 + t noise), got " +
                py::str(array.attr("flat")[py::int_(i)]).cast<std::string>() +
                " at index " + std::to_string(i));
    }
    return inputs;
  }

  py::tuple gradients(const py::dict &arrays) {
    requireState("gradients");
    exec::StepInputs inputs = stepInputs(arrays, "gradients");
    CallGuard lock = guard("gradients");
    checkSignals();
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

  /// The model's velocity prediction at x_t = (1 - t) x0 + t noise: the
  /// forward of one step without an update, read where flow_matching_loss
  /// takes it (StepOptions::onPrediction).
  FloatArray predict(const py::dict &arrays) {
    requireState("predict");
    if (session->backend().name() != std::string("cpu"))
      throw std::invalid_argument(
          std::string("predict: the ") + session->backend().name() +
          " backend does not return the model's prediction; use "
          "backend='cpu'");
    exec::StepInputs inputs = stepInputs(arrays, "predict");
    CallGuard lock = guard("predict");
    checkSignals();
    std::vector<int64_t> shape;
    std::vector<float> prediction;
    exec::StepOptions options;
    options.applyUpdates = false;
    options.onPrediction = [&](llvm::ArrayRef<int64_t> s,
                               llvm::ArrayRef<float> p) {
      shape.assign(s.begin(), s.end());
      prediction.assign(p.begin(), p.end());
    };
    {
      py::gil_scoped_release release;
      check(session->runStep(inputs, options));
    }
    if (shape.empty())
      throw std::runtime_error("predict: the plan computes no "
                               "flow_matching_loss, so it has no prediction");
    FloatArray a(shape);
    std::copy(prediction.begin(), prediction.end(), a.mutable_data());
    return a;
  }

  py::dict step(const py::object &arrays, const std::string &tracePath) {
    int64_t K = session->recipe().gradAccum;
    std::vector<exec::StepInputs> batches;
    if (!arrays.is_none()) {
      exec::StepInputs all = stepInputs(py::cast<py::dict>(arrays), "step", K);
      batches.resize(K);
      for (auto &[name, data] : all) {
        size_t per = data.size() / K;
        for (int64_t k = 0; k < K; ++k)
          batches[k][name].assign(data.begin() + k * per,
                                  data.begin() + (k + 1) * per);
      }
    }
    CallGuard lock = guard("step");
    openRun("step");
    checkSignals();
    bool trace = !tracePath.empty();
    // Created first, so an unwritable path fails before the step is taken.
    std::unique_ptr<trace::ChromeTrace> writer;
    if (trace)
      writer = check(trace::ChromeTrace::create(
          tracePath, "megaslide.Trainer " + session->plan().model + " (" +
                         session->backend().name() + ")"));
    train::RunStep taken;
    {
      exec::StepOptions options;
      options.trace = trace;
      py::gil_scoped_release release;
      std::optional<std::vector<exec::StepInputs>> given;
      if (!arrays.is_none())
        given = std::move(batches);
      taken =
          check(run->step(options, /*last=*/false, nullptr, std::move(given)));
    }
    const train::StepReport &report = taken.report;
    const exec::StepResult &result = report.result;
    if (writer) {
      for (const exec::TraceSpan &span : result.spans)
        writer->complete(span);
      writer->setOtherData("backend", session->backend().name());
      writer->setOtherData("model", session->plan().model);
      writer->setOtherData("step", session->step());
      writer->setOtherData("step_seconds", result.seconds);
      if (llvm::Error err = writer->finish())
        raise(std::move(err));
    }
    py::dict out;
    if (session->backend().computesLoss())
      out["loss"] = result.loss;
    else
      out["loss"] = py::none();
    out["unweighted_loss"] =
        result.unweightedLoss ? py::cast(*result.unweightedLoss) : py::none();
    out["grad_norm"] =
        report.gradNorm ? py::cast(*report.gradNorm) : py::none();
    out["lr"] = report.lr;
    out["clipped"] = report.clipped;
    out["micro_batches"] = report.microBatches;
    out["seconds"] = result.seconds;
    out["step"] = session->step();
    out["skipped"] = result.skipped;
    out["planned_peak_bytes"] = result.memory.plannedArenaBytes;
    out["measured_peak_bytes"] = result.memory.measuredArenaBytes;
    out["planned_live_bytes"] = result.memory.plannedLiveBytes;
    out["measured_live_bytes"] = result.memory.measuredLiveBytes;
    out["val_loss"] = taken.valLoss ? py::cast(*taken.valLoss) : py::none();
    if (report.expert) // Wan 2.2's two experts: which one stepped
      out["expert"] = train::expertName(*report.expert).str();
    return out;
  }

  /// `steps` steps as megaslide-run takes them (train::TrainingRun::train):
  /// the last one validated and checkpointed. Ctrl-C ends the loop at the
  /// step boundary, saves a checkpoint where there is a folder for it and
  /// raises KeyboardInterrupt.
  py::dict train(int64_t steps) {
    if (steps < 0)
      throw std::invalid_argument("train: steps must be non-negative");
    CallGuard lock = guard("train");
    openRun("train");
    checkSignals();
    std::optional<py::error_already_set> interrupt;
    auto stopRequested = [&] {
      py::gil_scoped_acquire acquire;
      if (PyErr_CheckSignals() == 0)
        return false;
      interrupt.emplace();
      return true;
    };
    // This call's figures, not the Trainer's whole life's.
    int64_t skipped = 0;
    double seconds = 0;
    std::optional<float> firstLoss, lastLoss;
    auto afterStep = [&](const train::RunStep &step) {
      const exec::StepResult &r = step.report.result;
      seconds += r.seconds;
      if (r.skipped) {
        ++skipped;
        return;
      }
      if (!firstLoss)
        firstLoss = r.loss;
      lastLoss = r.loss;
    };
    train::TrainingRun::Hooks hooks;
    hooks.stopRequested = stopRequested;
    hooks.afterStep = afterStep;
    int64_t done = 0;
    {
      py::gil_scoped_release release;
      done = check(run->train(steps, hooks));
      if (interrupt) {
        if (run->writesCheckpoints() && done > 0)
          if (llvm::Error e = run->checkpoint())
            raise(run->failAfterSaving(llvm::toString(std::move(e))));
        if (llvm::Error e = run->finish(/*whole=*/false))
          raise(std::move(e));
      } else if (llvm::Error e = run->finish(/*whole=*/true)) {
        raise(std::move(e));
      }
    }
    if (interrupt)
      throw std::move(*interrupt);
    bool losses = session->backend().computesLoss();
    py::dict out;
    out["steps"] = done;
    out["step"] = session->step();
    out["skipped"] = skipped;
    out["first_loss"] = losses && firstLoss ? py::cast(*firstLoss) : py::none();
    out["last_loss"] = losses && lastLoss ? py::cast(*lastLoss) : py::none();
    out["seconds"] = seconds;
    return out;
  }

  int64_t resume() {
    CallGuard lock = guard("resume");
    requireState("resume");
    openRun("resume");
    py::gil_scoped_release release;
    if (llvm::Error e = run->resume())
      raise(std::move(e));
    return session->step();
  }

  void checkpoint() {
    CallGuard lock = guard("checkpoint");
    requireState("checkpoint");
    if (!openRun("checkpoint").writesCheckpoints())
      throw std::invalid_argument("checkpoint: this Trainer has no "
                                  "checkpoint_dir");
    py::gil_scoped_release release;
    if (llvm::Error e = run->checkpoint())
      raise(std::move(e));
  }

  /// Writes the report (and finishes the run's outputs) and releases the
  /// checkpoint folder; the Trainer takes no step after it.
  void close() {
    CallGuard lock = guard("close");
    if (!run)
      return;
    llvm::Error e = run->finish(/*whole=*/false);
    run.reset();
    if (e)
      raise(std::move(e));
  }

  py::dict optimizerState() {
    CallGuard lock = guard("optimizer_state");
    requireState("optimizer_state");
    host::HostState &state = session->state();
    py::dict out;
    for (const host::HostTensor &t : state.tensors) {
      if (t.param->role != "master")
        continue;
      const host::HostTensor *m = state.expAvg(t.param->name);
      const host::HostTensor *v = state.expAvgSq(t.param->name);
      if (!m || !v)
        continue;
      py::dict moments;
      for (auto [key, tensor] : {std::pair{"exp_avg", m}, {"exp_avg_sq", v}}) {
        FloatArray a(t.param->type.shape);
        std::vector<float> values = host::momentValues(*tensor);
        std::copy(values.begin(), values.end(), a.mutable_data());
        moments[key] = a;
      }
      out[py::str(t.param->name)] = moments;
    }
    return out;
  }

  float validationLoss() {
    CallGuard lock = guard("validation_loss");
    requireState("validation_loss");
    py::gil_scoped_release release;
    return check(session->validationLoss());
  }

  py::dict emaParameters() {
    CallGuard lock = guard("ema_parameters");
    requireState("ema_parameters");
    if (!session->recipe().hasEma())
      throw std::invalid_argument(
          "ema_parameters: this Trainer keeps no EMA (give ema_decay)");
    py::dict out;
    for (const host::HostTensor &t : session->state().tensors) {
      if (t.param->role != "ema")
        continue;
      FloatArray a(t.param->type.shape);
      if (t.bf16.empty())
        std::copy(t.data.begin(), t.data.end(), a.mutable_data());
      else
        cpu::widen(t.bf16.data(), exec::DType::BF16, t.bf16.size(),
                   a.mutable_data());
      out[py::str(t.param->of)] = a;
    }
    return out;
  }

  void loadWeights(const std::string &path) {
    CallGuard lock = guard("load_weights");
    requireState("load_weights");
    py::gil_scoped_release release;
    if (llvm::Error err = train::loadSessionWeights(*session, path))
      raise(std::move(err));
  }

  void saveWeights(const std::string &dir, const std::string &dtype,
                   uint64_t maxShardBytes, bool ema) {
    CallGuard lock = guard("save_weights");
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
            train::saveSessionWeights(*session, dir, options, ema))
      raise(std::move(err));
  }

  void savePlan(const std::string &path) const {
    CallGuard lock = guard("save_plan");
    if (llvm::Error err = exec::saveExecPlan(session->plan(), path))
      raise(std::move(err));
  }

  std::string planJson() const { return exec::serialize(session->plan()); }
  bool computesLoss() const { return session->backend().computesLoss(); }
  int64_t stepCount() const {
    CallGuard lock = guard("step_count");
    return session->step();
  }
  std::string backendName() const { return session->backend().name(); }

private:
  // Declared first, destroyed last: the run's outputs refer to the session.
  std::unique_ptr<train::Session> session;
  std::unique_ptr<train::TrainingRun> run;
  mutable std::mutex mutex;
  mutable std::atomic<std::thread::id> owner{};
};

} // namespace

/// Registers megaslide._megaslide.Trainer (wrapped by megaslide.Trainer).
void defineTrainer(py::module_ &m) {
  py::class_<Trainer>(m, "Trainer")
      .def(py::init<const std::string &, const std::string &,
                    const std::string &, uint64_t, const std::string &,
                    const py::dict &, const std::string &, const py::dict &>(),
           py::arg("plan_json"), py::arg("source"), py::arg("backend"),
           py::arg("seed"), py::arg("hardware_path"), py::arg("recipe"),
           py::arg("val_data"), py::arg("run"))
      .def("train", &Trainer::train, py::arg("steps"))
      .def("resume", &Trainer::resume)
      .def("checkpoint", &Trainer::checkpoint)
      .def("close", &Trainer::close)
      .def("validation_loss", &Trainer::validationLoss)
      .def("optimizer_state", &Trainer::optimizerState)
      .def("ema_parameters", &Trainer::emaParameters)
      .def("input_shapes", &Trainer::inputShapes)
      .def("parameters", &Trainer::parameters)
      .def("load_parameters", &Trainer::loadParameters, py::arg("params"))
      .def("gradients", &Trainer::gradients, py::arg("inputs"))
      .def("predict", &Trainer::predict, py::arg("inputs"))
      .def("step", &Trainer::step, py::arg("inputs"), py::arg("trace"))
      .def("load_weights", &Trainer::loadWeights, py::arg("path"))
      .def("save_weights", &Trainer::saveWeights, py::arg("dir"),
           py::arg("dtype"), py::arg("max_shard_bytes"), py::arg("ema"))
      .def("save_plan", &Trainer::savePlan, py::arg("path"))
      .def("plan_json", &Trainer::planJson)
      .def_property_readonly("computes_loss", &Trainer::computesLoss)
      .def_property_readonly("step_count", &Trainer::stepCount)
      .def_property_readonly("backend", &Trainer::backendName);
  m.def(
      "sample_sigmas",
      [](uint64_t seed, int64_t step, int64_t count, const py::dict &recipe) {
        if (count < 0 || step < 0)
          throw std::invalid_argument("step and count must be non-negative");
        train::Recipe r = Trainer::recipeOf(recipe);
        if (llvm::Error e = train::checkRecipe(r, INFINITY))
          raise(std::move(e));
        std::vector<float> sigmas = train::sampleSigmas(r, seed, step, count);
        // A vector shape: a braced single size would make a zero-stride view.
        FloatArray a(std::vector<py::ssize_t>{static_cast<py::ssize_t>(count)});
        std::copy(sigmas.begin(), sigmas.end(), a.mutable_data());
        return a;
      },
      py::arg("seed"), py::arg("step"), py::arg("count"), py::arg("recipe"));
  m.def(
      "loss_weights",
      [](const FloatArray &sigmas, const py::dict &recipe) {
        train::Recipe r = Trainer::recipeOf(recipe);
        if (llvm::Error e = train::checkRecipe(r, INFINITY))
          raise(std::move(e));
        std::vector<float> weights = train::lossWeights(
            r, llvm::ArrayRef<float>(sigmas.data(), sigmas.size()));
        FloatArray a(
            std::vector<py::ssize_t>{static_cast<py::ssize_t>(weights.size())});
        std::copy(weights.begin(), weights.end(), a.mutable_data());
        return a;
      },
      py::arg("sigmas"), py::arg("recipe"));
}
