//===- TrainingReportTest.cpp - A run's metrics as one HTML page ----------===//

#include "megaslide/runtime/train/TrainingReport.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"

#include "gtest/gtest.h"

#include <cmath>
#include <string>

using namespace megaslide::train;
using llvm::StringRef;

namespace {

/// The page of `metrics`; fails the test on an error.
std::string page(StringRef metrics, const TrainingReportInfo &info = {}) {
  llvm::Expected<std::string> html = trainingReportHtml(metrics, info);
  if (!html) {
    ADD_FAILURE() << llvm::toString(html.takeError());
    return "";
  }
  return *html;
}

/// The error of `metrics`; fails the test when there is none.
std::string error(StringRef metrics) {
  llvm::Expected<std::string> html = trainingReportHtml(metrics, {});
  if (html) {
    ADD_FAILURE() << "no error for:\n" << metrics.str();
    return "";
  }
  return llvm::toString(html.takeError());
}

/// The SVG of plot `id` (its data-plot), or "" when there is none.
std::string plotOf(StringRef html, StringRef id) {
  size_t start = html.find(("data-plot=\"" + id + "\"").str());
  if (start == StringRef::npos)
    return "";
  size_t end = html.find("</svg>", start);
  return html.substr(start, end - start).str();
}

/// The number of points of the polyline of `series` in `svg`; -1 when
/// it has none.
int pointsOf(StringRef svg, StringRef series) {
  size_t at = svg.find(("data-series=\"" + series + "\"").str());
  if (at == StringRef::npos)
    return -1;
  size_t start = svg.find("points=\"", at) + 8;
  StringRef points = svg.substr(start, svg.find('"', start) - start);
  int count = 0;
  for (StringRef rest = points.trim(); !rest.empty();) {
    auto [point, tail] = rest.split(' ');
    EXPECT_TRUE(point.contains(',')) << point.str();
    ++count;
    rest = tail.ltrim();
  }
  return count;
}

int occurrences(StringRef text, StringRef what) {
  int n = 0;
  for (size_t at = text.find(what); at != StringRef::npos;
       at = text.find(what, at + what.size()))
    ++n;
  return n;
}

/// A line with every field of a current metrics file.
std::string fullLine(int step, double loss, bool clipped = false,
                     bool skipped = false, const char *extra = "") {
  return llvm::formatv(
             "{{\"step\": {0}, \"loss\": {1}, \"lr\": 1e-05, \"grad_norm\": "
             "{2}, \"clipped\": {3}, \"skipped\": {4}, \"micro_batches\": 2, "
             "\"seconds\": 0.81, \"samples_per_second\": 2.47, "
             "\"tokens_per_second\": 1183.0, \"host_rss_bytes\": 123456789, "
             "\"device_peak_bytes\": 4567890{5}}\n",
             step, skipped ? "null" : std::to_string(loss),
             skipped ? "null" : (clipped ? "1.7" : "0.6"),
             clipped ? "true" : "false", skipped ? "true" : "false", extra)
      .str();
}

TEST(TrainingReportTest, PlotsEveryCurveWithOnePointPerStep) {
  std::string metrics;
  for (int step = 1; step <= 10; ++step)
    metrics += fullLine(step, 1.0 / step, /*clipped=*/step <= 3,
                        /*skipped=*/step == 6,
                        step % 5 == 0 ? ", \"val_loss\": 0.3" : "");
  TrainingReportInfo info;
  info.title = "tiny <run> & co";
  info.settings = {{"max_grad_norm", "1.0"}, {"lr", "<1e-5>"}};
  std::string html = page(metrics, info);

  EXPECT_NE(html.find("<title>tiny &lt;run&gt; &amp; co</title>"),
            std::string::npos);
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("http"), std::string::npos) << "no external resource";
  // Nine steps have a loss (step 6 was skipped); validation ran twice.
  std::string loss = plotOf(html, "loss");
  EXPECT_EQ(pointsOf(loss, "loss"), 9);
  EXPECT_EQ(pointsOf(loss, "val_loss"), 2);
  EXPECT_NE(loss.find("step 6: skipped"), std::string::npos);
  EXPECT_EQ(pointsOf(plotOf(html, "lr"), "lr"), 10);
  std::string grad = plotOf(html, "grad_norm");
  EXPECT_EQ(pointsOf(grad, "grad_norm"), 9);
  EXPECT_EQ(occurrences(grad, "<circle class=\"highlight\""), 3 + 1)
      << "three clipped steps and the legend's";
  EXPECT_NE(grad.find("max_grad_norm 1"), std::string::npos);
  EXPECT_EQ(occurrences(grad, "class=\"threshold\""), 2)
      << "the dashed line and its legend";
  EXPECT_EQ(pointsOf(plotOf(html, "seconds"), "seconds"), 10);
  EXPECT_EQ(pointsOf(plotOf(html, "throughput"), "samples_per_second"), 10);
  std::string memory = plotOf(html, "memory");
  EXPECT_EQ(pointsOf(memory, "host_rss_bytes"), 10);
  EXPECT_EQ(pointsOf(memory, "device_peak_bytes"), 10);

  // Summary and settings.
  EXPECT_NE(html.find("10 (step 1 to 10)"), std::string::npos);
  EXPECT_NE(html.find("last 0.1 (step 10), smallest 0.1 (step 10)"),
            std::string::npos);
  EXPECT_NE(html.find("last 0.3 (step 10)"), std::string::npos);
  EXPECT_NE(html.find("3 of 10 (30%)"), std::string::npos);
  EXPECT_NE(html.find("1: step 6"), std::string::npos);
  EXPECT_NE(html.find("mean 0.810 s over 10 steps"), std::string::npos);
  EXPECT_NE(html.find("<td>&lt;1e-5&gt;</td>"), std::string::npos);
  // Under a gigabyte, memory is in megabytes.
  EXPECT_NE(html.find("<th>Peak host RSS</th><td>123.5 MB</td>"),
            std::string::npos);
  EXPECT_NE(memory.find(">MB</text>"), std::string::npos);
  EXPECT_EQ(html.find("Not in this file"), std::string::npos);
}

// Tests that a weighted run's unweighted loss (--weighting-scheme) is
// drawn beside its loss, and that other runs neither draw nor miss it.
TEST(TrainingReportTest, AWeightedRunDrawsItsUnweightedLoss) {
  std::string weighted, plain;
  for (int step = 1; step <= 4; ++step) {
    weighted += fullLine(step, 2.0 / step, false, step == 3,
                         step == 3 ? ", \"unweighted_loss\": null"
                                   : ", \"unweighted_loss\": 0.5");
    plain += fullLine(step, 2.0 / step);
  }
  std::string loss = plotOf(page(weighted), "loss");
  EXPECT_EQ(pointsOf(loss, "loss"), 3);
  EXPECT_EQ(pointsOf(loss, "unweighted_loss"), 3);
  EXPECT_NE(loss.find("unweighted train loss"), std::string::npos);
  std::string html = page(plain);
  EXPECT_EQ(pointsOf(plotOf(html, "loss"), "unweighted_loss"), -1);
  EXPECT_EQ(html.find("unweighted"), std::string::npos);
  EXPECT_NE(error("{\"step\": 1, \"unweighted_loss\": \"low\"}\n")
                .find("\"unweighted_loss\" must be a number or null"),
            std::string::npos);
}

TEST(TrainingReportTest, OldFilesPlotWhatTheyHave) {
  // What megaslide-run wrote before issue 15: step, loss, seconds.
  std::string html = page("{\"step\": 1, \"loss\": 0.9, \"seconds\": 1.5}\n"
                          "{\"step\": 2, \"loss\": null, \"skipped\": true, "
                          "\"seconds\": 0.5}\n"
                          "{\"step\": 3, \"loss\": 0.7, \"seconds\": 0.5}\n");
  EXPECT_EQ(pointsOf(plotOf(html, "loss"), "loss"), 2);
  EXPECT_EQ(pointsOf(plotOf(html, "seconds"), "seconds"), 3);
  for (StringRef absent : {"lr", "grad_norm", "throughput", "memory"})
    EXPECT_EQ(plotOf(html, absent).find("<polyline"), std::string::npos)
        << absent.str();
  EXPECT_NE(plotOf(html, "lr").find("n/a: no line has &quot;lr&quot;"),
            std::string::npos);
  EXPECT_NE(html.find("Not in this file: &quot;val_loss&quot;, "
                      "&quot;lr&quot;, &quot;grad_norm&quot;"),
            std::string::npos);
  EXPECT_NE(html.find("n/a: no validation ran"), std::string::npos);
  EXPECT_NE(html.find("1: step 2"), std::string::npos);
  EXPECT_NE(html.find("0.500 s without the first"), std::string::npos);
}

TEST(TrainingReportTest, SimFilesHaveTimeButNoLoss) {
  std::string html = page("{\"step\": 1, \"loss\": null, \"seconds\": 2}\n"
                          "{\"step\": 2, \"loss\": null, \"seconds\": 2}\n");
  std::string loss = plotOf(html, "loss");
  EXPECT_EQ(loss.find("<polyline"), std::string::npos);
  EXPECT_NE(loss.find("null on every line (the sim backend measures time"),
            std::string::npos);
  EXPECT_EQ(pointsOf(plotOf(html, "seconds"), "seconds"), 2);
}

TEST(TrainingReportTest, MalformedLinesNameTheirLine) {
  std::string good = "{\"step\": 1, \"loss\": 0.5}\n";
  EXPECT_EQ(error(good + "\n{\"step\": 2, \"loss\": }\n" + good),
            "line 3: invalid JSON: column 21: Invalid JSON value");
  EXPECT_EQ(error(good + "[1, 2]\n"),
            "line 2: not a JSON object but an array (a metrics file has one "
            "object per step)");
  EXPECT_EQ(error(good + "{\"loss\": 0.5}\n"),
            "line 2: no \"step\" (every line of a metrics file has the step "
            "it is of)");
  EXPECT_EQ(error(good + "{\"step\": -1}\n"),
            "line 2: \"step\" must be a non-negative integer");
  EXPECT_EQ(error(good + good + "{\"step\": 3, \"loss\": \"low\"}\n"),
            "line 3: \"loss\" must be a number or null, got a string");
  EXPECT_EQ(error(good + "{\"step\": 2, \"clipped\": 1}\n"),
            "line 2: \"clipped\" must be true, false or null, got a number");
  // Nesting a parser cannot recurse through is an error, not a crash.
  EXPECT_NE(
      error(std::string(100000, '[') + "\n").find("line 1: invalid JSON: "),
      std::string::npos);
}

TEST(TrainingReportTest, EmptyFilesAreErrors) {
  EXPECT_EQ(error(""), "the metrics file is empty: no step");
  EXPECT_EQ(error("\n  \n\n"), "the metrics file is empty: no step");
  EXPECT_EQ(error("{\"step\": 1, \"lo"),
            "the metrics file holds no whole line (line 1 is cut short)");
}

TEST(TrainingReportTest, ALastLineCutByAKillIsLeftOut) {
  std::string html = page("{\"step\": 1, \"loss\": 0.5}\n"
                          "{\"step\": 2, \"loss\": 0.4}\n"
                          "{\"step\": 3, \"lo");
  EXPECT_EQ(pointsOf(plotOf(html, "loss"), "loss"), 2);
  EXPECT_NE(html.find("Line 3 is cut short"), std::string::npos);
  // With its newline it was written whole: malformed, so an error.
  EXPECT_NE(error("{\"step\": 1, \"loss\": 0.5}\n{\"step\": 3, \"lo\n")
                .find("line 2: invalid JSON"),
            std::string::npos);
}

TEST(TrainingReportTest, ARepeatedStepTakesItsLaterLine) {
  // A run resumed from step 2's checkpoint appended to a file that already
  // had step 3 (or two logs were concatenated).
  std::string html = page("{\"step\": 1, \"loss\": 0.9}\n"
                          "{\"step\": 2, \"loss\": 0.8}\n"
                          "{\"step\": 3, \"loss\": 0.05}\n"
                          "{\"step\": 3, \"loss\": 0.7}\n"
                          "{\"step\": 4, \"loss\": 0.6}\n");
  EXPECT_EQ(pointsOf(plotOf(html, "loss"), "loss"), 4);
  EXPECT_NE(html.find("4 (step 1 to 4)"), std::string::npos);
  EXPECT_NE(html.find("smallest 0.6 (step 4)"), std::string::npos)
      << "the earlier 0.05 of step 3 was replaced";
  EXPECT_NE(html.find("Step 3 appears on more than one line"),
            std::string::npos);
}

TEST(TrainingReportTest, NonFiniteLossesAreMarkedNotPlotted) {
  // Bare NaN and Infinity as Python's json.dumps writes them, and strings.
  std::string html = page("{\"step\": 1, \"loss\": 0.9, \"grad_norm\": 1}\n"
                          "{\"step\": 2, \"loss\": NaN, \"grad_norm\": "
                          "Infinity, \"note\": \"NaN\"}\n"
                          "{\"step\": 3, \"loss\": \"-inf\"}\n"
                          "{\"step\": 4, \"loss\": 0.7, \"grad_norm\": 2}\n");
  std::string loss = plotOf(html, "loss");
  EXPECT_EQ(pointsOf(loss, "loss"), 2);
  EXPECT_NE(loss.find("step 2: the loss is not finite"), std::string::npos);
  EXPECT_NE(loss.find("step 3: the loss is not finite"), std::string::npos);
  EXPECT_EQ(loss.find("nan"), std::string::npos);
  EXPECT_EQ(loss.find("inf"), std::string::npos);
  // The y axis spans the finite losses only: ticks of tenths, not of
  // some huge number.
  EXPECT_NE(loss.find(">0.80</text>"), std::string::npos);
  std::string grad = plotOf(html, "grad_norm");
  EXPECT_EQ(pointsOf(grad, "grad_norm"), 2);
  EXPECT_NE(grad.find("step 2: the gradient norm is not finite"),
            std::string::npos);
  EXPECT_NE(html.find("Non-finite values"), std::string::npos);
}

TEST(TrainingReportTest, LossAxisIsLogarithmicWhenItSpansDecades) {
  std::string decades;
  for (int step = 1; step <= 20; ++step)
    decades += llvm::formatv("{{\"step\": {0}, \"loss\": {1}}\n", step,
                             llvm::format("%.9g", std::pow(10.0, -step / 5.0)))
                   .str();
  std::string html = page(decades);
  EXPECT_NE(html.find("Logarithmic loss axis: the largest loss is 6310 "
                      "times the smallest"),
            std::string::npos);
  EXPECT_NE(plotOf(html, "loss").find(">0.001</text>"), std::string::npos);
  TrainingReportInfo linear;
  linear.lossScale = LossScale::Linear;
  EXPECT_EQ(page(decades, linear).find("Logarithmic"), std::string::npos);

  std::string flat = "{\"step\": 1, \"loss\": 0.5}\n"
                     "{\"step\": 2, \"loss\": 0.4}\n";
  EXPECT_EQ(page(flat).find("Logarithmic"), std::string::npos);
  TrainingReportInfo log;
  log.lossScale = LossScale::Log;
  EXPECT_NE(page(flat, log).find("Logarithmic loss axis, as asked"),
            std::string::npos);
  EXPECT_NE(
      page("{\"step\": 1, \"loss\": 0}\n{\"step\": 2, \"loss\": 1}\n", log)
          .find("a loss is zero or negative"),
      std::string::npos);
}

TEST(TrainingReportTest, ASingleStepStillDraws) {
  std::string html = page(fullLine(7, 0.5));
  EXPECT_EQ(pointsOf(plotOf(html, "loss"), "loss"), 1);
  EXPECT_NE(plotOf(html, "loss").find("<circle"), std::string::npos);
  EXPECT_EQ(html.find("nan"), std::string::npos);
}

} // namespace
