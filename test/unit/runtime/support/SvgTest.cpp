//===- SvgTest.cpp - Inline SVG plots of the HTML pages -------------------===//
//
// support/Svg, the drawing the plan report and the training report share:
// the frame's mapping (linear and log), ticks, the legend's rows and the
// plot tags tests find plots by.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/support/Svg.h"

#include "llvm/ADT/StringRef.h"

#include "gtest/gtest.h"

#include <string>

using namespace megaslide;
using llvm::StringRef;

namespace {

/// What `draw(os)` writes.
template <typename Fn> std::string written(Fn draw) {
  std::string text;
  llvm::raw_string_ostream os(text);
  draw(os);
  return text;
}

size_t count(StringRef text, StringRef what) { return text.count(what); }

TEST(Svg, RangeWidensWhatIsEmptyOrInverted) {
  EXPECT_EQ(svg::Range(2, 5).span(), 3);
  EXPECT_EQ(svg::Range(4, 4).max, 5);
  EXPECT_EQ(svg::Range(4, 1).max, 5);
}

TEST(Svg, FrameMapsTheDataWindowToItsPixels) {
  svg::Frame f{100, 10, 200, 50, {0, 4}, {0, 10}};
  EXPECT_EQ(f.px(0), 100);
  EXPECT_EQ(f.px(4), f.right());
  EXPECT_EQ(f.py(0), f.bottom());
  EXPECT_EQ(f.py(10), 10);
  // Log: the y range is in decades, py takes values.
  svg::Frame log{0, 0, 100, 100, {0, 1}, {0, 2}, /*logY=*/true};
  EXPECT_DOUBLE_EQ(log.py(1), 100);
  EXPECT_DOUBLE_EQ(log.py(10), 50);
  EXPECT_DOUBLE_EQ(log.py(100), 0);
}

TEST(Svg, TicksAreRoundAndLabelledWithTheDecimalsTheyNeed) {
  EXPECT_DOUBLE_EQ(svg::tickStep(1, 5, 0), 0.2);
  EXPECT_DOUBLE_EQ(svg::tickStep(30, 8, 0), 5);
  EXPECT_DOUBLE_EQ(svg::tickStep(3, 8, 1), 1); // integer axes stay integers
  EXPECT_EQ(svg::tickLabel(0.25, 0.05), "0.25");
  EXPECT_EQ(svg::tickLabel(-1e-12, 0.05), "0.00"); // never "-0.00"
  EXPECT_EQ(svg::tickLabel(40, 20), "40");

  std::vector<double> ticks;
  svg::forEachTick(-0.1, 1, 0.5, [&](double v) { ticks.push_back(v); });
  EXPECT_EQ(ticks, (std::vector<double>{0, 0.5, 1}));
}

TEST(Svg, AxesDrawATickAndGridLinePerRoundValue) {
  svg::Frame f{80, 20, 700, 200, {1, 4}, {0, 1}};
  std::string x =
      written([&](llvm::raw_ostream &os) { svg::drawXAxis(os, f, "step", 1); });
  EXPECT_EQ(count(x, "class=\"grid\""), 4u) << x; // 1, 2, 3, 4
  EXPECT_NE(x.find(">3</text>"), std::string::npos);
  EXPECT_NE(x.find(">step</text>"), std::string::npos);

  std::string y = written([&](llvm::raw_ostream &os) {
    svg::drawYAxis(os, f, "GB", 52, [](double value, double step) {
      return "v" + svg::tickLabel(value, step);
    });
  });
  EXPECT_EQ(count(y, "class=\"grid\""), 6u) << y; // 0, 0.2, ..., 1
  EXPECT_NE(y.find(">v0.4</text>"), std::string::npos) << y;
  EXPECT_NE(y.find("translate(28.0,120.0) rotate(-90)"), std::string::npos)
      << y;
}

TEST(Svg, LegendWrapsBeforeTheRightEdgeOnly) {
  svg::LegendLayout legend{20, 17, 30, 10, /*right=*/200};
  // Widths 30 + 10 x size: 80, 80, 130.
  std::vector<std::pair<double, int>> places =
      legend.place({"abcde", "fghij", "klmnopqrst"});
  ASSERT_EQ(places.size(), 3u);
  EXPECT_EQ(places[0], std::make_pair(20.0, 0));
  EXPECT_EQ(places[1], std::make_pair(100.0, 0));
  EXPECT_EQ(places[2], std::make_pair(20.0, 1)); // 180 + 130 > 200
  // A first entry wider than the row stays on it.
  EXPECT_EQ(legend.place({std::string(40, 'x')})[0], std::make_pair(20.0, 0));
  // Without a right edge: one row.
  svg::LegendLayout row{20, 17, 30, 10};
  EXPECT_EQ(row.place({"abcde", "fghij", "klmnopqrst"})[2],
            std::make_pair(180.0, 0));
}

TEST(Svg, PlotsAreTaggedOnlyWhenGivenAnId) {
  std::string tagged = written([](llvm::raw_ostream &os) {
    svg::emptySvg(os, "Loss", "n/a: no loss", "loss");
  });
  EXPECT_NE(tagged.find("aria-label=\"Loss\" data-plot=\"loss\">"),
            std::string::npos)
      << tagged;
  EXPECT_NE(tagged.find(">n/a: no loss</text>\n</svg>\n"), std::string::npos);
  std::string plain =
      written([](llvm::raw_ostream &os) { svg::openSvg(os, 100, "Memory"); });
  EXPECT_EQ(plain, "<svg viewBox=\"0 0 900 100\" width=\"900\" height=\"100\" "
                   "role=\"img\" aria-label=\"Memory\">\n");
}

} // namespace
