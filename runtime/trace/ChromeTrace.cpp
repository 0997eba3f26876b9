//===- ChromeTrace.cpp - Chrome trace-event JSON of a step ----------------===//

#include "megaslide/runtime/trace/ChromeTrace.h"

#include "megaslide/runtime/support/AtomicFile.h"

#include "llvm/ADT/DenseSet.h"
#include "llvm/ADT/SmallVector.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"

#include <cmath>

using namespace megaslide;
using namespace megaslide::trace;

namespace {

constexpr int64_t kPid = 1;

/// Tracks are numbered from 1: some viewers treat thread 0 specially.
int64_t tidOf(exec::Stream stream) { return static_cast<int64_t>(stream) + 1; }

/// Seconds as the format's microseconds, to the nanosecond; JSON has no
/// NaN or infinity.
void writeMicros(llvm::json::OStream &j, llvm::StringRef key, double seconds) {
  double us = std::isfinite(seconds) ? seconds * 1e6 : 0.0;
  j.attributeBegin(key);
  j.rawValue([&](llvm::raw_ostream &os) { os << llvm::format("%.3f", us); });
  j.attributeEnd();
}

void writeArgs(llvm::json::OStream &j, llvm::ArrayRef<Arg> args) {
  j.attributeObject("args", [&] {
    for (const Arg &a : args)
      j.attribute(a.key, a.value);
  });
}

} // namespace

ChromeTrace::ChromeTrace(llvm::raw_ostream &os, llvm::StringRef processName)
    : os(os) {
  os << "{\"traceEvents\":[\n";
  metadata("process_name", 0, llvm::json::Object{{"name", processName}});
  // The comm stream is named by its first event: only a job's plan has one.
  for (int s = 0; s < exec::kNumStreams; ++s)
    if (static_cast<exec::Stream>(s) != exec::Stream::Comm)
      nameThread(static_cast<exec::Stream>(s));
}

void ChromeTrace::nameThread(exec::Stream stream) {
  metadata("thread_name", tidOf(stream),
           llvm::json::Object{{"name", exec::streamName(stream)}});
  metadata("thread_sort_index", tidOf(stream),
           llvm::json::Object{{"sort_index", static_cast<int64_t>(stream)}});
}

ChromeTrace::ChromeTrace(std::unique_ptr<AtomicFile> file,
                         llvm::StringRef processName)
    : ChromeTrace(file->os(), processName) {
  this->file = std::move(file);
}

namespace {

/// "cannot write trace 'P': <why>" from an AtomicFile error about P.
llvm::Error traceError(llvm::StringRef path, llvm::Error err) {
  std::error_code ec = llvm::errorToErrorCode(std::move(err));
  return llvm::createStringError(ec, "cannot write trace '%s': %s",
                                 path.str().c_str(), ec.message().c_str());
}

} // namespace

llvm::Expected<std::unique_ptr<ChromeTrace>>
ChromeTrace::create(llvm::StringRef path, llvm::StringRef processName) {
  llvm::Expected<std::unique_ptr<AtomicFile>> file = AtomicFile::create(path);
  if (!file)
    return traceError(path, file.takeError());
  return std::unique_ptr<ChromeTrace>(
      new ChromeTrace(std::move(*file), processName));
}

ChromeTrace::~ChromeTrace() {
  // An unfinished trace file is dropped with its temporary (AtomicFile).
  if (!finished && !file)
    llvm::consumeError(finish());
}

llvm::raw_ostream &ChromeTrace::next() {
  if (events++)
    os << ",\n";
  return os;
}

void ChromeTrace::metadata(llvm::StringRef name, int64_t tid,
                           llvm::json::Value args) {
  llvm::json::OStream j(next());
  j.object([&] {
    j.attribute("name", name);
    j.attribute("ph", "M");
    j.attribute("pid", kPid);
    if (tid)
      j.attribute("tid", tid);
    j.attribute("args", std::move(args));
  });
}

void ChromeTrace::complete(exec::Stream stream, llvm::StringRef name,
                           double start, double seconds,
                           llvm::ArrayRef<Arg> args) {
  assert(!finished && "event after finish()");
  if (stream == exec::Stream::Comm && !commNamed) {
    commNamed = true;
    nameThread(stream);
  }
  llvm::json::OStream j(next());
  j.object([&] {
    j.attribute("name", name);
    j.attribute("cat", exec::streamName(stream));
    j.attribute("ph", "X");
    j.attribute("pid", kPid);
    j.attribute("tid", tidOf(stream));
    writeMicros(j, "ts", start);
    writeMicros(j, "dur", seconds);
    if (!args.empty())
      writeArgs(j, args);
  });
}

void ChromeTrace::complete(const exec::TraceSpan &span) {
  llvm::SmallVector<Arg, 4> args;
  args.push_back({"instruction", span.instruction});
  if (span.layer)
    args.push_back({"layer", *span.layer});
  args.push_back({"bytes", span.bytes});
  args.push_back({"flops", span.flops});
  complete(span.stream, span.name, span.start, span.seconds, args);
}

void ChromeTrace::counter(llvm::StringRef name, double at,
                          llvm::ArrayRef<Arg> series) {
  assert(!finished && "event after finish()");
  llvm::json::OStream j(next());
  j.object([&] {
    j.attribute("name", name);
    j.attribute("ph", "C");
    j.attribute("pid", kPid);
    writeMicros(j, "ts", at);
    writeArgs(j, series);
  });
}

void ChromeTrace::setOtherData(llvm::StringRef key, llvm::json::Value value) {
  otherData[key] = std::move(value);
}

llvm::Error ChromeTrace::finish() {
  assert(!finished && "finish() called twice");
  finished = true;
  os << "\n],\"displayTimeUnit\":\"ms\"";
  if (!otherData.empty())
    os << ",\"otherData\":" << llvm::json::Value(std::move(otherData));
  os << "}\n";
  os.flush();
  if (file)
    if (llvm::Error err = file->commit())
      return traceError(file->path(), std::move(err));
  return llvm::Error::success();
}

//===----------------------------------------------------------------------===//
// Reading back
//===----------------------------------------------------------------------===//

namespace {

llvm::Error invalid(const llvm::Twine &message) {
  return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                 "invalid trace: " + message);
}

} // namespace

llvm::Error trace::validateChromeTrace(llvm::StringRef text) {
  llvm::Expected<llvm::json::Value> parsed = llvm::json::parse(text);
  if (!parsed)
    return invalid(llvm::toString(parsed.takeError()));
  const llvm::json::Object *root = parsed->getAsObject();
  if (!root)
    return invalid("the top level is not an object");
  const llvm::json::Array *events = root->getArray("traceEvents");
  if (!events)
    return invalid("no \"traceEvents\" array");
  if (std::optional<llvm::StringRef> unit = root->getString("displayTimeUnit");
      unit && *unit != "ms" && *unit != "ns")
    return invalid("displayTimeUnit '" + *unit + "' is neither ms nor ns");

  // Threads are named by metadata that may come anywhere in the array.
  llvm::DenseSet<std::pair<int64_t, int64_t>> namedThreads;
  for (const llvm::json::Value &e : *events)
    if (const llvm::json::Object *o = e.getAsObject())
      if (o->getString("ph") == "M" && o->getString("name") == "thread_name")
        namedThreads.insert({o->getInteger("pid").value_or(-1),
                             o->getInteger("tid").value_or(-1)});

  for (auto [i, e] : llvm::enumerate(*events)) {
    auto bad = [&, i = i](const llvm::Twine &why) {
      return invalid(llvm::formatv("event {0}: ", i) + why);
    };
    const llvm::json::Object *o = e.getAsObject();
    if (!o)
      return bad("not an object");
    std::optional<llvm::StringRef> ph = o->getString("ph");
    if (!ph)
      return bad("no \"ph\"");
    std::optional<llvm::StringRef> name = o->getString("name");
    if (!name)
      return bad("no \"name\"");
    std::optional<int64_t> pid = o->getInteger("pid");
    if (!pid)
      return bad("no integer \"pid\"");
    const llvm::json::Object *args = o->getObject("args");
    if (*ph == "M") {
      if (*name != "process_name" && *name != "thread_name" &&
          *name != "process_sort_index" && *name != "thread_sort_index")
        return bad("unknown metadata '" + *name + "'");
      if (!args)
        return bad("metadata without \"args\"");
      if (name->ends_with("_name") && !args->getString("name"))
        return bad("'" + *name + "' without a string args.name");
      continue;
    }
    std::optional<double> ts = o->getNumber("ts");
    if (!ts)
      return bad("no numeric \"ts\"");
    if (*ph == "X") {
      std::optional<int64_t> tid = o->getInteger("tid");
      if (!tid)
        return bad("no integer \"tid\"");
      if (!namedThreads.contains({*pid, *tid}))
        return bad(llvm::formatv("thread {0} of process {1} has no "
                                 "thread_name",
                                 *tid, *pid));
      std::optional<double> dur = o->getNumber("dur");
      if (!dur || *dur < 0)
        return bad("\"dur\" is missing or negative");
      if (*ts < 0)
        return bad("\"ts\" is negative");
      if (o->get("args") && !args)
        return bad("\"args\" is not an object");
    } else if (*ph == "C") {
      if (!args || args->empty())
        return bad("counter without \"args\"");
      for (const auto &[key, value] : *args)
        if (!value.getAsNumber())
          return bad("counter series '" + key.str() + "' is not a number");
    } else {
      return bad("phase '" + *ph + "' is not one ChromeTrace writes");
    }
  }
  return llvm::Error::success();
}
