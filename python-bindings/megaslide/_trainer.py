"""Training: execution plans, the recipe's options and the Trainer
(runtime/train/Session: the same runs as megaslide-run)."""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np

from . import _megaslide
from ._checks import (_check_path, _common_args, _read_plan_file,
                      _within_int64)
from ._cuda import backends
from ._plan import _options_payload


def exec_plan(
    model: str,
    frames: int,
    height: int,
    width: int,
    *,
    batch: int = 1,
    text_len: Optional[int] = None,
    latent: bool = False,
    lr: Optional[float] = None,
    weight_decay: Optional[float] = None,
    adam_beta1: Optional[float] = None,
    adam_beta2: Optional[float] = None,
    adam_eps: Optional[float] = None,
    weighted_loss: bool = False,
    **options: Any,
) -> str:
    """The execution plan of a training step as JSON text.

    This is what ``megaslide-run --save-plan`` writes (docs/ExecutionPlan.md).
    Options are those of :func:`plan`; ``lr`` overrides the config's
    learning rate, ``weight_decay`` is AdamW's decoupled weight decay
    (default 0, as ``--weight-decay``); ``adam_beta1``, ``adam_beta2`` and
    ``adam_eps`` are AdamW's (0.9, 0.999, 1e-8 by default, as
    ``--adam-beta1``, ``--adam-beta2``, ``--adam-eps``). ``weighted_loss``: the loss takes
    per-sample weights, as a run with a ``weighting_scheme`` needs (a
    :class:`Trainer` with one compiles so). Raises ValueError for bad
    input or a plan over budget.
    """
    args = _common_args(model, frames, height, width, batch, text_len, latent)
    # JSON cannot carry nan or inf to the C API, which checks the range
    # (plan/HyperParameters.h) with the same words.
    if lr is not None and (isinstance(lr, bool) or
                           not isinstance(lr, numbers.Real) or
                           not math.isfinite(lr) or not lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if weight_decay is not None and (
            isinstance(weight_decay, bool) or
            not isinstance(weight_decay, numbers.Real) or
            not math.isfinite(weight_decay) or weight_decay < 0):
        raise ValueError(f"weight_decay must be a non-negative number, got "
                         f"{weight_decay!r}")
    adam = {"adam_beta1": adam_beta1, "adam_beta2": adam_beta2,
            "adam_eps": adam_eps}
    for name, value in adam.items():
        # The C API checks the range, with the command line's words.
        if value is not None and (isinstance(value, bool) or
                                  not isinstance(value, numbers.Real) or
                                  not math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number, got "
                             f"{value!r}")
    if not isinstance(weighted_loss, bool):
        raise TypeError(f"weighted_loss must be a bool, got "
                        f"{weighted_loss!r}")
    payload = _options_payload(
        "exec_plan", options, lr=None if lr is None else float(lr),
        weight_decay=None if weight_decay is None else float(weight_decay),
        **{k: None if v is None else float(v) for k, v in adam.items()},
        weighted_loss=weighted_loss or None)
    return _megaslide.exec_plan_json(*args, payload)


#: The training recipe's keyword arguments (docs/Training.md) and their
#: types: megaslide-run's --lr-schedule, --warmup-steps, ... with '_' for '-'.
RECIPE_OPTIONS: Dict[str, type] = {
    "lr_schedule": str, "warmup_steps": int, "min_lr": float,
    "lr_decay_steps": int, "max_grad_norm": float, "grad_accum": int,
    "ema_decay": float, "ema_warmup": bool, "timestep_sampling": str,
    "logit_mean": float, "logit_std": float, "flow_shift": float,
    "min_timestep": float, "max_timestep": float, "boundary": float,
    "weighting_scheme": str,
}


#: Planning options the recipe follows too: the plan accounts their host
#: memory, the Trainer accumulates and keeps the EMA as they say.
_PLANNED_RECIPE_OPTIONS = ("grad_accum", "ema_dtype")


def _recipe_options(options: Dict[str, Any]) -> Dict[str, Any]:
    """Takes the recipe's keys out of ``options``, type checked; the
    planned ones (grad_accum, ema_dtype) stay for the plan as well."""
    recipe = {}
    if options.get("ema_decay") and "ema_dtype" not in options:
        options["ema_dtype"] = "f32"  # as megaslide-plan and -run do
    if "ema_dtype" in options:
        dtype = options["ema_dtype"]
        if dtype not in ("none", "f32", "bf16"):
            raise ValueError(f"ema_dtype must be none, f32 or bf16, got "
                             f"{dtype!r}")
        recipe["ema_bf16"] = dtype == "bf16"
    for name, kind in RECIPE_OPTIONS.items():
        if name not in options:
            continue
        value = (options.get if name in _PLANNED_RECIPE_OPTIONS
                 else options.pop)(name)
        if kind is float and isinstance(value, numbers.Real) and \
                not isinstance(value, bool):
            value = float(value)
        elif kind is int and isinstance(value, numbers.Integral) and \
                not isinstance(value, bool):
            value = _within_int64(name, int(value))
        elif not isinstance(value, kind) or \
                (kind is not bool and isinstance(value, bool)):
            raise TypeError(f"{name} must be a {kind.__name__}, got "
                            f"{value!r}")
        recipe[name] = value
    return recipe


def sample_sigmas(seed: int, step: int, count: int, *,
                  timestep_sampling: str = "uniform", logit_mean: float = 0.0,
                  logit_std: float = 1.0, flow_shift: float = 1.0,
                  min_timestep: float = 0.0,
                  max_timestep: float = 1.0) -> np.ndarray:
    """The flow-matching times a Trainer (and megaslide-run) with this seed
    and sampling uses at optimizer step ``step`` (0-based), ``count`` of
    them (micro-batch m, sample b at index m B + b): float32 in [0, 1]
    (in [min_timestep, max_timestep) with a range), a function of (seed,
    step) only (docs/Training.md, "Timesteps")."""
    recipe = _recipe_options(dict(timestep_sampling=timestep_sampling,
                                  logit_mean=logit_mean, logit_std=logit_std,
                                  flow_shift=flow_shift,
                                  min_timestep=min_timestep,
                                  max_timestep=max_timestep))
    for name, value in (("seed", seed), ("step", step), ("count", count)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got "
                             f"{value!r}")
    return _megaslide.sample_sigmas(_within_int64("seed", seed, 2**64 - 1),
                                    _within_int64("step", step),
                                    _within_int64("count", count), recipe)


def loss_weights(sigmas: np.ndarray, *, weighting_scheme: str = "none",
                 logit_mean: float = 0.0,
                 logit_std: float = 1.0) -> np.ndarray:
    """The loss weights a Trainer (and megaslide-run) with this
    weighting_scheme gives samples at the flow-matching times ``sigmas``:
    float32, the shape of ``sigmas`` (docs/Training.md, "Loss
    weighting")."""
    recipe = _recipe_options(dict(weighting_scheme=weighting_scheme,
                                  logit_mean=logit_mean, logit_std=logit_std))
    array = np.asarray(sigmas, dtype=np.float32)
    return _megaslide.loss_weights(array.ravel(), recipe).reshape(array.shape)


class Trainer:
    """A training run on the cpu, cuda or sim backend, numpy arrays in and out.

    Compiles the model's training step (or takes an execution plan:
    ``plan_json`` text, or ``plan_file``, e.g. what ``megaslide-run
    --save-plan`` or :meth:`save_plan` wrote) and, on cpu and cuda, keeps
    the host state: fp32 masters, AdamW moments and the optimizer step.

    ``backend``: ``cpu`` (reference numerics, everywhere), ``cuda`` (needs a
    GPU: :func:`backends` says whether this machine has one) or ``sim``
    (replays the schedule under the hardware model ``hw``, default H200:
    steps return the predicted time and no loss; it holds no model state,
    so parameters, gradients and weights raise ValueError). ``hw`` is a
    hardware JSON (docs/CostModel.md) used for planning and by sim.

    The training recipe (docs/Training.md) takes megaslide-run's flags as
    keywords (RECIPE_OPTIONS): lr_schedule, warmup_steps, min_lr,
    lr_decay_steps, max_grad_norm, grad_accum, ema_decay, ema_warmup,
    timestep_sampling, logit_mean, logit_std, flow_shift, min_timestep,
    max_timestep, boundary (Wan 2.2's two experts in one run),
    weighting_scheme; ``val_data`` is a folder of validation samples for
    :meth:`validation_loss`.

    A run's outputs are megaslide-run's (docs/Python.md, "Runs"), written by
    the same library (runtime/train/TrainingRun), so the files are the same
    bytes: ``checkpoint_dir`` (locked for the Trainer's life; checkpoints
    every ``checkpoint_every`` steps and at the end of :meth:`train`;
    :meth:`resume` continues its newest one, ``overwrite_checkpoints``
    starts afresh over an earlier run's), ``metrics`` (one JSON line per
    step), ``report`` (the HTML training report, rewritten at every
    checkpoint and by :meth:`close`), ``val_every`` (validation cadence,
    with ``val_data``) and ``max_nonfinite_steps``.

    Threads: calls on one Trainer are serialised (a lock per Trainer; the
    GIL is released while a step computes), so two threads stepping one
    Trainer take every step in turn, each whole. Ctrl-C during a step is
    honoured at the step boundary: the step runs to its end, then
    KeyboardInterrupt is raised with the step applied (``step_count`` says
    so); a pending Ctrl-C raises before a step starts, with nothing
    applied. A step is never left half done (docs/Python.md).

    >>> tr = Trainer("tiny", frames=17, height=128, width=128, precision="f32")
    >>> loss, grads = tr.gradients(**batch)   # no update
    >>> tr.step()["loss"]                     # one step on synthetic data
    >>> Trainer("megaslide-105b", 81, 720, 1280, backend="sim").step(
    ...     trace="105b.json")["seconds"]     # predicted step, Perfetto trace
    >>> with Trainer("tiny", checkpoint_dir="ck", metrics="m.jsonl") as tr:
    ...     tr.resume()                       # where an earlier run stopped
    ...     tr.train(100)                     # as megaslide-run --steps 100
    """

    def __init__(self, model: Optional[str] = None, frames: int = 17,
                 height: int = 128, width: int = 128, *, backend: str = "cpu",
                 seed: int = 0, plan_json: Optional[str] = None,
                 plan_file: Optional[Union[str, os.PathLike]] = None,
                 hw: Optional[Union[str, os.PathLike]] = None,
                 val_data: Optional[Union[str, os.PathLike]] = None,
                 checkpoint_dir: Optional[Union[str, os.PathLike]] = None,
                 checkpoint_every: int = 0,
                 overwrite_checkpoints: bool = False,
                 metrics: Optional[Union[str, os.PathLike]] = None,
                 report: Optional[Union[str, os.PathLike]] = None,
                 val_every: int = 0, max_nonfinite_steps: int = 3,
                 **plan_options: Any) -> None:
        recipe = _recipe_options(plan_options)
        # A bad recipe value is refused before a plan is compiled for it.
        _megaslide.loss_weights(np.zeros(0, np.float32), recipe)
        val = "" if val_data is None else _check_path("val_data", val_data)
        run: Dict[str, Any] = {}
        for name, path in (("checkpoint_dir", checkpoint_dir),
                           ("metrics", metrics), ("report", report)):
            if path is not None:
                run[name] = _check_path(name, path)
        for name, value, low in (("checkpoint_every", checkpoint_every, 0),
                                 ("val_every", val_every, 0),
                                 ("max_nonfinite_steps", max_nonfinite_steps,
                                  1)):
            if isinstance(value, bool) or not isinstance(value, int) or \
                    value < low:
                raise ValueError(f"{name} must be an int >= {low}, got "
                                 f"{value!r}")
            run[name] = _within_int64(name, value)
        if not isinstance(overwrite_checkpoints, bool):
            raise TypeError(f"overwrite_checkpoints must be a bool, got "
                            f"{overwrite_checkpoints!r}")
        run["overwrite_checkpoints"] = overwrite_checkpoints
        if checkpoint_dir is None and (checkpoint_every or
                                       overwrite_checkpoints):
            raise ValueError("checkpoint_every and overwrite_checkpoints "
                             "need checkpoint_dir")
        if backend not in ("cpu", "cuda", "sim"):
            raise ValueError(f"backend must be cpu, cuda or sim, got "
                             f"{backend!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        _within_int64("seed", seed, high=2**64 - 1)
        if plan_json is not None and plan_file is not None:
            raise ValueError("give plan_json or plan_file, not both")
        if plan_json is not None or plan_file is not None:
            # A given plan was accounted when it was compiled; the recipe
            # still follows these.
            for name in _PLANNED_RECIPE_OPTIONS:
                plan_options.pop(name, None)
        if plan_options and (plan_json is not None or plan_file is not None):
            raise TypeError(f"plan options ({', '.join(sorted(plan_options))})"
                            f" only apply when compiling a model, not to a "
                            f"given plan")
        if backend == "cuda":
            # Say why before compiling a plan that cannot run here.
            status = backends()["cuda"]
            if not status.available:
                raise RuntimeError(f"backend 'cuda' is not available: "
                                   f"{status.reason}")
        hardware = "" if hw is None else _check_path("hw", hw)
        if plan_file is not None:
            path = _check_path("plan_file", plan_file)
            plan_json = _read_plan_file(path)
            source = path
        elif plan_json is None:
            if model is None:
                raise ValueError("give a model, plan_json or plan_file")
            if hw is not None:
                plan_options["hw"] = hardware
            plan_json = exec_plan(
                model, frames, height, width,
                weighted_loss=recipe.get("weighting_scheme", "none") != "none",
                **plan_options)
            source = f"<{model}>"
        else:
            source = "<plan_json>"
        if not isinstance(plan_json, str):
            raise TypeError(f"plan_json must be a str, got "
                            f"{type(plan_json).__name__}")
        self._native = _megaslide.Trainer(plan_json, source, backend, seed,
                                          hardware, recipe, val, run)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def train(self, steps: int) -> Dict[str, Any]:
        """``steps`` optimizer steps as ``megaslide-run --steps`` takes them:
        each logged to ``metrics``, validated every ``val_every`` steps and
        checkpointed every ``checkpoint_every``, the last one validated and
        checkpointed; ``max_nonfinite_steps`` skipped steps in a row end the
        run. A failing step raises ValueError after saving the state where
        it could (the message says so). Ctrl-C stops at the next step
        boundary, saves a checkpoint and raises KeyboardInterrupt.

        Returns this call's figures: steps (taken), step (the run's count
        after them), skipped, first_loss, last_loss (of its steps not
        skipped; None on sim) and seconds (the steps' own time).
        :meth:`step` takes steps one by one, logged and checkpointed alike,
        but raises for non-finite losses only under streaming updates (it
        returns ``skipped``), not for ``max_nonfinite_steps``."""
        if isinstance(steps, bool) or not isinstance(steps, int) or \
                steps < 0:
            raise ValueError(f"steps must be a non-negative int, got "
                             f"{steps!r}")
        return self._native.train(_within_int64("steps", steps))

    def resume(self) -> int:
        """Continues the newest complete checkpoint in ``checkpoint_dir``, as
        ``megaslide-run --resume`` does: its settings (seed, data, model,
        recipe, plan) must be this Trainer's (ValueError naming each one
        that differs; ``lr_decay_steps`` may move the horizon), the state
        and the data position are restored and the metrics log keeps the
        lines of the steps it holds. Call it before the first step. Returns
        the step resumed at."""
        return self._native.resume()

    def checkpoint(self) -> None:
        """Saves a checkpoint of the current step into ``checkpoint_dir`` now
        (nothing when one of this step is saved already)."""
        self._native.checkpoint()

    def close(self) -> None:
        """Ends the run: writes the report and releases ``checkpoint_dir``.
        Steps raise ValueError after it; the state stays readable. A
        ``with`` block calls it."""
        self._native.close()

    @property
    def backend(self) -> str:
        """The backend's name: cpu, cuda or sim."""
        return self._native.backend

    @property
    def computes_loss(self) -> bool:
        """Whether steps compute the loss and hold model state (not sim)."""
        return self._native.computes_loss

    def plan_json(self) -> str:
        """The execution plan being run, as JSON text (docs/ExecutionPlan.md)."""
        return self._native.plan_json()

    def save_plan(self, path: Union[str, os.PathLike]) -> None:
        """Writes the execution plan to ``path`` (``Trainer(plan_file=path)``
        and ``megaslide-run --plan`` read it). Raises ValueError naming the
        file when it cannot be written."""
        self._native.save_plan(_check_path("path", path))

    def load_weights(self, path: Union[str, os.PathLike]) -> None:
        """Loads model weights into the fp32 masters, as ``megaslide-run
        --weights`` does: a diffusers transformer directory (config.json and
        diffusion_pytorch_model.safetensors, or shards with their index) or
        one .safetensors file; F32, BF16 and F16 are read (docs/Runtime.md).

        Names and shapes are checked against the plan before anything is
        read: missing, unexpected and misshapen tensors are listed together
        in one ValueError and nothing is loaded. AdamW moments are not
        touched. Raises ValueError on the sim backend."""
        self._native.load_weights(_check_path("path", path))

    def save_weights(self, directory: Union[str, os.PathLike], *,
                     dtype: str = "f32",
                     max_shard_bytes: int = 5_000_000_000,
                     ema: bool = False) -> None:
        """Writes the model weights as a diffusers transformer directory
        (created if needed): config.json (the plan's model config) and
        diffusion_pytorch_model.safetensors, or shards of at most
        ``max_shard_bytes`` with an index, as ``megaslide-run
        --save-weights`` does. ``dtype``: "f32" or "bf16" (rounded to
        nearest even). Files are replaced atomically; weight files of an
        earlier save that this one does not produce are removed. ``ema``:
        write the EMA of the weights instead (``megaslide-run --save-ema``;
        ValueError without ``ema_decay``). Raises ValueError for a bad
        dtype or shard size, an unwritable directory, or the sim backend."""
        if not isinstance(ema, bool):
            raise TypeError(f"ema must be a bool, got {ema!r}")
        if (isinstance(max_shard_bytes, bool) or
                not isinstance(max_shard_bytes, numbers.Integral) or
                max_shard_bytes <= 0):
            raise ValueError(f"max_shard_bytes must be a positive int, got "
                             f"{max_shard_bytes!r}")
        self._native.save_weights(
            _check_path("directory", directory), dtype,
            _within_int64("max_shard_bytes", max_shard_bytes), ema)

    def input_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Shapes of the step inputs: latents, noise, timesteps, condition,
        and an image-conditioned model's image_embeds [B, L, image_dim] and
        image_condition [B, mask and latent channels, T, H, W]."""
        return self._native.input_shapes()

    def parameters(self) -> Dict[str, np.ndarray]:
        """Copies of the fp32 masters (and frozen buffers) by diffusers name."""
        return self._native.parameters()

    def load_parameters(self, params: Dict[str, np.ndarray]) -> None:
        """Replaces the named masters; shapes must match the plan's."""
        self._native.load_parameters(params)

    def gradients(self, latents: np.ndarray, noise: np.ndarray,
                  timesteps: np.ndarray, condition: np.ndarray,
                  **image: np.ndarray
                  ) -> Tuple[float, Dict[str, np.ndarray]]:
        """Loss and every trainable parameter's gradient on one batch.

        The state is not updated. Arrays are checked as for :meth:`step`;
        an image-conditioned model (Wan I2V, FLF2V) also takes
        ``image_embeds`` and ``image_condition`` (input_shapes()). With a
        ``weighting_scheme`` the loss and gradients are those of the loss
        weighted by the timesteps (:func:`loss_weights`).
        """
        return self._native.gradients(dict(latents=latents, noise=noise,
                                           timesteps=timesteps,
                                           condition=condition, **image))

    def predict(self, latents: np.ndarray, noise: np.ndarray,
                timesteps: np.ndarray, condition: np.ndarray,
                **image: np.ndarray) -> np.ndarray:
        """The model's velocity prediction at x_t = (1 - t) x0 + t noise
        (x0 the latents; model timestep 1000 t), float32 [B, C, T, H, W]:
        the forward of one step, read where the loss takes it.

        The state is not updated (as :meth:`gradients`: the step runs
        without its update, so it costs a forward and a backward).
        Arrays are checked as for :meth:`step`;
        ``timesteps`` is required, and an image-conditioned model's
        ``image_embeds`` and ``image_condition`` too. The cpu backend only
        (ValueError on cuda and sim). The tests compare it with diffusers'
        WanTransformer3DModel on the same weights (docs/Dsa3d.md,
        "Sampling with diffusers").
        """
        return self._native.predict(dict(latents=latents, noise=noise,
                                         timesteps=timesteps,
                                         condition=condition, **image))

    def step(self, *, trace: Optional[Union[str, os.PathLike]] = None,
             **inputs: np.ndarray) -> Dict[str, Any]:
        """One optimizer step of the recipe (docs/Training.md).

        Without arrays it draws the next ``grad_accum`` batches; otherwise
        give latents, noise, condition (an image-conditioned model's
        image_embeds and image_condition too) and optionally timesteps, each a
        numpy array of the shape input_shapes() gives with its first
        dimension times ``grad_accum`` (the micro-batches in order), of
        dtype float32 (an integer dtype for DiT's class-label condition):
        nothing is cast, so float64, int64 or a list raise TypeError, and so
        does an unknown keyword. ``timesteps`` must lie in [0, 1], the
        flow-matching time t of x_t = (1 - t) x0 + t noise (ValueError
        otherwise, NaN included); left out, they are the recipe's
        (:func:`sample_sigmas` of this seed and step_count).

        Returns loss (the mean over micro-batches; None on sim),
        unweighted_loss (with a ``weighting_scheme``, the loss without the
        weights, also such a mean; else None), grad_norm
        (the global L2 norm of the averaged gradient before clipping; None
        on sim), lr (the step's), clipped, skipped, micro_batches, seconds
        (measured; on sim the predicted step time), step and the planned
        and measured device peaks (planned_peak_bytes, measured_peak_bytes,
        planned_live_bytes, measured_live_bytes), and val_loss where the
        step validated (``val_every``), else None; with ``boundary``,
        expert ("high" or "low": the one that stepped). The step is logged to
        ``metrics`` and checkpointed on ``checkpoint_every`` as in
        :meth:`train`.

        ``skipped``: the loss, or with the deferred update any gradient, was
        NaN or infinite, so no update was applied and the state
        (parameters, moments, EMA, step_count) is bitwise as before. With
        the streaming update a non-finite gradient with a finite loss
        raises ValueError naming the parameter: earlier parameters of that
        step may already be updated, so the Trainer refuses further steps
        (docs/Runtime.md, "Non-finite values").

        ``trace``: also write the step as Chrome trace-event JSON to this
        path (open it in Perfetto): one track per stream, one event per
        instruction with its layer, bytes and FLOPs, measured on cpu and
        cuda and predicted on sim — the format of ``megaslide-run --trace``.
        """
        path = "" if trace is None else _check_path("trace", trace)
        return self._native.step(inputs if inputs else None, path)

    def optimizer_state(self) -> Dict[str, Dict[str, np.ndarray]]:
        """Copies of the AdamW moments: {name: {"exp_avg", "exp_avg_sq"}}."""
        return self._native.optimizer_state()

    def validation_loss(self) -> float:
        """The mean loss over ``val_data``'s samples, each with the noise
        and time drawn for it once (the same at every call); updates
        nothing and draws no training data (docs/Training.md)."""
        return self._native.validation_loss()

    def ema_parameters(self) -> Dict[str, np.ndarray]:
        """Copies of the EMA of the trainable weights (ValueError without
        ``ema_decay``)."""
        return self._native.ema_parameters()

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far."""
        return self._native.step_count
