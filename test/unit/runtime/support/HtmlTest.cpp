//===- HtmlTest.cpp - The shell of the self-contained HTML pages ----------===//
//
// support/Html: the page shell both reports write, with the shared CSS
// before the page's own rules (so that a page can override them), and
// escaping.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/support/Html.h"

#include "llvm/ADT/StringRef.h"

#include "gtest/gtest.h"

#include <string>

using namespace megaslide;
using llvm::StringRef;

namespace {

TEST(Html, PageHasTheSharedRulesThenItsOwn) {
  std::string page;
  llvm::raw_string_ostream os(page);
  html::openPage(os, "a &amp; b", "\n.mine { color: red; }\n");
  html::closePage(os);
  EXPECT_TRUE(StringRef(page).starts_with("<!DOCTYPE html>\n"));
  EXPECT_NE(page.find("<title>a &amp; b</title>"), std::string::npos);
  size_t shared = page.find("svg .grid {"), own = page.find(".mine {");
  ASSERT_NE(shared, std::string::npos);
  ASSERT_NE(own, std::string::npos);
  EXPECT_LT(shared, own);
  EXPECT_NE(page.find("}\n.mine { color: red; }\n</style>"), std::string::npos)
      << page;
  EXPECT_TRUE(StringRef(page).ends_with("</body>\n</html>\n"));
  EXPECT_EQ(html::escape("<a href=\"x\">&</a>"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&lt;/a&gt;");
}

} // namespace
