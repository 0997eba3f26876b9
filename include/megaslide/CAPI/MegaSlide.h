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

/// The keys of the plan options: sets `*json` to a JSON list of
/// {"key", "name" (the pipeline option), "type" ("str", "int", "bool" or
/// "triple": three ints), "help", "default", and for enums "choices"}, the
/// planning options of include/megaslide/Pipelines/PipelineOptions.def that
/// have a flag, then `hw` (path) and `precision`. Returns 0.
int megaslidePlanOptionsJson(char **json);

/// Plans a training step, as `megaslide-plan --format json` does.
/// `options_json` is a JSON object with any of the keys of
/// megaslidePlanOptionsJson (e.g. gpu_mem, activation_policy, dsa_window,
/// hw, precision). Returns 0 with `*json` set
/// (whether or not the plan fits: see its "fits" field), or 1 with
/// `*error` set for bad input.
int megaslidePlanJson(const char *model, int64_t frames, int64_t height,
                      int64_t width, int latent_units, int64_t batch,
                      int64_t text_len, const char *options_json, char **json,
                      char **error);

/// Compiles a training step into an execution plan (docs/ExecutionPlan.md),
/// as megaslide-run does: `options_json` takes the plan options above plus
/// `lr`, `weight_decay` and `weighted_loss` (a bool: the loss takes
/// per-sample weights). Returns 0 with `*json` set to the plan, 1 with
/// `*error` set for bad input, 3 with `*error` set when the plan does not
/// fit its budgets.
int megaslideExecPlanJson(const char *model, int64_t frames, int64_t height,
                          int64_t width, int latent_units, int64_t batch,
                          int64_t text_len, const char *options_json,
                          char **json, char **error);

/// Builds the training-step module of a model at a video size, before any
/// planning pass (what `megaslide-plan --emit-mlir` writes). `precision`
/// is "bf16", "f32" or NULL/"" for the default (bf16). Returns 0 with `*ir`
/// set to the module's text, or 1 with `*error` set for bad input.
int megaslideBuildModule(const char *model, int64_t frames, int64_t height,
                         int64_t width, int latent_units, int64_t batch,
                         int64_t text_len, const char *precision, char **ir,
                         char **error);

/// Parses MLIR text with every MegaSlide dialect registered and verifies
/// it. `source_name` names the buffer in diagnostics (NULL: "<string>").
/// Returns 0 with `*printed` set to the module as megaslide-opt prints it,
/// or 1 with `*error` set to the diagnostics, one per line as
/// "<source>:<line>:<col>: error: <message>", each note on a further line
/// indented by two spaces.
int megaslideParseModule(const char *ir, const char *source_name,
                         char **printed, char **error);

/// Runs a textual pass pipeline on MLIR text, as `megaslide-opt
/// --pass-pipeline=PIPELINE` does: every pass and named pipeline of
/// megaslide-opt is registered (megaslide-pipeline and its phases with
/// their options, each megaslide-* pass, the upstream transforms such as
/// canonicalize and cse). `pipeline` is anchored on the module, e.g.
/// "builtin.module(megaslide-pipeline{gpu-mem=24GB})". Returns 0 with
/// `*json` set to {"ir": text, "remarks": [...], "warnings": [...]}
/// (diagnostics formatted as megaslideParseModule's); 1 with `*error` set
/// for unparsable IR or an invalid pipeline (unknown pass or option, bad
/// option value: the message names it); 2 with `*error` set to the
/// diagnostics when a pass fails (e.g. a budget the plan exceeds), and
/// `*json` set as on success but with the IR as it was when the pipeline
/// stopped.
int megaslideRunPipeline(const char *ir, const char *source_name,
                         const char *pipeline, char **json, char **error);

/// The CUDA C++ of the 3D-DSA kernels of a module, as `megaslide-translate
/// --emit-dsa-kernels` emits them: one source per distinct configuration.
/// Returns 0 with `*json` set to {"kernels": [{"name", "description",
/// "source", "manifest"}]} (the manifest as in an execution plan's
/// kernel_modules: launch shapes per kernel), an empty list for a module
/// without 3D-DSA ops; 1 with `*error` set to the diagnostics for
/// unparsable IR or an unsupported configuration (reported on its op).
int megaslideEmitDsaKernelsJson(const char *ir, const char *source_name,
                                char **json, char **error);

/// Plans a training step as megaslidePlanJson does and also returns its
/// device buffers. `*json` is {"report": <megaslidePlanJson's object>,
/// "num_steps": N, "device_buffers": [{"what", "category", "layer"
/// (null outside blocks), "offset" (arena bytes; -1 when the plan stopped
/// before memory was packed), "bytes", "start", "end"}]}, where start and
/// end are the first and last program-order steps (ops of the planned
/// @train_step) at which the buffer is live. Errors as megaslidePlanJson.
int megaslideMemoryPlanJson(const char *model, int64_t frames, int64_t height,
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
