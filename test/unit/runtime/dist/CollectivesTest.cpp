//===- CollectivesTest.cpp - Where a rank sits in its job -----------------===//

#include "megaslide/runtime/dist/Collectives.h"

#include <gtest/gtest.h>

#include <cstdlib>

using namespace megaslide::dist;

namespace {

/// Sets the launcher variables of one test and clears every other.
class LauncherEnv : public ::testing::Test {
protected:
  void SetUp() override { clear(); }
  void TearDown() override { clear(); }
  static void clear() {
    for (const char *name :
         {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
          "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
          "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
          "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
          "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS"})
      ::unsetenv(name);
  }
  static World world() {
    llvm::Expected<World> w = worldFromEnvironment();
    if (!w) {
      ADD_FAILURE() << llvm::toString(w.takeError());
      return World();
    }
    return *w;
  }
  static std::string error() {
    llvm::Expected<World> w = worldFromEnvironment();
    if (w) {
      ADD_FAILURE() << "no error";
      return "";
    }
    return llvm::toString(w.takeError());
  }
};

TEST_F(LauncherEnv, AProcessOnItsOwnIsOneRank) {
  // A Slurm batch script's own process: the allocation's task count is not
  // a job of that many ranks.
  ::setenv("SLURM_NTASKS", "8", 1);
  ::setenv("SLURM_PROCID", "0", 1);
  World w = world();
  EXPECT_EQ(w.size, 1);
  EXPECT_EQ(w.rank, 0);
  EXPECT_EQ(w.launcher, "");
}

TEST_F(LauncherEnv, OpenMpiHydraAndSrunAreRead) {
  ::setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  ::setenv("OMPI_COMM_WORLD_RANK", "2", 1);
  ::setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  World w = world();
  EXPECT_EQ(w.launcher, "mpirun");
  EXPECT_EQ(w.rank, 2);
  EXPECT_EQ(w.size, 4);
  EXPECT_EQ(w.localSize, 2);
  clear();
  ::setenv("PMI_SIZE", "3", 1);
  ::setenv("PMI_RANK", "1", 1);
  w = world();
  EXPECT_EQ(w.launcher, "mpiexec");
  EXPECT_EQ(w.rank, 1);
  clear();
  ::setenv("SLURM_STEP_NUM_TASKS", "16", 1);
  ::setenv("SLURM_PROCID", "9", 1);
  ::setenv("SLURM_LOCALID", "1", 1);
  ::setenv("SLURM_STEP_TASKS_PER_NODE", "8(x2)", 1);
  w = world();
  EXPECT_EQ(w.launcher, "srun");
  EXPECT_EQ(w.rank, 9);
  EXPECT_EQ(w.localRank, 1);
  EXPECT_EQ(w.localSize, 8);
}

TEST_F(LauncherEnv, ABadLaunchIsNamed) {
  ::setenv("OMPI_COMM_WORLD_SIZE", "two", 1);
  EXPECT_NE(error().find("OMPI_COMM_WORLD_SIZE='two'"), std::string::npos);
  ::setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  ::setenv("OMPI_COMM_WORLD_RANK", "2", 1);
  EXPECT_NE(error().find("not a rank of the job"), std::string::npos);
  ::unsetenv("OMPI_COMM_WORLD_RANK");
  EXPECT_NE(error().find("unset"), std::string::npos);
}

TEST_F(LauncherEnv, OneRankNeedsNoMpi) {
  llvm::Expected<std::unique_ptr<Collectives>> job = openCollectives();
  ASSERT_TRUE(!!job) << llvm::toString(job.takeError());
  EXPECT_EQ((*job)->size(), 1);
  float x[2] = {1.5f, -2};
  EXPECT_FALSE((*job)->allReduceSum(llvm::MutableArrayRef<float>(x)));
  EXPECT_EQ(x[1], -2);
  EXPECT_FALSE((*job)->checkSame("the plan", "abc"));
}

TEST_F(LauncherEnv, AMissingPluginSaysWhatToDo) {
  ::setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  ::setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  ::setenv("MEGASLIDE_MPI_PLUGIN", "/nonexistent/libMegaSlideMpi.so", 1);
  llvm::Expected<std::unique_ptr<Collectives>> job = openCollectives();
  ::unsetenv("MEGASLIDE_MPI_PLUGIN");
  ASSERT_FALSE(!!job);
  std::string text = llvm::toString(job.takeError());
  EXPECT_NE(text.find("rank 1 of 2 by mpirun"), std::string::npos) << text;
  EXPECT_NE(text.find("install-deps.sh"), std::string::npos) << text;
}

} // namespace

namespace {

TEST(ShardRangeTest, ShardsTileTheTensorAlignedAndBalanced) {
  for (int64_t count : {0, 1, 15, 16, 17, 100, 4096, 1000003})
    for (int ranks : {1, 2, 3, 4, 8}) {
      int64_t next = 0, largest = 0, smallest = count;
      for (int r = 0; r < ranks; ++r) {
        ShardRange s = shardRange(count, r, ranks);
        EXPECT_EQ(s.begin, next) << count << " " << ranks << " " << r;
        EXPECT_LE(s.begin, s.end);
        if (s.end < count) {
          EXPECT_EQ(s.end % kShardAlign, 0) << count << " " << r;
        }
        largest = std::max(largest, s.size());
        smallest = std::min(smallest, s.size());
        if (r > 0) {
          EXPECT_LE(s.size(), shardRange(count, 0, ranks).size());
        }
        next = s.end;
      }
      EXPECT_EQ(next, count) << count << " " << ranks;
      // Balanced to one alignment unit (the last may be short).
      EXPECT_LE(largest - smallest, 2 * kShardAlign) << count << " " << ranks;
    }
}

} // namespace
