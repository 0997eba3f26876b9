//===- ChromeTraceTest.cpp - Chrome trace-event JSON writer ---------------===//
//
// ChromeTrace (runtime/trace) read back with llvm::json: the document and
// its metadata (one process, a named track per stream), complete events in
// microseconds with their args, counters, otherData, escaping, files, a
// 105B-sized step, and validateChromeTrace on broken traces.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/trace/ChromeTrace.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"

#include "gtest/gtest.h"

#include <map>
#include <string>

using namespace megaslide;
using namespace megaslide::trace;

namespace {

/// Parses a trace that must be valid; fails the test otherwise.
llvm::json::Value parseTrace(const std::string &text) {
  if (llvm::Error err = validateChromeTrace(text)) {
    ADD_FAILURE() << llvm::toString(std::move(err)) << "\n" << text;
    return nullptr;
  }
  return llvm::cantFail(llvm::json::parse(text));
}

const llvm::json::Array &eventsOf(const llvm::json::Value &trace) {
  return *trace.getAsObject()->getArray("traceEvents");
}

std::vector<const llvm::json::Object *>
withPhase(const llvm::json::Value &trace, llvm::StringRef ph) {
  std::vector<const llvm::json::Object *> out;
  for (const llvm::json::Value &e : eventsOf(trace))
    if (e.getAsObject()->getString("ph") == ph)
      out.push_back(e.getAsObject());
  return out;
}

/// Track name of each thread id.
std::map<int64_t, std::string> threadNames(const llvm::json::Value &trace) {
  std::map<int64_t, std::string> names;
  for (const llvm::json::Object *m : withPhase(trace, "M"))
    if (m->getString("name") == "thread_name")
      names[*m->getInteger("tid")] =
          m->getObject("args")->getString("name")->str();
  return names;
}

std::string errorOf(llvm::StringRef text) {
  llvm::Error err = validateChromeTrace(text);
  return err ? llvm::toString(std::move(err)) : "";
}

TEST(ChromeTrace, EmptyTraceHasOneProcessAndATrackPerStream) {
  std::string text;
  llvm::raw_string_ostream os(text);
  {
    ChromeTrace trace(os, "megaslide-run (cpu)");
    EXPECT_EQ(trace.numEvents(), 9u); // process + 4 x (name, sort index)
    llvm::cantFail(trace.finish());
  }
  llvm::json::Value parsed = parseTrace(text);
  const llvm::json::Object &root = *parsed.getAsObject();
  EXPECT_EQ(root.getString("displayTimeUnit"), "ms");
  EXPECT_EQ(root.get("otherData"), nullptr);

  std::vector<const llvm::json::Object *> meta = withPhase(parsed, "M");
  ASSERT_EQ(meta.size(), eventsOf(parsed).size());
  EXPECT_EQ(meta[0]->getString("name"), "process_name");
  EXPECT_EQ(meta[0]->getObject("args")->getString("name"),
            "megaslide-run (cpu)");
  std::map<int64_t, std::string> names = threadNames(parsed);
  EXPECT_EQ(names, (std::map<int64_t, std::string>{
                       {1, "compute"}, {2, "h2d"}, {3, "d2h"}, {4, "host"}}));
  for (const llvm::json::Object *m : meta)
    EXPECT_EQ(m->getInteger("pid"), 1);
}

TEST(ChromeTrace, CompleteEventsAreInMicrosecondsOnTheirStreamsTrack) {
  std::string text;
  llvm::raw_string_ostream os(text);
  ChromeTrace trace(os, "p");
  trace.complete(exec::Stream::HostToDevice, "fetch blocks.3.ffn.weight",
                 0.0015, 0.25, {{"layer", 3}, {"bytes", 805306368}});
  trace.complete(exec::Stream::Compute, "linear", 1.000000001, 0);
  llvm::cantFail(trace.finish());

  llvm::json::Value parsed = parseTrace(text);
  std::map<int64_t, std::string> names = threadNames(parsed);
  std::vector<const llvm::json::Object *> x = withPhase(parsed, "X");
  ASSERT_EQ(x.size(), 2u);
  EXPECT_EQ(x[0]->getString("name"), "fetch blocks.3.ffn.weight");
  EXPECT_EQ(names[*x[0]->getInteger("tid")], "h2d");
  EXPECT_EQ(x[0]->getString("cat"), "h2d");
  EXPECT_DOUBLE_EQ(*x[0]->getNumber("ts"), 1500);
  EXPECT_DOUBLE_EQ(*x[0]->getNumber("dur"), 250000);
  EXPECT_EQ(x[0]->getObject("args")->getInteger("layer"), 3);
  EXPECT_EQ(x[0]->getObject("args")->getInteger("bytes"), 805306368);
  // Nanosecond resolution; no args object when none are given.
  EXPECT_EQ(names[*x[1]->getInteger("tid")], "compute");
  EXPECT_DOUBLE_EQ(*x[1]->getNumber("ts"), 1000000.001);
  EXPECT_DOUBLE_EQ(*x[1]->getNumber("dur"), 0);
  EXPECT_EQ(x[1]->get("args"), nullptr);
}

TEST(ChromeTrace, SpansCarryInstructionLayerBytesAndFlops) {
  exec::TraceSpan span;
  span.stream = exec::Stream::Host;
  span.name = "host_adamw blocks.0.attn1.to_q.weight";
  span.start = 2;
  span.seconds = 0.5;
  span.instruction = 42;
  span.layer = 0;
  span.bytes = 7;
  span.flops = 14 * 4096;
  exec::TraceSpan noLayer = span;
  noLayer.layer.reset();

  std::string text;
  llvm::raw_string_ostream os(text);
  ChromeTrace trace(os, "p");
  trace.complete(span);
  trace.complete(noLayer);
  llvm::cantFail(trace.finish());

  llvm::json::Value parsed = parseTrace(text);
  std::vector<const llvm::json::Object *> x = withPhase(parsed, "X");
  ASSERT_EQ(x.size(), 2u);
  EXPECT_EQ(threadNames(parsed)[*x[0]->getInteger("tid")], "host");
  EXPECT_DOUBLE_EQ(*x[0]->getNumber("ts"), 2e6);
  EXPECT_DOUBLE_EQ(*x[0]->getNumber("dur"), 5e5);
  const llvm::json::Object *args = x[0]->getObject("args");
  EXPECT_EQ(args->getInteger("instruction"), 42);
  EXPECT_EQ(args->getInteger("layer"), 0);
  EXPECT_EQ(args->getInteger("bytes"), 7);
  EXPECT_EQ(args->getInteger("flops"), 14 * 4096);
  EXPECT_EQ(x[1]->getObject("args")->get("layer"), nullptr);
}

TEST(ChromeTrace, CountersAndOtherData) {
  std::string text;
  llvm::raw_string_ostream os(text);
  ChromeTrace trace(os, "p");
  trace.counter("device memory", 0, {{"bytes", 0}});
  trace.counter("device memory", 0.001, {{"bytes", int64_t(1) << 40}});
  trace.setOtherData("backend", "sim");
  trace.setOtherData("predicted_seconds", 87.97);
  llvm::cantFail(trace.finish());

  llvm::json::Value parsed = parseTrace(text);
  std::vector<const llvm::json::Object *> c = withPhase(parsed, "C");
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[1]->getString("name"), "device memory");
  EXPECT_DOUBLE_EQ(*c[1]->getNumber("ts"), 1000);
  EXPECT_EQ(c[1]->getObject("args")->getInteger("bytes"), int64_t(1) << 40);
  const llvm::json::Object *other =
      parsed.getAsObject()->getObject("otherData");
  ASSERT_TRUE(other);
  EXPECT_EQ(other->getString("backend"), "sim");
  EXPECT_EQ(other->getNumber("predicted_seconds"), 87.97);
}

TEST(ChromeTrace, NamesAreEscaped) {
  std::string text;
  llvm::raw_string_ostream os(text);
  ChromeTrace trace(os, "a \"quoted\"\nprocess");
  trace.complete(exec::Stream::Compute, "op \"x\" \\ y\t", 0, 1);
  llvm::cantFail(trace.finish());
  llvm::json::Value parsed = parseTrace(text);
  EXPECT_EQ(withPhase(parsed, "X")[0]->getString("name"), "op \"x\" \\ y\t");
  EXPECT_EQ(withPhase(parsed, "M")[0]->getObject("args")->getString("name"),
            "a \"quoted\"\nprocess");
}

TEST(ChromeTrace, NonFiniteTimesStayValidJson) {
  std::string text;
  llvm::raw_string_ostream os(text);
  ChromeTrace trace(os, "p");
  trace.complete(exec::Stream::Compute, "x", 0, std::nan(""));
  llvm::cantFail(trace.finish());
  llvm::json::Value parsed = parseTrace(text);
  EXPECT_DOUBLE_EQ(*withPhase(parsed, "X")[0]->getNumber("dur"), 0);
}

TEST(ChromeTrace, DestructorFinishesTheDocument) {
  std::string text;
  llvm::raw_string_ostream os(text);
  { ChromeTrace trace(os, "p"); }
  parseTrace(text);
}

TEST(ChromeTrace, WritesFilesAndReportsUnwritablePaths) {
  llvm::SmallString<128> dir;
  ASSERT_FALSE(llvm::sys::fs::createUniqueDirectory("chrome-trace", dir));
  llvm::SmallString<128> path(dir);
  llvm::sys::path::append(path, "step.trace.json");
  {
    auto trace = llvm::cantFail(ChromeTrace::create(path, "p"));
    trace->complete(exec::Stream::DeviceToHost, "d2h", 0, 1);
    llvm::cantFail(trace->finish());
  }
  auto buffer = llvm::MemoryBuffer::getFile(path);
  ASSERT_TRUE(bool(buffer));
  llvm::json::Value parsed = parseTrace((*buffer)->getBuffer().str());
  EXPECT_EQ(withPhase(parsed, "X").size(), 1u);
  llvm::sys::fs::remove(path);
  llvm::sys::fs::remove(dir);

  llvm::Expected<std::unique_ptr<ChromeTrace>> bad =
      ChromeTrace::create("/nonexistent-dir/x/trace.json", "p");
  ASSERT_FALSE(bool(bad));
  EXPECT_NE(llvm::toString(bad.takeError())
                .find("cannot write trace '/nonexistent-dir/x/trace.json'"),
            std::string::npos);
}

// A 105B step has ~60k instructions: the writer must not be the slow part.
TEST(ChromeTrace, SixtyThousandEventsStreamQuickly) {
  constexpr int kEvents = 60000;
  std::string text;
  text.reserve(16 << 20);
  llvm::raw_string_ostream os(text);
  {
    ChromeTrace trace(os, "p");
    for (int i = 0; i < kEvents; ++i) {
      exec::TraceSpan span;
      span.stream = static_cast<exec::Stream>(i % exec::kNumStreams);
      span.name = "linear";
      span.start = i * 1e-3;
      span.seconds = 1e-3;
      span.instruction = i;
      span.layer = i / 1000;
      span.bytes = 1 << 20;
      span.flops = uint64_t(1) << 40;
      trace.complete(span);
    }
    // The process and 4 streams named at the start (2 events each), the
    // comm stream by its first span.
    EXPECT_EQ(trace.numEvents(), 9u + 2u + kEvents);
    llvm::cantFail(trace.finish());
  }
  llvm::json::Value parsed = parseTrace(text);
  EXPECT_EQ(withPhase(parsed, "X").size(), size_t(kEvents));
}

TEST(ChromeTrace, ValidationNamesWhatIsWrong) {
  EXPECT_NE(errorOf("{").find("invalid trace"), std::string::npos);
  EXPECT_NE(errorOf("[]").find("top level is not an object"),
            std::string::npos);
  EXPECT_NE(errorOf("{}").find("no \"traceEvents\" array"), std::string::npos);
  EXPECT_EQ(errorOf(R"({"traceEvents": []})"), "");
  EXPECT_NE(errorOf(R"({"traceEvents": [{"name": "x"}]})").find("event 0"),
            std::string::npos);
  // An event on a thread no metadata names.
  EXPECT_NE(errorOf(R"({"traceEvents": [{"name": "x", "ph": "X", "pid": 1,
                       "tid": 7, "ts": 0, "dur": 1}]})")
                .find("thread 7 of process 1 has no thread_name"),
            std::string::npos);
  const char *named = R"({"name": "thread_name", "ph": "M", "pid": 1,
                          "tid": 1, "args": {"name": "compute"}})";
  EXPECT_EQ(errorOf(std::string(R"({"traceEvents": [)") + named +
                    R"(, {"name": "x", "ph": "X", "pid": 1, "tid": 1,
                         "ts": 0, "dur": 1}]})"),
            "");
  EXPECT_NE(errorOf(std::string(R"({"traceEvents": [)") + named +
                    R"(, {"name": "x", "ph": "X", "pid": 1, "tid": 1,
                         "ts": 0, "dur": -1}]})")
                .find("event 1: \"dur\" is missing or negative"),
            std::string::npos);
  EXPECT_NE(errorOf(R"({"traceEvents": [{"name": "m", "ph": "C", "pid": 1,
                       "ts": 0, "args": {"bytes": "many"}}]})")
                .find("counter series 'bytes' is not a number"),
            std::string::npos);
  EXPECT_NE(errorOf(R"({"traceEvents": [{"name": "x", "ph": "B", "pid": 1,
                       "ts": 0}]})")
                .find("phase 'B'"),
            std::string::npos);
}

} // namespace
