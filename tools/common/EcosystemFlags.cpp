//===- EcosystemFlags.cpp - Other trainers' flags, answered ---------------===//

#include "megaslide/Tools/EcosystemFlags.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/WithColor.h"

#include <algorithm>

using namespace llvm;
using namespace megaslide;

namespace {
constexpr const char *kLoRA = "LoRA is not supported: MegaSlide does full "
                              "fine-tuning";
constexpr const char *kEncoders = "MegaSlide trains on pre-encoded latents "
                                  "and text embeddings (--data)";
constexpr const char *kDistributed = "one process per GPU is not supported "
                                     "yet; a run uses one GPU";

// Every `flag` is an option of megaslide-run (test/python/test_run.py holds
// the table to that and to docs/Training.md).
const tools::EcosystemFlag kTable[] = {
    // diffusers' training scripts (train_text_to_image, dreambooth,
    // cogvideox, wan).
    {"pretrained-model-name-or-path", "diffusers", "weights",
     "the transformer folder; --model names its architecture"},
    {"learning-rate", "diffusers", "lr", ""},
    {"train-batch-size", "diffusers", "batch", ""},
    {"gradient-accumulation-steps", "diffusers", "grad-accum", ""},
    {"gradient-checkpointing", "diffusers, musubi-tuner", "activation-policy",
     "recompute"},
    {"max-train-steps", "diffusers, musubi-tuner", "steps", ""},
    {"num-train-epochs", "diffusers", "",
     "epochs are not counted: give --steps"},
    {"max-train-epochs", "musubi-tuner", "",
     "epochs are not counted: give --steps"},
    {"mixed-precision", "diffusers, accelerate, musubi-tuner", "precision",
     "bf16 or f32"},
    {"output-dir", "diffusers, musubi-tuner", "save-weights",
     "the trained weights; checkpoints go to --checkpoint-dir"},
    {"lr-scheduler", "diffusers, musubi-tuner", "lr-schedule", ""},
    {"lr-warmup-steps", "diffusers, musubi-tuner", "warmup-steps", ""},
    {"use-ema", "diffusers", "ema-decay", "a decay, e.g. 0.9999"},
    {"checkpointing-steps", "diffusers", "checkpoint-every", ""},
    {"save-every-n-steps", "musubi-tuner", "checkpoint-every", ""},
    {"resume-from-checkpoint", "diffusers", "resume",
     "continues the latest checkpoint in --checkpoint-dir"},
    {"train-data-dir", "diffusers", "data", ""},
    {"instance-data-dir", "diffusers", "data", ""},
    {"dataset-name", "diffusers", "data", ""},
    {"dataset-config", "musubi-tuner", "data", ""},
    {"adam-weight-decay", "diffusers", "weight-decay", ""},
    {"adam-epsilon", "diffusers", "adam-eps", ""},
    {"validation-steps", "diffusers", "val-every", "with --val-data"},
    {"report-to", "diffusers", "metrics",
     "one JSON line per step; --report draws an HTML page"},
    {"log-with", "musubi-tuner", "metrics",
     "one JSON line per step; --report draws an HTML page"},
    // diffusers' --weighting_scheme picks the sampling too: its
    // logit_normal samples, MegaSlide's --weighting-scheme logit-normal
    // weighs.
    {"weighting-scheme", "diffusers", "weighting-scheme",
     "sigma_sqrt or cosmap (diffusers' logit_normal is --timestep-sampling "
     "logit-normal)"},
    {"discrete-flow-shift", "musubi-tuner", "flow-shift", ""},
    {"resolution", "diffusers", "height", "and --width"},
    {"num-frames", "diffusers", "frames", ""},
    {"enable-xformers-memory-efficient-attention", "diffusers", "attention",
     ""},
    {"sdpa", "musubi-tuner", "attention", ""},
    {"flash-attn", "musubi-tuner", "attention", ""},
    {"use-8bit-adam", "diffusers", "host-state-policy",
     "int8-moments (block-wise 8-bit AdamW moments, as bitsandbytes')"},
    {"optimizer-type", "musubi-tuner", "",
     "the optimizer is AdamW (--host-state-policy int8-moments or "
     "factored-moments for 8-bit or factored moments)"},
    {"rank", "diffusers", "", kLoRA},
    {"lora-rank", "diffusers", "", kLoRA},
    {"network-module", "musubi-tuner", "", kLoRA},
    {"network-dim", "musubi-tuner", "", kLoRA},
    {"network-alpha", "musubi-tuner", "", kLoRA},
    {"vae", "musubi-tuner", "", kEncoders},
    {"t5", "musubi-tuner", "", kEncoders},
    {"text-encoder", "musubi-tuner", "", kEncoders},
    {"dit", "musubi-tuner", "weights",
     "the transformer folder or .safetensors file"},
    {"blocks-to-swap", "musubi-tuner", "",
     "the planner chooses what stays on the host (megaslide-plan shows it)"},
    {"fp8-base", "musubi-tuner", "", "weights are bf16 or f32 (--precision)"},
    {"dataloader-num-workers", "diffusers", "", "the run reads --data itself"},
    {"max-data-loader-n-workers", "musubi-tuner", "",
     "the run reads --data itself"},
    // accelerate launch.
    {"num-processes", "accelerate", "", kDistributed},
    {"num-machines", "accelerate", "", kDistributed},
    {"multi-gpu", "accelerate", "", kDistributed},
};

/// "--learning_rate" and "-Learning-Rate=3" both read "learning-rate".
std::string normalized(StringRef name) {
  std::string n = name.split('=').first.lower();
  std::replace(n.begin(), n.end(), '_', '-');
  return n;
}
} // namespace

ArrayRef<tools::EcosystemFlag> tools::ecosystemFlags() { return kTable; }

void tools::printEcosystemFlags(raw_ostream &os) {
  os << "| flag | of | MegaSlide |\n| --- | --- | --- |\n";
  for (const EcosystemFlag &f : kTable) {
    os << "| `--" << f.name << "` | " << f.origin << " | ";
    if (*f.flag)
      os << "`--" << f.flag << "`" << (*f.advice ? " " : "");
    else
      os << "not supported: ";
    os << f.advice << " |\n";
  }
}

bool tools::checkEcosystemFlags(int argc, char **argv, StringRef tool,
                                ArrayRef<StringRef> destructive) {
  auto &options = cl::getRegisteredOptions();
  bool unknown = false;
  for (int i = 1; i < argc; ++i) {
    StringRef arg = argv[i];
    if (arg == "--")
      break;
    if (!arg.starts_with("-") || arg == "-")
      continue;
    auto [name, value] = arg.ltrim('-').split('=');
    if (auto it = options.find(name); it != options.end()) {
      // Its value may be the next argument, which may start with '-'.
      if (!arg.contains('=') &&
          it->second->getValueExpectedFlag() == cl::ValueRequired)
        ++i;
      continue;
    }
    std::string key = normalized(name);
    const EcosystemFlag *hit = nullptr;
    for (const EcosystemFlag &f : kTable)
      if (key == f.name)
        hit = &f;
    if (!hit) {
      // The same name with '-' for '_' (--max_grad_norm) is an answer by
      // meaning, unless it deletes something.
      if (key != name && options.count(key) &&
          !is_contained(destructive, key)) {
        WithColor::error(errs(), tool)
            << "unknown flag '" << arg << "'; MegaSlide spells it --" << key
            << "\n";
        return false;
      }
      unknown = true;
      continue;
    }
    raw_ostream &error = WithColor::error(errs(), tool);
    error << "'" << arg.split('=').first << "' is a flag of " << hit->origin
          << "; ";
    if (!*hit->flag) {
      error << "not supported: " << hit->advice << "\n";
      return false;
    }
    error << "MegaSlide's equivalent is --" << hit->flag
          << (*hit->advice ? " " : "") << hit->advice;
    if (!options.count(hit->flag))
      error << " (a flag of megaslide-run, not of " << tool << ")";
    error << "\n";
    return false;
  }
  // LLVM answers the unknown flag; by spelling alone it must not point at
  // a flag that deletes work.
  if (unknown)
    for (StringRef name : destructive)
      if (auto it = options.find(name); it != options.end())
        it->second->setHiddenFlag(cl::ReallyHidden);
  return true;
}
