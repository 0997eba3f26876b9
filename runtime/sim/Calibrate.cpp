//===- Calibrate.cpp - Hardware rates fitted to a measured trace ----------===//

#include "megaslide/runtime/sim/Calibrate.h"
#include "megaslide/runtime/support/Json.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cstdio>
#include <cmath>

using namespace megaslide;
using namespace megaslide::sim;

namespace {

llvm::Error error(const llvm::Twine &message) {
  return llvm::createStringError(llvm::inconvertibleErrorCode(), message);
}

/// The backend a trace names: otherData.backend (the sim backend and the
/// Python trainer), else the "(backend)" of the process name the run
/// driver writes ("megaslide-run tiny (cuda)").
std::string backendOf(const llvm::json::Object &root,
                      const llvm::json::Array &events) {
  if (const llvm::json::Object *other = root.getObject("otherData"))
    if (std::optional<llvm::StringRef> b = other->getString("backend"))
      return b->str();
  for (const llvm::json::Value &e : events) {
    const llvm::json::Object *o = e.getAsObject();
    if (!o || o->getString("ph") != "M" ||
        o->getString("name") != "process_name")
      continue;
    const llvm::json::Object *args = o->getObject("args");
    std::optional<llvm::StringRef> name =
        args ? args->getString("name") : std::nullopt;
    if (!name || !name->ends_with(")"))
      continue;
    size_t open = name->rfind('(');
    if (open != llvm::StringRef::npos)
      return name->slice(open + 1, name->size() - 1).str();
  }
  return "";
}

} // namespace

llvm::Expected<MeasuredTrace> sim::parseMeasuredTrace(llvm::StringRef json,
                                                      llvm::StringRef source) {
  llvm::Expected<llvm::json::Value> parsed = parseJson(json);
  if (!parsed)
    return error(source + ": not a trace: invalid JSON: " +
                 llvm::toString(parsed.takeError()));
  const llvm::json::Object *root = parsed->getAsObject();
  const llvm::json::Array *events =
      root ? root->getArray("traceEvents") : nullptr;
  if (!events)
    return error(source + ": not a trace: no \"traceEvents\" array (the "
                          "Chrome trace `megaslide-run --trace` writes)");
  MeasuredTrace t;
  t.backend = backendOf(*root, *events);
  if (t.backend == "cpu")
    return error(source + ": a trace of the cpu backend: its kernel times "
                          "describe no GPU; calibrate from a cuda trace");
  double first = std::numeric_limits<double>::infinity(), last = 0;
  int64_t firstInstruction = -1;
  for (auto [i, e] : llvm::enumerate(*events)) {
    const llvm::json::Object *o = e.getAsObject();
    if (!o || o->getString("ph") != "X")
      continue;
    std::optional<llvm::StringRef> name = o->getString("name");
    std::optional<llvm::StringRef> cat = o->getString("cat");
    std::optional<double> ts = o->getNumber("ts"), dur = o->getNumber("dur");
    const llvm::json::Object *args = o->getObject("args");
    if (!name || !cat || !ts || !dur || !args)
      continue;
    std::optional<int64_t> instruction = args->getInteger("instruction");
    std::optional<exec::OpCode> op = exec::parseOpCode(name->split(' ').first);
    std::optional<exec::Stream> stream = exec::parseStream(*cat);
    if (!instruction || !op || !stream)
      continue;
    if (!std::isfinite(*ts) || !std::isfinite(*dur) || *dur < 0 || *ts < 0)
      return error(llvm::formatv("{0}: event {1}: \"ts\" and \"dur\" must be "
                                 "finite and not negative",
                                 source, i));
    MeasuredSpan s;
    s.op = *op;
    s.stream = *stream;
    s.start = *ts * 1e-6;
    s.seconds = *dur * 1e-6;
    s.instruction = *instruction;
    s.bytes = args->getInteger("bytes").value_or(0);
    s.flops = args->getInteger("flops").value_or(0);
    if (firstInstruction < 0)
      firstInstruction = s.instruction;
    if (s.instruction == firstInstruction)
      ++t.steps;
    first = std::min(first, s.start);
    last = std::max(last, s.start + s.seconds);
    t.spans.push_back(s);
  }
  bool kernels = llvm::any_of(t.spans, [](const MeasuredSpan &s) {
    return kernelFamilyOf(s.op) != KernelFamily::None;
  });
  if (!kernels)
    return error(source + ": no device kernel events (events named after "
                          "an op, with args.instruction, on the compute "
                          "track): nothing to calibrate");
  t.seconds = last - first;
  return t;
}

namespace {

/// A span with the cost inputs secondsFor takes.
struct Sample {
  const MeasuredSpan *span;
  CostKind kind;
  KernelFamily family;
  exec::CostInputs in;
  exec::DType type = exec::DType::BF16;
};

/// Cost inputs from the trace alone (Calibrate.h says what is assumed).
exec::CostInputs inputsFromTrace(const MeasuredSpan &s) {
  exec::CostInputs in;
  in.bytes = s.bytes;
  switch (kernelFamilyOf(s.op)) {
  case KernelFamily::Gemm:
    in.matmulFlops = s.flops;
    break;
  case KernelFamily::AttentionFwd:
  case KernelFamily::AttentionBwd:
  case KernelFamily::Dsa3dFwd:
  case KernelFamily::Dsa3dBwd:
    in.attentionFlops = s.flops;
    break;
  default:
    in.otherFlops = s.flops;
  }
  if (s.op == exec::OpCode::Fetch)
    in.sourceBytes = 2 * s.bytes; // an fp32 master for a bf16 copy
  return in;
}

double predicted(llvm::ArrayRef<Sample> samples, const HardwareModel &hw) {
  double total = 0;
  for (const Sample &s : samples)
    total += secondsFor(s.kind, s.family, s.in, hw, s.type);
  return total;
}

double measured(llvm::ArrayRef<Sample> samples) {
  double total = 0;
  for (const Sample &s : samples)
    total += s.span->seconds;
  return total;
}

/// y = a + b x through `points`, refitted without those more than 2% above
/// the line; nullopt without two distinct sizes.
struct Line {
  double a, b;
  size_t used;
};
std::optional<Line> fitLine(std::vector<std::pair<double, double>> points) {
  std::optional<Line> line;
  for (int round = 0; round < 10; ++round) {
    double n = points.size(), sx = 0, sy = 0, sxx = 0, sxy = 0;
    for (auto [x, y] : points) {
      sx += x;
      sy += y;
      sxx += x * x;
      sxy += x * y;
    }
    double det = n * sxx - sx * sx;
    if (points.size() < 2 || !(det > 1e-12 * n * sxx))
      return line;
    double b = (n * sxy - sx * sy) / det, a = (sy - b * sx) / n;
    line = Line{a, b, points.size()};
    size_t before = points.size();
    llvm::erase_if(points, [&](const std::pair<double, double> &p) {
      return p.second > 1.02 * (a + b * p.first) + 1e-9;
    });
    if (points.size() == before)
      break;
  }
  return line;
}

bool overlaps(const MeasuredSpan &a, const MeasuredSpan &b) {
  return a.start < b.start + b.seconds && b.start < a.start + a.seconds;
}

/// The shortest figure printf's %g gives (formatv has no such style).
std::string number(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", v);
  return text;
}

} // namespace

llvm::Expected<Calibration> sim::calibrate(const MeasuredTrace &trace,
                                           const exec::ExecPlan *plan,
                                           const HardwareModel &base) {
  std::vector<Sample> samples;
  for (const MeasuredSpan &s : trace.spans) {
    Sample sample{&s, costKindOf(s.op), kernelFamilyOf(s.op), {}, {}};
    if (plan) {
      if (s.instruction < 0 ||
          static_cast<size_t>(s.instruction) >= plan->instructions.size())
        return error(llvm::formatv(
            "trace event of instruction {0} ('{1}'): the plan has {2} "
            "instructions; is it the plan the trace ran?",
            s.instruction, exec::opName(s.op), plan->instructions.size()));
      const exec::Instruction &inst = plan->instructions[s.instruction];
      if (inst.op != s.op)
        return error(llvm::formatv(
            "trace event of instruction {0} is '{1}', the plan's is '{2}': "
            "not the plan the trace ran",
            s.instruction, exec::opName(s.op), exec::opName(inst.op)));
      sample.in = inst.cost;
      if (!inst.results.empty() &&
          static_cast<size_t>(inst.results.front()) < plan->values.size())
        sample.type = plan->values[inst.results.front()].type.dtype;
    } else {
      sample.in = inputsFromTrace(s);
    }
    samples.push_back(sample);
  }

  Calibration c;
  c.hw = base;
  if (!plan)
    c.notes.push_back("without --plan: each compute-bound family's FLOPs "
                      "count as its own kind, results as bf16, fetches as "
                      "reading fp32 masters");

  // Kernel families: the efficiency that makes the summed prediction the
  // summed measurement. The prediction falls as the efficiency rises.
  struct Pending {
    CalibrationRow row;
    std::vector<Sample> samples;
  };
  std::vector<Pending> rows;
  for (int f = 1; f < kNumKernelFamilies; ++f) {
    auto family = static_cast<KernelFamily>(f);
    Pending p;
    p.row.what = kernelFamilyName(family);
    for (const Sample &s : samples)
      if (s.family == family && s.kind == CostKind::Device)
        p.samples.push_back(s);
    double HardwareModel::*member = efficiencyMember(family);
    std::string field =
        std::string(kernelFamilyName(family)) +
        (isComputeBound(family) ? "_efficiency" : "_hbm_efficiency");
    if (p.samples.empty()) {
      c.notes.push_back(llvm::formatv("{0}: no events; '{1}' keeps {2}",
                                      p.row.what, field, number(base.*member)));
      continue;
    }
    double target = measured(p.samples);
    HardwareModel hw = c.hw;
    auto at = [&](double e) {
      hw.*member = e;
      return predicted(p.samples, hw);
    };
    // [first, last]: the efficiencies that predict the measurement to
    // 1e-6 and the trace's rounding (1 ns per span); a wide range means
    // the spans are bound by memory or latency and their time says little
    // of the efficiency.
    double tolerance = 1e-6 * target + 1e-9 * p.samples.size();
    double upper = target + tolerance, lower = target - tolerance;
    double e;
    bool identified = true;
    if (at(1) > upper) {
      e = 1;
      if (at(1) > target * 1.001)
        c.notes.push_back(llvm::formatv(
            "{0}: measured {1} s, faster than '{2}' 1 predicts ({3} s): "
            "check the peak rates, bytes and launch_latency",
            p.row.what, number(target), field, number(at(1))));
    } else if (at(1e-3) < lower) {
      e = 1e-3;
      c.notes.push_back(llvm::formatv(
          "{0}: measured {1} s, slower than '{2}' 0.001 predicts: clamped",
          p.row.what, number(target), field));
    } else {
      // Smallest e with at(e) <= upper, largest with at(e) >= lower.
      auto bisect = [&](auto inside, bool smallest) {
        double lo = 1e-3, hi = 1;
        for (int i = 0; i < 200 && hi / lo > 1 + 1e-12; ++i) {
          double mid = std::sqrt(lo * hi);
          bool in = inside(mid);
          (smallest ? (in ? hi : lo) : (in ? lo : hi)) = mid;
        }
        return std::sqrt(lo * hi);
      };
      double first = bisect([&](double x) { return at(x) <= upper; }, true);
      double last = bisect([&](double x) { return at(x) >= lower; }, false);
      e = bisect([&](double x) { return at(x) <= target; }, true);
      if (last > 1.25 * first) {
        identified = false;
        e = std::clamp(base.*member, first, last);
        c.notes.push_back(llvm::formatv(
            "{0}: every '{1}' in [{2:F3}, {3:F3}] predicts the measured "
            "time (spans bound by memory or launch latency); {4} {5}",
            p.row.what, field, first, last,
            e == base.*member ? "kept" : "set to", number(e)));
      }
    }
    c.hw.*member = e;
    if (identified)
      p.row.fitted = field + " " + llvm::formatv("{0:F4}", e).str();
    rows.push_back(std::move(p));
  }

  // Copies: bandwidth and latency of a line through (bytes, seconds).
  std::vector<double> latencies;
  auto fitCopies = [&](llvm::StringRef what, double HardwareModel::*bandwidth,
                       auto select) {
    Pending p;
    p.row.what = what.str();
    std::vector<std::pair<double, double>> points;
    for (const Sample &s : samples)
      if (select(s)) {
        p.samples.push_back(s);
        points.push_back({double(s.in.bytes), s.span->seconds});
      }
    std::string field = what.str() + "_bandwidth";
    if (p.samples.empty()) {
      c.notes.push_back(llvm::formatv("{0}: no copies; '{1}' keeps {2}", what,
                                      field, number(base.*bandwidth)));
      return;
    }
    std::optional<Line> line = fitLine(std::move(points));
    if (!line || line->b <= 0 || 1 / line->b < 1e6 || 1 / line->b > 1e15) {
      c.notes.push_back(llvm::formatv(
          "{0}: the copies do not fit a line (one size only, or a "
          "bandwidth outside [1e6, 1e15] B/s); '{1}' keeps {2}",
          what, field, number(base.*bandwidth)));
    } else {
      c.hw.*bandwidth = 1 / line->b;
      p.row.fitted = field + " " + number(c.hw.*bandwidth);
      if (line->a > 0 && line->a <= 1)
        latencies.push_back(line->a);
      if (line->used < p.samples.size())
        c.notes.push_back(llvm::formatv(
            "{0}: {1} of {2} copies lie more than 2% above the line "
            "(staging-bound or sharing the host) and were left out",
            what, p.samples.size() - line->used, p.samples.size()));
    }
    rows.push_back(std::move(p));
  };
  fitCopies("h2d", &HardwareModel::h2dBandwidth, [](const Sample &s) {
    return s.kind == CostKind::HostToDevice || s.kind == CostKind::Fetch;
  });
  fitCopies("d2h", &HardwareModel::d2hBandwidth,
            [](const Sample &s) { return s.kind == CostKind::DeviceToHost; });
  if (latencies.empty()) {
    c.notes.push_back("transfer_latency keeps " + number(base.transferLatency) +
                      ": no line with a latency in (0, 1] s");
  } else {
    double sum = 0;
    for (double l : latencies)
      sum += l;
    c.hw.transferLatency = sum / latencies.size();
  }

  // The host optimizer: parameters per second, from updates that had the
  // host to themselves when there are any.
  {
    Pending p;
    p.row.what = "host_adamw";
    std::vector<const MeasuredSpan *> fetches;
    for (const Sample &s : samples)
      if (s.kind == CostKind::Fetch)
        fetches.push_back(s.span);
    std::vector<Sample> alone;
    for (const Sample &s : samples)
      if (s.kind == CostKind::HostAdamW) {
        p.samples.push_back(s);
        if (llvm::none_of(fetches, [&](const MeasuredSpan *f) {
              return overlaps(*f, *s.span);
            }))
          alone.push_back(s);
      }
    if (plan && plan->defersUpdates()) {
      // Its host_adamw spans retain gradients; the updates are elsewhere.
      c.notes.push_back("host_adamw: the plan defers its updates, so its "
                        "host_adamw spans time retained gradients, not "
                        "updates; calibrate from a trace of a streaming plan "
                        "(--update streaming); 'host_adamw_params_per_second' "
                        "keeps " +
                        number(base.hostAdamWParamsPerSecond));
    } else if (p.samples.empty()) {
      c.notes.push_back("host_adamw: no updates; "
                        "'host_adamw_params_per_second' keeps " +
                        number(base.hostAdamWParamsPerSecond));
    } else {
      llvm::ArrayRef<Sample> from = alone.empty() ? p.samples : alone;
      if (alone.empty())
        c.notes.push_back("host_adamw: every update overlaps a fetch; the "
                          "rate includes their sharing of the host");
      double params = 0, seconds = 0;
      for (const Sample &s : from) {
        params += double(s.in.otherFlops / kHostAdamWFlopsPerParam);
        seconds += s.span->seconds;
      }
      double rate = seconds > 0 ? params / seconds : 0;
      if (rate >= 1e3 && rate <= 1e15) {
        c.hw.hostAdamWParamsPerSecond = rate;
        p.row.fitted = "host_adamw_params_per_second " + number(rate);
      } else {
        c.notes.push_back("host_adamw: a rate outside [1e3, 1e15] params/s; "
                          "kept");
      }
      rows.push_back(std::move(p));
    }
  }
  c.notes.push_back("launch_latency, host_memory_bandwidth and the peak "
                    "rates are not fitted: kept from the base description");

  for (Pending &p : rows) {
    p.row.events = p.samples.size();
    p.row.measured = measured(p.samples);
    p.row.before = predicted(p.samples, base);
    p.row.after = predicted(p.samples, c.hw);
    c.rows.push_back(std::move(p.row));
  }
  return c;
}
