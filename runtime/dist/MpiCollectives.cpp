//===- MpiCollectives.cpp - The MPI plugin --------------------------------===//
//
// libMegaSlideMpi.so: MPI_COMM_WORLD behind MpiPlugin.h's C functions.
// Loaded with dlopen by dist::openCollectives only when a launcher
// started the job, so nothing else links MPI. Errors return
// (MPI_ERRORS_RETURN) with MPI's code.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/dist/MpiPlugin.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mpi.h>
#include <vector>

namespace {

void errorText(int code, char *text, int capacity) {
  char buffer[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, buffer, &length) != MPI_SUCCESS)
    std::snprintf(buffer, sizeof(buffer), "MPI error %d", code);
  std::snprintf(text, capacity, "%s", buffer);
}

int allReduceSum(void *data, size_t count, int isDouble) {
  MPI_Datatype type = isDouble ? MPI_DOUBLE : MPI_FLOAT;
  size_t bytes = isDouble ? sizeof(double) : sizeof(float);
  // MPI counts are ints: a large buffer goes in pieces.
  constexpr size_t kPiece = size_t(1) << 30;
  for (size_t done = 0; done < count; done += kPiece) {
    int n = static_cast<int>(std::min(kPiece, count - done));
    int code =
        MPI_Allreduce(MPI_IN_PLACE, static_cast<char *>(data) + done * bytes, n,
                      type, MPI_SUM, MPI_COMM_WORLD);
    if (code != MPI_SUCCESS)
      return code;
  }
  return MPI_SUCCESS;
}

int allGatherLengths(int mine, int *lengths) {
  return MPI_Allgather(&mine, 1, MPI_INT, lengths, 1, MPI_INT, MPI_COMM_WORLD);
}

int allGatherBytes(const char *mine, int length, const int *lengths,
                   char *out) {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<int> offsets(size);
  for (int r = 1; r < size; ++r)
    offsets[r] = offsets[r - 1] + lengths[r - 1];
  return MPI_Allgatherv(mine, length, MPI_CHAR, out, lengths, offsets.data(),
                        MPI_CHAR, MPI_COMM_WORLD);
}

int barrier() { return MPI_Barrier(MPI_COMM_WORLD); }

int allGatherElements(void *data, int elementBytes, const int *counts,
                      const int *offsets) {
  // Copied, not combined: any type of the element's size moves its bits.
  MPI_Datatype type = elementBytes == 4   ? MPI_FLOAT
                      : elementBytes == 2 ? MPI_UINT16_T
                                          : MPI_BYTE;
  return MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, counts,
                        offsets, type, MPI_COMM_WORLD);
}

int reduceScatterFloats(float *data, const int *counts, const int *offsets) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // In place, MPI leaves this rank's sum at the start of the buffer.
  int code = MPI_Reduce_scatter(MPI_IN_PLACE, data, counts, MPI_FLOAT, MPI_SUM,
                                MPI_COMM_WORLD);
  if (code == MPI_SUCCESS && offsets[rank] != 0)
    std::memmove(data + offsets[rank], data, sizeof(float) * counts[rank]);
  return code;
}

int gatherFloats(const float *mine, float *all, const int *counts,
                 const int *offsets) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return MPI_Gatherv(mine, counts[rank], MPI_FLOAT, all, counts, offsets,
                     MPI_FLOAT, 0, MPI_COMM_WORLD);
}

void abortJob(int code) { MPI_Abort(MPI_COMM_WORLD, code); }

void finalize() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized)
    MPI_Finalize();
}

} // namespace

extern "C" int megaslideMpiOpen(int rank, int size, MegaSlideMpiApi *api,
                                char *host, int hostCapacity, char *error,
                                int errorCapacity) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    // Collectives are called from one thread at a time (the trainer's).
    int provided = 0;
    int code =
        MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    if (code != MPI_SUCCESS) {
      errorText(code, error, errorCapacity);
      return code;
    }
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int mpiRank = 0, mpiSize = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &mpiRank);
  MPI_Comm_size(MPI_COMM_WORLD, &mpiSize);
  if (mpiRank != rank || mpiSize != size) {
    std::snprintf(error, errorCapacity,
                  "MPI says rank %d of %d, the launcher's environment rank "
                  "%d of %d",
                  mpiRank, mpiSize, rank, size);
    return MPI_ERR_OTHER;
  }
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  MPI_Get_processor_name(name, &length);
  std::snprintf(host, hostCapacity, "%s", name);
  *api = {allReduceSum, allGatherLengths,  allGatherBytes,
          barrier,      allGatherElements, reduceScatterFloats,
          gatherFloats, finalize,          errorText,
          abortJob};
  return MPI_SUCCESS;
}
