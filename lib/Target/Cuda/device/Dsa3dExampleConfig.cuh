//===- Dsa3dExampleConfig.cuh - A configuration ----------------*- CUDA -*-===//
//
// What DsaKernels.cpp (emitDsaKernelSource) writes in front of the kernels
// for one configuration, here the tiny model's (grid 2x4x4, window 2x2x2,
// tile 1x2x2, 2 heads, head dim 16, radius 1): the build compiles the
// kernels with nvcc against it, and editors read them with it. Not part of
// the generated source. DSA_BF16=0 given on the command line selects f16.
//
//===----------------------------------------------------------------------===//

#ifndef DSA_BF16
#define DSA_BF16 1
#endif
#define DSA_FWD_NAME dsa3d_example_fwd
#define DSA_BWD_NAME dsa3d_example_bwd
#define DSA_BWD_KEYS_NAME dsa3d_example_bwd_keys
#define DSA_OFFSETS_NAME dsa3d_example_offsets

namespace dsa {
// Configuration.
constexpr int T = 2, Y = 4, X = 4;
constexpr int KT = 2, KY = 2, KX = 2;
constexpr int TT = 1, TY = 2, TX = 2;
constexpr int H = 2, D = 16, R = 1;
// Kernel shapes (chosen by the generator for registers and shared memory).
constexpr int FWD_WARPS = 1, FWD_KC = 16, FWD_STAGES = 1, FWD_QBLOCKS = 1;
constexpr int FWD_MIN_BLOCKS = 2;
constexpr bool FWD_QREG = true;
constexpr int BWD_WARPS = 1, BWD_KC = 16, BWD_STAGES = 1, BWD_QBLOCKS = 1;
constexpr int BWD_MIN_BLOCKS = 1;
constexpr int BKV_WARPS = 1, BKV_QC = 16, BKV_STAGES = 2, BKV_KBLOCKS = 1;
// Inverse tile neighbourhood (computed by the generator): per key tile along
// t, y, x, the first and last query tile whose window can hold one of its
// keys for some displacement in [-R, R] (none along t).
constexpr int BKV_CAND_T = 2, BKV_CAND_Y = 2, BKV_CAND_X = 2;
__device__ const int INV_T[2][2] = {{0, 1}, {0, 1}};
__device__ const int INV_Y[2][2] = {{0, 1}, {1, 1}};
__device__ const int INV_X[2][2] = {{0, 1}, {1, 1}};
constexpr int OFF_THREADS = 256;
} // namespace dsa
