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
