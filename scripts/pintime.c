/* pintime: times the cuda backend's pinning from outside it.

   A shared library that the runtime opens in place of the CUDA driver
   (MEGASLIDE_CUDA_DRIVER_LIBRARY=libmegaslide-pintime.so). It needs
   libcuda.so.1, so every driver symbol it does not define resolves there
   (dlsym on a handle searches the library, then what it needs); it defines
   the calls that pin host memory, forwards them to the driver and prints
   one line per call on stderr:

     pintime: cuMemHostAlloc 1073741824 bytes in 0.251234 s (CUresult 0)

   scripts/device-check.sh adds these up per run. Built by
   scripts/device-bundle.sh:
     cc -shared -fPIC -O2 -o libmegaslide-pintime.so pintime.c -ldl \
        -Wl,--no-as-needed LIBCUDA
   where LIBCUDA is any library whose soname is libcuda.so.1 (the
   toolkit's stub, or an empty one). */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <time.h>

typedef int CUresult;
enum { kErrorUnknown = 999 }; /* CUDA_ERROR_UNKNOWN */

/* The driver's own definition of `name`: the handle of libcuda.so.1 (loaded
   already, as this library's dependency) finds it before this library's. */
static void *driver(const char *name) {
  static void *lib;
  if (!lib)
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  return lib ? dlsym(lib, name) : NULL;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void report(const char *call, size_t bytes, double start, CUresult r) {
  fprintf(stderr, "pintime: %s %zu bytes in %.6f s (CUresult %d)\n", call,
          bytes, now() - start, r);
}

CUresult cuMemHostAlloc(void **p, size_t bytes, unsigned flags) {
  CUresult (*fn)(void **, size_t, unsigned) = driver("cuMemHostAlloc");
  if (!fn)
    return kErrorUnknown;
  double start = now();
  CUresult r = fn(p, bytes, flags);
  report("cuMemHostAlloc", bytes, start, r);
  return r;
}

static CUresult hostRegister(const char *name, void *p, size_t bytes,
                             unsigned flags) {
  CUresult (*fn)(void *, size_t, unsigned) = driver(name);
  if (!fn)
    return kErrorUnknown;
  double start = now();
  CUresult r = fn(p, bytes, flags);
  report(name, bytes, start, r);
  return r;
}

CUresult cuMemHostRegister(void *p, size_t bytes, unsigned flags) {
  return hostRegister("cuMemHostRegister", p, bytes, flags);
}

CUresult cuMemHostRegister_v2(void *p, size_t bytes, unsigned flags) {
  return hostRegister("cuMemHostRegister_v2", p, bytes, flags);
}
