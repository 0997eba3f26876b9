"""3D-DSA for sampling with diffusers' Wan 2.1 transformer.

A model fine-tuned with 3D Deformable Slide Attention (docs/Dsa3d.md) was
trained with that attention in its self-attention layers; stock diffusers
samples it with global attention instead. :func:`enable_dsa` switches a
loaded ``WanPipeline`` or ``WanImageToVideoPipeline`` (or a
``WanTransformer3DModel``) to :class:`Dsa3dAttnProcessor`, which runs those
self-attentions as 3D-DSA with the run's window, tile and radius, read from
the ``_megaslide`` key that ``megaslide-run --save-weights`` /
``Trainer.save_weights`` write into ``config.json`` (docs/Runtime.md,
"Weights").

The processor mirrors diffusers 0.42.1's ``WanAttnProcessor`` (q/k/v
projections, RMSNorm across heads, RoPE as diffusers applies it, the output
projection) and replaces only the attention proper; cross-attention (with
an image-conditioned model's image keys and values, ``add_k_proj``) keeps
diffusers' processor, as training keeps it global. As in training
(``rewrite-attention-to-dsa``) the offsets are estimated at every call by
block matching on the queries and keys after norm and RoPE. Backends:

* ``"flex"``: offsets by :func:`dsa3d_offsets_torch` (float64, on the
  tensors' device) and torch's FlexAttention with a block mask built from
  them; compiled on CUDA, eager elsewhere (eager FlexAttention computes
  every query-key score: for small grids only);
* ``"megaslide"``: :func:`megaslide.dsa3d_offsets` and :func:`megaslide.dsa3d`,
  MegaSlide's own CPU kernels (float32 numpy; no autograd);
* ``"auto"``: flex on CUDA tensors, megaslide otherwise.

``test/python/test_diffusers_dsa.py`` checks that the transformer's output
equals ``megaslide.Trainer.predict`` on the same weights and inputs.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["Dsa3dAttnProcessor", "Dsa3dSettings", "enable_dsa", "disable_dsa",
           "dsa3d_offsets_torch", "dsa3d_block_mask", "run_config",
           "save_video"]

#: The config.json key megaslide writes (host::kRunConfigKey).
RUN_CONFIG_KEY = "_megaslide"
_BACKENDS = ("auto", "flex", "megaslide")


class Dsa3dSettings:
    """The 3D-DSA of one run: ``window`` and ``tile`` (t, y, x) in tokens and
    the block-matching ``radius``; ``layers`` the blocks whose
    self-attention runs as 3D-DSA (None: all)."""

    def __init__(self, window: Sequence[int], tile: Sequence[int],
                 radius: int, layers: Optional[Sequence[int]] = None) -> None:
        self.window = _triple("window", window)
        self.tile = _triple("tile", tile)
        if isinstance(radius, bool) or not isinstance(radius, int) or \
                radius < 0:
            raise ValueError(f"radius must be a non-negative int, got "
                             f"{radius!r}")
        self.radius = radius
        self.layers = None if layers is None else tuple(int(i) for i in layers)

    def uses_dsa(self, grid: Sequence[int]) -> bool:
        """The planner's rule (rewrite-attention-to-dsa): a token grid
        smaller than the window along any axis keeps global attention."""
        return all(w <= g for w, g in zip(self.window, grid))

    def __repr__(self) -> str:
        return (f"Dsa3dSettings(window={self.window}, tile={self.tile}, "
                f"radius={self.radius}, layers={self.layers})")


def _triple(name: str, value: Sequence[int]) -> Tuple[int, int, int]:
    try:
        t = tuple(value)
    except TypeError:
        t = ()
    if len(t) != 3 or any(isinstance(v, bool) or not isinstance(v, int)
                          or v <= 0 for v in t):
        raise ValueError(f"{name} must be three positive ints (t, y, x), got "
                         f"{value!r}")
    return t  # type: ignore[return-value]


# ---------------------------------------------------------------------------
# Block matching in torch (docs/Dsa3d.md, "Definition")
# ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _layout(grid: Tuple[int, int, int], window: Tuple[int, int, int],
            tile: Tuple[int, int, int], radius: int):
    """Per query tile (row-major over the tile grid): its first key frame,
    the clamped window starts of every candidate displacement (in tie-break
    order: smallest |dy| + |dx|, then dy, then dx) and its token count."""
    (T, Y, X), (kt, ky, kx), (tt, ty, tx) = grid, window, tile
    # The kernel caps the search at the grid: a larger displacement clamps
    # to a window a smaller one reaches first in tie-break order.
    r = min(radius, max(Y, X))
    d = range(-r, r + 1)
    cands = sorted(((dy, dx) for dy in d for dx in d),
                   key=lambda c: (abs(c[0]) + abs(c[1]), c[0], c[1]))

    def centre(first, size, extent):
        return (first + min(first + size, extent) - 1) // 2

    def clamp(v, hi):
        return min(max(v, 0), hi)

    st, sy, sx, size = [], [], [], []
    for t0 in range(0, T, tt):
        for y0 in range(0, Y, ty):
            for x0 in range(0, X, tx):
                cy, cx = centre(y0, ty, Y), centre(x0, tx, X)
                st.append(clamp(centre(t0, tt, T) - kt // 2, T - kt))
                sy.append([clamp(cy + a - ky // 2, Y - ky) for a, _ in cands])
                sx.append([clamp(cx + b - kx // 2, X - kx) for _, b in cands])
                size.append((min(t0 + tt, T) - t0) * (min(y0 + ty, Y) - y0) *
                            (min(x0 + tx, X) - x0))
    return (np.array(st), np.array(sy), np.array(sx), np.array(size),
            np.array(cands, dtype=np.int32))


def _tiles_of(a: torch.Tensor, grid, tile) -> torch.Tensor:
    """[B, H, T, Y, X, D] -> [B, H, tiles, tt*ty*tx, D], zero-padded."""
    B, H, D = a.shape[0], a.shape[1], a.shape[-1]
    n = [-(-g // t) for g, t in zip(grid, tile)]
    pad = []
    for c, t, g in reversed(list(zip(n, tile, grid))):
        pad += [0, c * t - g]
    a = torch.nn.functional.pad(a, [0, 0] + pad)
    a = a.reshape(B, H, n[0], tile[0], n[1], tile[1], n[2], tile[2], D)
    return a.permute(0, 1, 2, 4, 6, 3, 5, 7, 8).reshape(
        B, H, math.prod(n), math.prod(tile), D)


def _window_starts(q: torch.Tensor, k: torch.Tensor, grid, window, tile,
                   radius):
    """Block matching in float64: the chosen candidate per (b, h, tile, j)
    and the layout. q, k [B, H, T, Y, X, D]."""
    st, sy, sx, size, cands = _layout(tuple(grid), tuple(window), tuple(tile),
                                      radius)
    kt, ky, kx = window
    dev = q.device
    q = q.detach().to(torch.float64)
    k = k.detach().to(torch.float64)
    q_mean = _tiles_of(q, grid, tile).sum(3) / torch.as_tensor(
        size, dtype=torch.float64, device=dev)[:, None]  # [B, H, tiles, D]
    # Window sums from a summed-area table over (y, x), as the kernel does
    # (in double): identical clamped windows give identical scores.
    sat = torch.nn.functional.pad(k.cumsum(3).cumsum(4),
                                  [0, 0, 1, 0, 1, 0])
    box = (sat[:, :, :, ky:, kx:] - sat[:, :, :, :-ky, kx:] -
           sat[:, :, :, ky:, :-kx] + sat[:, :, :, :-ky, :-kx]) / (ky * kx)
    frames = torch.as_tensor(st, device=dev)[:, None] + torch.arange(
        kt, device=dev)  # [tiles, kt]
    sy_t = torch.as_tensor(sy, device=dev)
    sx_t = torch.as_tensor(sx, device=dev)
    scores = []
    for c in range(len(cands)):  # one candidate at a time bounds the memory
        keys = box[:, :, frames, sy_t[:, c, None], sx_t[:, c, None]]
        scores.append((keys * q_mean[:, :, :, None, :]).sum(-1))
    # argmax keeps the first maximum: the tie-break order of the candidates.
    best = torch.stack(scores, -1).argmax(-1)  # [B, H, tiles, kt]
    return best, (st, sy_t, sx_t, cands)


def dsa3d_offsets_torch(q: torch.Tensor, k: torch.Tensor,
                        window: Sequence[int], tile: Sequence[int],
                        radius: int) -> torch.Tensor:
    """:func:`megaslide.dsa3d_offsets` in torch, on the tensors' device:
    q, k [B, H, T, Y, X, D]; returns int32 [B, H, ceil(T/tt), ceil(Y/ty),
    ceil(X/tx), kt, 2] (dy, dx). Scores are float64 (the kernel's window
    sums are double too), so the two agree except where two displacements
    score within rounding of each other (docs/Dsa3d.md)."""
    grid = tuple(q.shape[2:5])
    window, tile = _triple("window", window), _triple("tile", tile)
    best, _ = _window_starts(q, k, grid, window, tile, radius)
    cands = _layout(grid, window, tile, radius)[4]
    out = torch.as_tensor(cands, device=q.device)[best]
    n = [-(-g // t) for g, t in zip(grid, tile)]
    return out.reshape(q.shape[0], q.shape[1], *n, window[0], 2).to(
        torch.int32)


# ---------------------------------------------------------------------------
# The attention proper
# ---------------------------------------------------------------------------

def _flex_fn(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention
    if device.type == "cuda":
        return _compiled_flex()
    return flex_attention


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def _dsa_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid,
              window, tile, radius) -> torch.Tensor:
    """3D-DSA by FlexAttention: q, k, v [B, H, N, D] -> [B, H, N, D]."""
    mask, _ = dsa3d_block_mask(q, k, grid, window, tile, radius)
    return _flex_fn(q.device)(q, k, v, block_mask=mask)


def dsa3d_block_mask(q: torch.Tensor, k: torch.Tensor, grid: Sequence[int],
                     window: Sequence[int], tile: Sequence[int], radius: int,
                     block: int = 128):
    """FlexAttention's BlockMask for 3D-DSA over queries and keys
    q, k [B, H, N, D] on the token ``grid``, with offsets estimated by
    :func:`dsa3d_offsets_torch`; returns (block_mask, mask_mod). mask_mod
    admits exactly each query tile's displaced window (docs/Dsa3d.md)."""
    B, H, N, D = q.shape
    T, Y, X = grid
    kt, ky, kx = window
    tt, ty, tx = tile
    dev = q.device
    shape6 = (B, H, T, Y, X, D)
    best, (st, sy, sx, _) = _window_starts(q.reshape(shape6),
                                           k.reshape(shape6), grid, window,
                                           tile, radius)
    tiles = best.shape[2]
    tile_ids = torch.arange(tiles, device=dev)[:, None]
    y_start = sy[tile_ids, best].contiguous()  # [B, H, tiles, kt]
    x_start = sx[tile_ids, best].contiguous()
    t_start = torch.as_tensor(st, device=dev)
    n = torch.arange(N, device=dev)
    tok_t, tok_y, tok_x = n // (Y * X), (n // X) % Y, n % X
    nty, ntx = -(-Y // ty), -(-X // tx)
    q_tile = ((tok_t // tt) * nty + tok_y // ty) * ntx + tok_x // tx

    def mask_mod(b, h, q_idx, kv_idx):
        tl = q_tile[q_idx]
        j = tok_t[kv_idx] - t_start[tl]
        jc = j.clamp(0, kt - 1)
        ys = y_start[b, h, tl, jc]
        xs = x_start[b, h, tl, jc]
        y, x = tok_y[kv_idx], tok_x[kv_idx]
        return ((j >= 0) & (j < kt) & (y >= ys) & (y < ys + ky) & (x >= xs) &
                (x < xs + kx))

    return _dsa_block_mask(mask_mod, N, grid, window, t_start, y_start,
                           x_start, q_tile, block), mask_mod


def _dsa_block_mask(mask_mod, N: int, grid, window, t_start: torch.Tensor,
                    y_start: torch.Tensor, x_start: torch.Tensor,
                    q_tile: torch.Tensor, block: int = 128):
    """The BlockMask of 3D-DSA from its window starts, without evaluating
    mask_mod over all N x N pairs as create_block_mask does: every block of
    `block` keys that a query tile's window rows touch, for every block of
    queries holding that tile; mask_mod masks inside those blocks (all are
    partial). Cost O(B H (tiles kt ky + q-blocks x tiles x kv-blocks))."""
    from torch.nn.attention.flex_attention import BlockMask
    B, H, tiles, kt = y_start.shape
    T, Y, X = grid
    ky, kx = window[1], window[2]
    dev = y_start.device
    nblk = -(-N // block)
    frames = t_start[:, None] + torch.arange(kt, device=dev)  # [tiles, kt]
    rows = y_start[..., None] + torch.arange(ky, device=dev)
    first = (frames[None, None, :, :, None] * Y + rows) * X + \
        x_start[..., None]  # first key of each window row
    last = first + kx - 1
    touched = torch.zeros(B, H, tiles, nblk, device=dev)
    for o in range(-(-kx // block) + 1):  # the blocks a row of kx keys spans
        blk = first // block + o
        hit = (blk <= last // block).to(touched.dtype)
        touched.scatter_add_(3, blk.clamp(max=nblk - 1).reshape(
            B, H, tiles, -1), hit.reshape(B, H, tiles, -1))
    # Which tiles each block of queries holds (tokens of a tile are not
    # contiguous: a tile spans rows and frames).
    holds = torch.zeros(nblk, tiles, device=dev)
    holds[torch.arange(N, device=dev) // block, q_tile] = 1
    occupied = torch.einsum("qt,bhtk->bhqk", holds, (touched > 0).to(
        holds.dtype)) > 0
    counts = occupied.sum(-1, dtype=torch.int32)
    order = torch.argsort(occupied.to(torch.int8), dim=-1, descending=True,
                          stable=True).to(torch.int32)
    return BlockMask.from_kv_blocks(counts, order, BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(N, N))


def _dsa_megaslide(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid,
                   window, tile, radius) -> torch.Tensor:
    """3D-DSA by megaslide's CPU kernels: q, k, v [B, H, N, D]."""
    # Imported here: the flex path runs without the extension (the device
    # check loads this file alone, scripts/dsa_processor_gpu_check.py).
    import megaslide

    B, H, N, D = q.shape

    def arr(t):
        return np.ascontiguousarray(
            t.detach().to("cpu", torch.float32).reshape(B, H, *grid, D)
            .numpy())

    qn, kn, vn = arr(q), arr(k), arr(v)
    offsets = megaslide.dsa3d_offsets(qn, kn, window, tile, radius)
    out = megaslide.dsa3d(qn, kn, vn, offsets, window, tile)
    return torch.from_numpy(out.reshape(B, H, N, D)).to(q.device, q.dtype)


def _apply_rotary_emb(x: torch.Tensor, freqs_cos: torch.Tensor,
                      freqs_sin: torch.Tensor) -> torch.Tensor:
    # diffusers 0.42.1 WanAttnProcessor's apply_rotary_emb.
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class _GridState:
    """The token grid of the transformer's current forward, recorded by a
    pre-hook: the hidden states the processor sees are flat tokens."""

    def __init__(self) -> None:
        self.grid: Optional[Tuple[int, int, int]] = None


class Dsa3dAttnProcessor:
    """Self-attention of diffusers' ``WanAttention`` as 3D-DSA.

    Install it with :func:`enable_dsa`, which also records the token grid
    the processor needs. ``settings``: the run's :class:`Dsa3dSettings`;
    ``backend``: ``"auto"``, ``"flex"`` or ``"megaslide"`` (module
    docstring). A call whose grid is smaller than the window along an axis
    attends globally, as the planner keeps such attention global; so does a
    cross-attention call (text and image keys form no grid).
    """

    def __init__(self, settings: Dsa3dSettings, backend: str = "auto",
                 grid_state: Optional[_GridState] = None) -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(_BACKENDS)},"
                             f" got {backend!r}")
        from diffusers.models.transformers.transformer_wan import \
            WanAttnProcessor
        self.settings = settings
        self.backend = backend
        self.grid_state = grid_state or _GridState()
        self._global = WanAttnProcessor()

    def __call__(self, attn, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None,
                 rotary_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
                 ) -> torch.Tensor:
        grid = self.grid_state.grid
        if encoder_hidden_states is not None or rotary_emb is None:
            return self._global(attn, hidden_states, encoder_hidden_states,
                                attention_mask, rotary_emb)
        if grid is None:
            raise RuntimeError(
                "Dsa3dAttnProcessor does not know the token grid: install it "
                "with megaslide.diffusers.enable_dsa, which records the "
                "grid of every transformer forward")
        if math.prod(grid) != hidden_states.shape[1]:
            raise RuntimeError(
                f"Dsa3dAttnProcessor: {hidden_states.shape[1]} tokens do not "
                f"form the recorded grid {grid}")
        if attention_mask is not None:
            raise ValueError("Dsa3dAttnProcessor takes no attention_mask "
                             "(3D-DSA defines which keys each query sees)")
        if not self.settings.uses_dsa(grid):
            return self._global(attn, hidden_states, None, None, rotary_emb)

        # WanAttnProcessor up to the attention (self-attention, no image keys).
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query = attn.to_q(hidden_states)
            key = attn.to_k(hidden_states)
            value = attn.to_v(hidden_states)
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        query = _apply_rotary_emb(query, *rotary_emb)
        key = _apply_rotary_emb(key, *rotary_emb)

        # [B, N, H, D] -> [B, H, N, D]; training feeds block matching these
        # same post-norm, post-RoPE queries and keys.
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        backend = self.backend
        if backend == "auto":
            backend = "flex" if q.device.type == "cuda" else "megaslide"
        s = self.settings
        run = _dsa_flex if backend == "flex" else _dsa_megaslide
        out = run(q, k, v, grid, s.window, s.tile, s.radius)
        hidden_states = out.transpose(1, 2).flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


# ---------------------------------------------------------------------------
# Switching a pipeline
# ---------------------------------------------------------------------------

def _transformers_of(pipe_or_transformer):
    """The pipeline's Wan transformers: ``transformer`` and, in Wan 2.2
    A14B's pipelines, the low-noise expert ``transformer_2``."""
    from diffusers import WanTransformer3DModel
    if isinstance(pipe_or_transformer, WanTransformer3DModel):
        return [pipe_or_transformer]
    found = [getattr(pipe_or_transformer, name, None)
             for name in ("transformer", "transformer_2")]
    found = [t for t in found if isinstance(t, WanTransformer3DModel)]
    if found:
        return found
    raise TypeError(f"expected a Wan pipeline (WanPipeline, "
                    f"WanImageToVideoPipeline) or a WanTransformer3DModel, "
                    f"got {type(pipe_or_transformer).__name__}")


def run_config(transformer) -> Optional[Dict[str, Any]]:
    """The ``_megaslide`` record of the transformer's config.json, or None.

    diffusers passes no key starting with ``_`` to the model; 0.42.1 keeps
    them in ``transformer.config``, where this looks first, then in the
    config.json of the folder the model was loaded from
    (``config._name_or_path``), for versions or loaders that do not."""
    config = transformer.config
    folder = config.get("_name_or_path")
    path = pathlib.Path(folder) / "config.json" if folder else None
    record = config.get(RUN_CONFIG_KEY)
    if record is None and path is not None and path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read the model config: "
                             f"{e}") from None
        record = data.get(RUN_CONFIG_KEY) if isinstance(data, dict) else None
    if record is not None and not isinstance(record, dict):
        raise ValueError(f"{path or 'config.json'}: '{RUN_CONFIG_KEY}' must be "
                         f"an object (what megaslide's save_weights writes)")
    return record


def _settings_from_record(record: Dict[str, Any], where: str) -> Dsa3dSettings:
    dsa = record.get("dsa3d")
    if record.get("attention") != "dsa" or not isinstance(dsa, dict):
        raise ValueError(
            f"{where}: the run trained with global attention "
            f"('{RUN_CONFIG_KEY}': attention "
            f"{record.get('attention')!r}), so there is no 3D-DSA to "
            f"enable; sample with the stock processor, or pass window, tile "
            f"and radius to enable_dsa")
    layers = dsa.get("layers")
    try:
        if layers is not None and (
                not isinstance(layers, list) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0
                    for i in layers)):
            raise ValueError(f"layers must be a list of block indices, got "
                             f"{layers!r}")
        return Dsa3dSettings(dsa["window"], dsa["tile"], dsa["radius"],
                             layers)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: '{RUN_CONFIG_KEY}.dsa3d' is not what "
                         f"megaslide writes: {e}") from None


def enable_dsa(pipe_or_transformer, *, window: Optional[Sequence[int]] = None,
               tile: Optional[Sequence[int]] = None,
               radius: Optional[int] = None,
               backend: str = "auto") -> Dsa3dSettings:
    """Switches a loaded ``WanPipeline`` or ``WanImageToVideoPipeline`` (or
    ``WanTransformer3DModel``) to 3D-DSA self-attention (``attn1`` of every
    block; ``attn2``, the cross-attention, is left as it is); returns the
    settings used (of ``transformer``). A Wan 2.2 A14B pipeline's two
    experts, ``transformer`` and ``transformer_2``, each get the settings
    of their own config.json's record (or the arguments).

    ``window``, ``tile`` (t, y, x in tokens) and ``radius``: all three, or
    none to read them from the config.json's ``_megaslide`` key (written
    by megaslide's save_weights); which blocks use 3D-DSA comes from there
    too (all blocks when the arguments are given). ValueError when neither
    is there, or the run trained with global attention. Each forward whose
    token grid is smaller than the window along an axis keeps global
    attention (the planner's rule). ``backend``: "auto", "flex" or
    "megaslide" (module docstring). :func:`disable_dsa` undoes it.
    """
    given = [x is not None for x in (window, tile, radius)]
    if any(given) and not all(given):
        raise ValueError("give window, tile and radius together, or none of "
                         "them to read the run's from config.json")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}, got "
                         f"{backend!r}")
    transformers = _transformers_of(pipe_or_transformer)
    # Every expert's settings first: a bad record changes nothing.
    chosen = []
    for transformer in transformers:
        if all(given):
            settings = Dsa3dSettings(window, tile,  # type: ignore[arg-type]
                                     radius)
        else:
            record = run_config(transformer)
            folder = transformer.config.get("_name_or_path", "the model")
            where = f"{folder}/config.json" if folder else "config.json"
            if record is None:
                raise ValueError(
                    f"{where} has no '{RUN_CONFIG_KEY}' key (megaslide's "
                    f"save_weights writes it): pass window, tile and radius "
                    f"to enable_dsa, e.g. enable_dsa(pipe, window=(9, 15, "
                    f"24), tile=(3, 5, 8), radius=4)")
            settings = _settings_from_record(record, where)
        blocks = len(transformer.blocks)
        if settings.layers is not None and (
                not settings.layers or max(settings.layers) >= blocks):
            raise ValueError(f"3D-DSA layers {list(settings.layers)} do not "
                             f"name blocks of this transformer (it has "
                             f"{blocks}): the record is of another model, or "
                             f"pass window, tile and radius to use 3D-DSA in "
                             f"every block")
        chosen.append(settings)
    for transformer, settings in zip(transformers, chosen):
        _install(transformer, settings, backend)
    return chosen[0]


def _install(transformer, settings: Dsa3dSettings, backend: str) -> None:
    """Puts the 3D-DSA processor on the transformer's attn1 where
    ``settings`` says."""
    disable_dsa(transformer)
    state = _GridState()
    patch = tuple(transformer.config.patch_size)

    def record_grid(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        state.grid = tuple(int(n) // p for n, p in zip(x.shape[2:], patch))

    transformer._megaslide_dsa_hook = transformer.register_forward_pre_hook(
        record_grid, with_kwargs=True)
    for i, block in enumerate(transformer.blocks):
        if settings.layers is None or i in settings.layers:
            block.attn1.set_processor(
                Dsa3dAttnProcessor(settings, backend, state))


def disable_dsa(pipe_or_transformer) -> None:
    """Restores diffusers' ``WanAttnProcessor`` where :func:`enable_dsa` put
    a :class:`Dsa3dAttnProcessor`; nothing to do otherwise."""
    from diffusers.models.transformers.transformer_wan import \
        WanAttnProcessor
    for transformer in _transformers_of(pipe_or_transformer):
        hook = getattr(transformer, "_megaslide_dsa_hook", None)
        if hook is not None:
            hook.remove()
            transformer._megaslide_dsa_hook = None
        for block in transformer.blocks:
            if isinstance(block.attn1.processor, Dsa3dAttnProcessor):
                block.attn1.set_processor(WanAttnProcessor())


def save_video(frames: Any, path: Any, fps: float = 16) -> None:
    """Writes a sampled video to ``path`` with PyAV (diffusers'
    ``export_to_video`` needs imageio, which megaslide does not install):
    ``frames`` as ``WanPipeline(..., output_type="np").frames[0]`` gives
    them, [F, H, W, 3] floats in [0, 1] (or uint8). The container follows
    the suffix (.mp4: H.264, .webm: VP9, else MPEG-4 Part 2), at high
    quality; the file is replaced atomically. The encoders take even sizes
    only: an odd height or width drops its last row or column."""
    import av

    video = np.asarray(frames)
    if video.ndim != 4 or video.shape[-1] != 3:
        raise ValueError(f"frames must be [F, H, W, 3], got shape "
                         f"{video.shape}")
    if video.dtype != np.uint8:
        video = (np.clip(video, 0, 1) * 255 + 0.5).astype(np.uint8)
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    codec = {".mp4": "libx264", ".webm": "libvpx-vp9"}.get(suffix, "mpeg4")
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}{suffix}")
    try:
        with av.open(tmp, "w") as container:
            stream = container.add_stream(codec, rate=fps)
            # yuv420p halves the chroma planes: even sizes only.
            stream.height = video.shape[1] - video.shape[1] % 2
            stream.width = video.shape[2] - video.shape[2] % 2
            stream.pix_fmt = "yuv420p"
            if codec == "libx264":
                stream.options = {"crf": "10"}
            for image in video[:, :stream.height, :stream.width]:
                frame = av.VideoFrame.from_ndarray(
                    np.ascontiguousarray(image), format="rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
