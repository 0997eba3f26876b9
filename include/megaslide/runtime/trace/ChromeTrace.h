//===- ChromeTrace.h - Chrome trace-event JSON of a step --------*- C++ -*-===//
//
// The trace every backend writes (docs/Runtime.md): Chrome
// trace-event JSON, viewable in Perfetto or chrome://tracing. One process,
// one named track per stream of the plan (compute, h2d, d2h, host), a
// complete event per instruction with its time on that stream (measured by
// the cpu and cuda backends, predicted by sim) and optional counters such as
// device memory in use. Events are written as they come, so a 105B step
// (~60k events) costs one pass over a buffered stream.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_TRACE_CHROMETRACE_H
#define MEGASLIDE_RUNTIME_TRACE_CHROMETRACE_H

#include "megaslide/runtime/plan/Backend.h"
#include "megaslide/runtime/plan/ExecPlan.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/raw_ostream.h"

#include <memory>
#include <string>

namespace megaslide {
class AtomicFile;
} // namespace megaslide

namespace megaslide::trace {

/// One entry of an event's "args": instruction index, layer, bytes, ...
struct Arg {
  llvm::StringRef key;
  llvm::json::Value value;
};

/// Writes {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}.
/// Times are given in seconds from the start of the step and written in
/// microseconds, the unit of the format, to the nanosecond.
class ChromeTrace {
public:
  /// Writes to `os`, which must outlive the trace. The metadata events that
  /// name the process and the four stream tracks come first.
  ChromeTrace(llvm::raw_ostream &os, llvm::StringRef processName);
  /// Writes the trace to `path` atomically (support/AtomicFile.h): events
  /// go to a temporary file next to it that finish() renames over `path`,
  /// so a run that fails before finish() leaves an existing `path` as it
  /// was and an unfinished trace never replaces one. Fails at once, naming
  /// `path`, where it cannot be written.
  static llvm::Expected<std::unique_ptr<ChromeTrace>>
  create(llvm::StringRef path, llvm::StringRef processName);
  /// A trace written to a stream is finished if finish() was not called
  /// (errors are dropped); one created from a path is discarded.
  ~ChromeTrace();

  ChromeTrace(const ChromeTrace &) = delete;
  ChromeTrace &operator=(const ChromeTrace &) = delete;

  /// A complete ("X") event on the track of `stream`: `name` ran from
  /// `start` for `seconds`.
  void complete(exec::Stream stream, llvm::StringRef name, double start,
                double seconds, llvm::ArrayRef<Arg> args = {});
  /// A backend's span: named as the span says, with args "instruction",
  /// "layer" (when it has one), "bytes" and "flops".
  void complete(const exec::TraceSpan &span);
  /// A counter ("C") sample: from `at` on, each series of counter `name`
  /// has the value given (e.g. "device memory", {{"bytes", 1 << 30}}).
  void counter(llvm::StringRef name, double at, llvm::ArrayRef<Arg> series);
  /// Adds `key` to the trace's "otherData" (backend, plan, hardware, ...),
  /// written by finish().
  void setOtherData(llvm::StringRef key, llvm::json::Value value);

  /// Closes the JSON document and flushes (and, for a file, commits it);
  /// an error naming the file if writing failed. Nothing may be added
  /// afterwards.
  llvm::Error finish();

  /// Events written so far, metadata included.
  size_t numEvents() const { return events; }

private:
  ChromeTrace(std::unique_ptr<AtomicFile> file, llvm::StringRef processName);
  /// Starts the next element of "traceEvents".
  llvm::raw_ostream &next();
  void metadata(llvm::StringRef name, int64_t tid, llvm::json::Value args);
  /// The thread's name and sort index (its stream's).
  void nameThread(exec::Stream stream);

  std::unique_ptr<AtomicFile> file; ///< when created from a path
  llvm::raw_ostream &os;
  llvm::json::Object otherData;
  size_t events = 0;
  bool finished = false;
  bool commNamed = false; ///< the comm stream's thread is named
};

/// Checks that `text` is a trace as ChromeTrace writes it: a JSON object
/// with a "traceEvents" array whose events each have a "ph"; "M" events
/// name the process or a thread; "X" events have a name, pid, tid, "ts" and
/// "dur" >= 0 on a named thread; "C" events have a name, "ts" and numeric
/// args. Errors say which event is wrong and why. For tests and tools that
/// read traces back.
llvm::Error validateChromeTrace(llvm::StringRef text);

} // namespace megaslide::trace

#endif // MEGASLIDE_RUNTIME_TRACE_CHROMETRACE_H
