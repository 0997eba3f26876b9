//===- MetricsLog.cpp - One JSON line per optimizer step ------------------===//

#include "megaslide/runtime/train/MetricsLog.h"

#include "megaslide/runtime/support/AtomicFile.h"
#include "megaslide/runtime/support/Json.h"
#include "megaslide/runtime/support/ReadFile.h"
#include "megaslide/runtime/train/TrainingReport.h"

#include "llvm/ADT/ScopeExit.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/raw_ostream.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>

using namespace llvm;
using namespace megaslide;
using namespace megaslide::train;

std::string train::cliSpelling(StringRef name) { return ("--" + name).str(); }

std::string train::pythonSpelling(StringRef name) {
  if (name == "resume")
    return "Trainer.resume()";
  if (name == "overwrite-checkpoints")
    return "overwrite_checkpoints=True";
  std::string text = name.str();
  llvm::replace(text, '-', '_');
  return text + "=";
}

std::string train::metricsLine(const MetricsRecord &r) {
  std::string line;
  raw_string_ostream os(line);
  json::OStream j(os);
  // Numbers with the digits that tell them apart (a float loss needs 9),
  // not a double's 17.
  auto number = [&](StringRef key, std::optional<double> v, const char *fmt) {
    j.attributeBegin(key);
    if (v && std::isfinite(*v))
      j.rawValue(formatv("{0}", format(fmt, *v)).str());
    else
      j.value(nullptr);
    j.attributeEnd();
  };
  j.object([&] {
    j.attribute("step", r.step);
    number("loss", r.loss, "%.9g");
    if (r.unweightedLoss)
      number("unweighted_loss", r.unweightedLoss, "%.9g");
    number("lr", r.lr, "%.9g");
    number("grad_norm", r.gradNorm, "%.9g");
    j.attribute("clipped", r.clipped);
    j.attribute("skipped", r.skipped);
    j.attribute("micro_batches", r.microBatches);
    j.attributeBegin("seconds");
    j.rawValue(formatv("{0}", format("%.6f", r.seconds)).str());
    j.attributeEnd();
    number("samples_per_second", r.samplesPerSecond, "%.6g");
    number("tokens_per_second", r.tokensPerSecond, "%.6g");
    j.attribute("host_rss_bytes", static_cast<int64_t>(r.hostRssBytes));
    j.attribute("device_peak_bytes", r.devicePeakBytes);
    if (r.valLoss)
      number("val_loss", r.valLoss, "%.9g");
    if (r.lrDecaySteps)
      j.attribute("lr_decay_steps", *r.lrDecaySteps);
    if (r.buckets.size() == 1)
      j.attribute("bucket", r.buckets.front());
    else if (!r.buckets.empty())
      j.attributeArray("bucket", [&] {
        for (const std::string &name : r.buckets)
          j.value(name);
      });
    if (!r.expert.empty())
      j.attribute("expert", r.expert);
  });
  return line;
}

namespace {

/// Whether `line` is a line of a metrics log: a JSON object with an integer
/// "step"; the step, or the reason it is not one.
Expected<int64_t> metricsStep(StringRef line) {
  Expected<json::Value> v = parseJson(line);
  if (!v)
    return v.takeError();
  const json::Object *o = v->getAsObject();
  std::optional<int64_t> step = o ? o->getInteger("step") : std::nullopt;
  if (!step)
    return createStringError("not a JSON object with an integer \"step\"");
  return *step;
}

/// No step's line comes near this; a longer one is not read into memory.
constexpr size_t kMaxMetricsLineBytes = 1 << 20;

/// Calls `onLine(number, line, end)` for each line of the metrics log at
/// `path`, read in pieces so that a log of any size resumes (the file is
/// never held whole); `end` is the offset after the line's newline, or
/// std::nullopt for a last line without one (cut by a kill). A line over
/// kMaxMetricsLineBytes is passed as std::nullopt. `onLine` returns
/// whether to read on.
Error forEachMetricsLine(
    StringRef path,
    function_ref<Expected<bool>(int64_t, std::optional<StringRef>,
                                std::optional<uint64_t>)>
        onLine) {
  uint64_t size = 0;
  Expected<int> fd = openRegularFile(path, "metrics file", size);
  if (!fd)
    return fd.takeError();
  scope_exit closeFd([&] { ::close(*fd); });
  std::string line;
  bool overlong = false;
  int64_t number = 1;
  uint64_t offset = 0;
  char buffer[1 << 16];
  for (;;) {
    ssize_t n = ::read(*fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return createStringError("cannot read metrics file '" + path +
                               "': " + std::strerror(errno));
    if (n == 0)
      break;
    StringRef chunk(buffer, n);
    while (!chunk.empty()) {
      size_t newline = chunk.find('\n');
      StringRef piece = chunk.substr(0, newline);
      if (!overlong && line.size() + piece.size() > kMaxMetricsLineBytes) {
        overlong = true;
        line.clear();
      }
      if (!overlong)
        line += piece;
      offset += piece.size();
      if (newline == StringRef::npos)
        break;
      offset += 1;
      chunk = chunk.drop_front(newline + 1);
      Expected<bool> more = onLine(
          number++, overlong ? std::nullopt : std::optional<StringRef>(line),
          offset);
      if (!more || !*more)
        return more.takeError();
      line.clear();
      overlong = false;
    }
  }
  if (!line.empty() || overlong)
    return onLine(number,
                  overlong ? std::nullopt : std::optional<StringRef>(line),
                  std::nullopt)
        .takeError();
  return Error::success();
}

} // namespace

Error train::checkMetricsLog(StringRef path, bool resuming, bool keepText,
                             OptionSpelling spell) {
  if (path.empty() || path == "-" || !sys::fs::exists(path))
    return Error::success();
  uint64_t logBytes = 0;
  auto notALog = [&](int64_t number, const Twine &why) {
    return createStringError(
        spell("metrics") + " '" + path +
        "' is not a megaslide metrics log (line " + Twine(number) + ": " + why +
        "); it is left as it is: give another path, or remove the file");
  };
  if (Error e = forEachMetricsLine(
          path,
          [&](int64_t number, std::optional<StringRef> line,
              std::optional<uint64_t> end) -> Expected<bool> {
            if (!end && resuming)
              return true; // the last line, cut by a kill
            Expected<int64_t> step =
                line ? metricsStep(*line)
                     : Expected<int64_t>(createStringError(formatv(
                           "a line over {0} bytes", kMaxMetricsLineBytes)));
            if (step && !resuming)
              return false; // a metrics log, which a fresh run replaces
            if (step) {
              logBytes += line->size() + 1;
              return true;
            }
            if (number == 1)
              return notALog(number, toString(step.takeError()));
            return createStringError(
                spell("resume") + ": line " + Twine(number) +
                " of the metrics log '" + path + "' is corrupt (" +
                toString(step.takeError()) +
                "); only a last line cut by a kill is dropped. The log is left "
                "as it was: repair or remove that line and resume again");
          }))
    return e;
  if (keepText && logBytes > kMaxMetricsBytes)
    return createStringError(formatv(
        "{3} draws the whole metrics log, and the lines of '{0}' hold "
        "{1} bytes, over the {2} bytes a report reads; drop {3} "
        "(megaslide-report draws a shorter log) or start a new {4} file",
        path, logBytes, kMaxMetricsBytes, spell("report"), spell("metrics")));
  return Error::success();
}

Expected<std::unique_ptr<MetricsLog>>
MetricsLog::open(StringRef path, std::optional<int64_t> resumedStep,
                 bool keepText) {
  std::unique_ptr<MetricsLog> m(new MetricsLog(path.str(), keepText));
  if (!resumedStep || path.empty())
    return m;
  m->append = true;
  if (!sys::fs::exists(path))
    return m;
  // Keeps the lines of the steps the checkpoint holds. In a log that runs
  // wrote they are a prefix, kept in place by truncating, whatever the
  // log's size; otherwise the kept lines are rewritten.
  auto keep = [&](bool collect, uint64_t &keptEnd, bool &inOrder) {
    bool dropped = false;
    return forEachMetricsLine(
        path,
        [&](int64_t, std::optional<StringRef> line,
            std::optional<uint64_t> end) -> Expected<bool> {
          Expected<int64_t> step =
              line ? metricsStep(*line) : Expected<int64_t>(-1);
          if (!step || !end || *step < 0 || *step > *resumedStep) {
            consumeError(step.takeError()); // a cut last line (checked)
            dropped = true;
            return true;
          }
          inOrder &= !dropped;
          keptEnd = *end;
          if (collect)
            m->lines += line->str() + "\n";
          return true;
        });
  };
  uint64_t keptEnd = 0;
  bool inOrder = true;
  if (Error e = keep(keepText, keptEnd, inOrder))
    return std::move(e);
  if (inOrder) {
    if (::truncate(m->path.c_str(), keptEnd) != 0)
      return createStringError("cannot write '" + path +
                               "': " + std::strerror(errno));
    return m;
  }
  if (!keepText)
    if (Error e = keep(true, keptEnd, inOrder))
      return std::move(e);
  if (Error e = writeFileAtomically(path, m->lines))
    return std::move(e);
  if (!keepText)
    m->lines.clear();
  return m;
}

MetricsLog::~MetricsLog() {
  if (fd >= 0)
    ::close(fd);
}

Error MetricsLog::write(const MetricsRecord &record) {
  std::string text = metricsLine(record) + "\n";
  if (keepText)
    lines += text;
  if (path.empty())
    return Error::success();
  if (fd < 0) {
    int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (append ? O_APPEND : O_TRUNC);
    fd = ::open(path.c_str(), flags, 0666);
    if (fd < 0)
      return createStringError("cannot write '" + path +
                               "': " + std::strerror(errno));
  }
  for (size_t done = 0; done < text.size();) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return createStringError("cannot write '" + path +
                               "': " + std::strerror(errno));
    done += n;
  }
  return Error::success();
}
