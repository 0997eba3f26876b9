/*===- MegaSlide.h - C API of the MegaSlide compiler --------------*- C -*-===*\
|*                                                                            *|
|* Plain C entry points over the compiler, for the Python module and other   *|
|* foreign callers. Results are JSON strings; nothing here exposes MLIR.     *|
|*                                                                            *|
\*===----------------------------------------------------------------------===*/

#ifndef MEGASLIDE_CAPI_MEGASLIDE_H
#define MEGASLIDE_CAPI_MEGASLIDE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/// Describes a model at a video size, as `megaslide-plan --format json`
/// does. `text_len` 0 means the config's value. On success returns 0 and
/// sets `*json`; on bad input returns 1 and sets `*error` to a one-line
/// message. Free either string with megaslideFreeString.
int megaslideModelInfoJson(const char *model, int64_t frames, int64_t height,
                           int64_t width, int latent_units, int64_t batch,
                           int64_t text_len, char **json, char **error);

/// Plans a training step, as `megaslide-plan --format json` does.
/// `options_json` is a JSON object with any of: gpu_mem, gpu_reserve, host_mem,
/// os_allowance, hw (path), activation_policy, host_state_policy,
/// attention, precision, buffers, prefetch_distance, dsa_window, dsa_tile,
/// dsa_radius. Returns 0 with `*json` set
/// (whether or not the plan fits: see its "fits" field), or 1 with
/// `*error` set for bad input.
int megaslidePlanJson(const char *model, int64_t frames, int64_t height,
                      int64_t width, int latent_units, int64_t batch,
                      int64_t text_len, const char *options_json, char **json,
                      char **error);

/// Compiles a training step into an execution plan (docs/ExecutionPlan.md),
/// as megaslide-run does: `options_json` takes the plan options above plus
/// `lr` and `weight_decay`. Returns 0 with `*json` set to the plan, 1 with
/// `*error` set for bad input, 3 with `*error` set when the plan does not
/// fit its budgets.
int megaslideExecPlanJson(const char *model, int64_t frames, int64_t height,
                          int64_t width, int latent_units, int64_t batch,
                          int64_t text_len, const char *options_json,
                          char **json, char **error);

/// Frees a string returned by this API.
void megaslideFreeString(char *str);

/// The MegaSlide version ("MAJOR.MINOR.PATCH"); static storage.
const char *megaslideVersion(void);

#ifdef __cplusplus
}
#endif

#endif /* MEGASLIDE_CAPI_MEGASLIDE_H */
