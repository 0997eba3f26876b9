//===- MpiPlugin.h - The MPI plugin's C interface ---------------*- C++ -*-===//
//
// What libMegaSlideMpi.so exports: MPI behind plain C functions, so the
// plugin links MPI alone (no LLVM, no C++ types across the boundary).
// Every function returns an MPI error code; errorText turns one into text.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_DIST_MPIPLUGIN_H
#define MEGASLIDE_RUNTIME_DIST_MPIPLUGIN_H

#include <cstddef>

extern "C" {

struct MegaSlideMpiApi {
  int (*allReduceSum)(void *data, size_t count, int isDouble);
  int (*allGatherLengths)(int mine, int *lengths);
  int (*allGatherBytes)(const char *mine, int length, const int *lengths,
                        char *out);
  int (*barrier)();
  /// Elements of 1, 2 or 4 bytes, in place (MPI_Allgatherv): rank r's
  /// `counts[r]` at `offsets[r]` of `data` go to every rank.
  int (*allGatherElements)(void *data, int elementBytes, const int *counts,
                           const int *offsets);
  /// Floats, in place (MPI_Reduce_scatter): the sum over the ranks of
  /// `counts[rank]` elements at `offsets[rank]` lands there on this rank.
  int (*reduceScatterFloats)(float *data, const int *counts,
                             const int *offsets);
  /// Floats to rank 0 (MPI_Gatherv): `mine` (count `counts[rank]`) lands
  /// at `offsets[rank]` of `all` on rank 0.
  int (*gatherFloats)(const float *mine, float *all, const int *counts,
                      const int *offsets);
  void (*finalize)();
  void (*errorText)(int code, char *text, int capacity);
  /// Ends every rank of the job with `code` (MPI_Abort); does not return.
  void (*abort)(int code);
};

/// Starts MPI (once), fills `api` and this rank's host name; returns 0, or
/// writes why not into `error`.
int megaslideMpiOpen(int rank, int size, MegaSlideMpiApi *api, char *host,
                     int hostCapacity, char *error, int errorCapacity);
}

inline constexpr const char *kMpiOpenSymbol = "megaslideMpiOpen";

#endif // MEGASLIDE_RUNTIME_DIST_MPIPLUGIN_H
