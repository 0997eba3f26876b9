//===- FaultInjectionTest.cpp - Test-only faults from the environment -----===//
//
// support/FaultInjection: the hooks answer what the environment asked for
// and "no fault" for a malformed request. The environment is read once per
// process, so each case runs in a fresh one: the threadsafe death-test
// style re-executes the test in a child, which checks the hooks and exits
// with what it found.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/support/FaultInjection.h"

#include "gtest/gtest.h"

#include <cstdlib>
#include <map>
#include <string>

using namespace megaslide;

namespace {

/// Runs `check` in a fresh process whose environment has `env` set; the
/// test fails unless it returns 0 (a nonzero code names the failed check).
template <typename Check>
void expectInFreshProcess(const std::map<std::string, std::string> &env,
                          Check check) {
  std::string style = GTEST_FLAG_GET(death_test_style);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (const auto &[name, value] : env)
    ASSERT_EQ(::setenv(name.c_str(), value.c_str(), 1), 0);
  EXPECT_EXIT(std::_Exit(check()), ::testing::ExitedWithCode(0), "");
  for (const auto &[name, value] : env)
    ::unsetenv(name.c_str());
  GTEST_FLAG_SET(death_test_style, style);
}

TEST(FaultInjectionTest, HooksAnswerWhatTheEnvironmentAsks) {
  expectInFreshProcess({{"MEGASLIDE_FAULT_WRITE_LIMIT", "100"},
                        {"MEGASLIDE_FAULT_NAN_GRADIENT", "blocks.0.w@3"}},
                       [] {
                         if (fault::writeLimit() != uint64_t{100})
                           return 2;
                         if (!fault::nanGradient("blocks.0.w", 3))
                           return 3;
                         if (fault::nanGradient("blocks.0.w", 2) ||
                             fault::nanGradient("blocks.1.w", 3))
                           return 4;
                         return 0;
                       });
}

TEST(FaultInjectionTest, MalformedRequestsAskForNoFault) {
  expectInFreshProcess({{"MEGASLIDE_FAULT_WRITE_LIMIT", "100x"},
                        {"MEGASLIDE_FAULT_NAN_GRADIENT", "blocks.0.w"}},
                       [] {
                         if (fault::writeLimit())
                           return 2;
                         if (fault::nanGradient("blocks.0.w", -1) ||
                             fault::nanGradient("", -1))
                           return 3;
                         return 0;
                       });
}

} // namespace
