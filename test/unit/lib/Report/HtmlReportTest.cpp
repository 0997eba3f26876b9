//===- HtmlReportTest.cpp - Self-contained HTML page of a plan ------------===//

#include "megaslide/Report/HtmlReport.h"

#include "llvm/ADT/StringRef.h"

#include "gtest/gtest.h"

#include <cstdlib>
#include <fstream>

using namespace megaslide;
namespace json = llvm::json;

namespace {

/// A two-layer plan with every field the page reads, over its GPU budget.
json::Value samplePlan() {
  json::Array memory;
  for (int i = 0; i <= 40; ++i)
    memory.push_back(json::Array{i * 0.05, (20 + (i % 10) * 7) * 1e9});
  json::Array streams;
  for (int i = 0; i < 8; ++i) {
    double start = i * 0.25;
    streams.push_back(json::Object{{"stream", "compute"},
                                   {"start", start},
                                   {"end", start + 0.2},
                                   {"label", "block " + std::to_string(i)}});
    streams.push_back(json::Object{{"stream", i % 2 ? "h2d" : "d2h"},
                                   {"start", start + 0.05},
                                   {"end", start + 0.15},
                                   {"label", "shard & grads"}});
  }
  streams.push_back(json::Object{
      {"stream", "host"}, {"start", 1.8}, {"end", 2.05}, {"label", "adamw"}});

  return json::Object{
      {"model", json::Object{{"name", "tiny-wan"},
                             {"architecture", "wan"},
                             {"num_layers", 2},
                             {"dim", 64},
                             {"num_heads", 4},
                             {"head_dim", 16},
                             {"ffn_dim", 128}}},
      {"video", json::Object{{"frames", 81},
                             {"height", 720},
                             {"width", 1280},
                             {"units", "pixels"},
                             {"batch", 1},
                             {"text_len", 512}}},
      {"tokens", 75600},
      {"grid", json::Array{21, 45, 80}},
      {"params", json::Object{{"total", 105968119872},
                              {"trainable", 105968119872},
                              {"frozen", 0}}},
      {"flops", json::Object{{"total", 91900407245374080}}},
      {"fits", false},
      {"violations",
       json::Array{"device peak 83.00 GB exceeds <script>alert(1)</script>"}},
      {"budgets",
       json::Object{{"gpu_bytes", 80000000000}, {"host_bytes", 1500000000000}}},
      {"hardware", json::Object{{"name", "h200"}}},
      {"policies",
       json::Object{{"host_state", "master+moments"},
                    {"activation", json::Array{"keep", "offload"}}}},
      {"host", json::Object{{"total_bytes", 1300000000000},
                            {"by_category",
                             json::Object{{"fp32 master", 420000000000},
                                          {"adamw moments", 840000000000},
                                          {"staging", 40000000000}}}}},
      {"device",
       json::Object{
           {"peak_bytes", 83000000000},
           {"by_category", json::Object{{"activations", 60000000000},
                                        {"weights", 23000000000}}},
           {"top_consumers",
            json::Array{json::Object{{"bytes", 30000000000},
                                     {"what", "attn <qkv> of block 1"}}}}}},
      {"per_layer",
       json::Array{json::Object{{"layer", 0},
                                {"host_bytes", 600000000000},
                                {"device_peak_bytes", 70000000000},
                                {"activation_policy", "keep"}},
                   json::Object{{"layer", 1},
                                {"host_bytes", 650000000000},
                                {"device_peak_bytes", 83000000000},
                                {"activation_policy", "offload"}}}},
      {"transfers",
       json::Object{{"h2d_bytes", 400000000000},
                    {"d2h_bytes", 250000000000},
                    {"h2d_by_kind", json::Object{{"weights", 400000000000}}},
                    {"d2h_by_kind", json::Object{{"grads", 250000000000}}}}},
      {"step", json::Object{{"predicted_seconds", 2.1},
                            {"lower_bound_seconds", 1.7},
                            {"bound_by", "compute"},
                            {"busy_seconds", json::Object{{"compute", 1.6},
                                                          {"h2d", 0.5},
                                                          {"d2h", 0.4},
                                                          {"host", 0.25}}}}},
      {"timeline", json::Object{{"memory", std::move(memory)},
                                {"streams", std::move(streams)}}},
  };
}

TEST(HtmlReport, RendersSelfContainedPageWithFourPlots) {
  std::string html = renderHtmlReport(samplePlan());
  llvm::StringRef page(html);
  EXPECT_TRUE(page.starts_with("<!DOCTYPE html>"));
  EXPECT_EQ(page.count("<svg"), 4u);
  EXPECT_FALSE(page.contains("http://"));
  EXPECT_FALSE(page.contains("https://"));
  EXPECT_TRUE(page.contains("tiny-wan"));
  EXPECT_TRUE(page.contains("GB = 10^9 bytes"));
  EXPECT_TRUE(page.contains("83.00 GB of 80.00 GB budget"));

  // Set MEGASLIDE_HTML_SAMPLE to a path to look at the page in a browser.
  if (const char *path = std::getenv("MEGASLIDE_HTML_SAMPLE"))
    std::ofstream(path) << html;
}

TEST(HtmlReport, EscapesTextFromThePlan) {
  std::string html = renderHtmlReport(samplePlan());
  llvm::StringRef page(html);
  EXPECT_FALSE(page.contains("<script"));
  EXPECT_TRUE(page.contains("exceeds &lt;script&gt;alert(1)&lt;/script&gt;"));
  EXPECT_TRUE(page.contains("attn &lt;qkv&gt; of block 1"));
  EXPECT_TRUE(page.contains("shard &amp; grads"));
  EXPECT_TRUE(page.contains("class=\"fits no\""));
}

TEST(HtmlReport, RendersEmptyPlanAsNotAvailable) {
  for (const json::Value &plan :
       {json::Value(json::Object{}), json::Value(nullptr),
        json::Value(json::Object{{"model", 3}, {"per_layer", "x"}})}) {
    std::string html = renderHtmlReport(plan);
    llvm::StringRef page(html);
    EXPECT_TRUE(page.starts_with("<!DOCTYPE html>"));
    EXPECT_EQ(page.count("<svg"), 4u);
    EXPECT_TRUE(page.contains("n/a"));
  }
}

// Tests that the training recipe section shows the mode and why, both
// modes with their bytes and whether they fit, the features, and the
// advice; without a recipe it says n/a.
TEST(HtmlReport, RendersTheTrainingRecipe) {
  json::Value plan = samplePlan();
  auto mode = [](int64_t bytes, bool fits, double seconds,
                 const char *note) {
    return json::Object{{"available", true},
                        {"host_bytes", bytes},
                        {"host_fits", fits},
                        {"step_seconds", seconds},
                        {"host_optimizer_seconds", 8.8},
                        {"note", note}};
  };
  (*plan.getAsObject())["recipe"] = json::Object{
      {"update", "streaming"},
      {"reason", "update=auto: deferring needs 635.81 GB, more than the "
                 "125.96 GB host-mem leaves"},
      {"grad_accum", 1},
      {"ema", "f32"},
      {"host_free_bytes", 125960000000},
      {"bytes", json::Object{{"retained_gradients", 211940000000},
                             {"gradient_accumulator", 0},
                             {"ema", 423870000000}}},
      {"modes",
       json::Object{{"deferred", mode(635810000000, false, 103.558, "x")},
                    {"streaming", mode(423870000000, false, 103.43,
                                       "clips with the previous step's "
                                       "norm")}}},
      {"device_accumulation_bytes", 423870000000},
      {"device_accumulation_fits", false},
      {"advice", json::Array{"to defer, 509.85 GB more: <bf16-moments>"}}};
  std::string html = renderHtmlReport(plan);
  llvm::StringRef page(html);
  EXPECT_TRUE(page.contains("<h2>Training recipe</h2>"));
  EXPECT_TRUE(page.contains("Update: <b>streaming</b> (update=auto: "
                            "deferring needs 635.81 GB"));
  EXPECT_TRUE(page.contains("<tr><td>deferred</td><td class=\"num\">635.81 "
                            "GB</td><td><span class=\"bad\">no</span>"));
  EXPECT_TRUE(page.contains("<td>streaming</td><td class=\"num\">423.87 GB"));
  EXPECT_TRUE(page.contains("423.87 GB (fp32): does not fit"));
  EXPECT_TRUE(page.contains("<li>to fit: to defer, 509.85 GB more: "
                            "&lt;bf16-moments&gt;</li>"));
  EXPECT_TRUE(
      llvm::StringRef(renderHtmlReport(samplePlan()))
          .contains("<h2>Training recipe</h2>\n<p>n/a</p>"));
}

} // namespace
