"""megaslide.dsa3d, dsa3d_backward and dsa3d_offsets (the CPU 3D-DSA kernels)
against references written here from docs/Dsa3d.md alone: explicit key index
lists per query, softmax attention over them in float64 numpy, dense
attention when the window is the grid, block matching by direct window
means, central finite differences and jax autodiff; plus argument checking.

Tolerances (the kernels compute in float32 with fp32 accumulation, the
references in float64):
  forward:               rtol 1e-4, atol 1e-5
  gradients vs jax:      rtol 1e-4, atol 1e-4 * max(1, max|reference|)
  finite differences:    rtol 1e-3, atol 1e-4 * max(1, max|reference|)
                         (central differences, eps 1e-3: truncation ~1e-6)
  offsets:               exact
"""

import math

import numpy as np
import pytest

import megaslide

FWD_TOL = dict(rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Naive references
# ---------------------------------------------------------------------------

def tile_centre(i, tile, extent):
    """floor((first + last) / 2) of the (possibly partial) tile holding i."""
    first = i // tile * tile
    last = min(first + tile, extent) - 1
    return (first + last) // 2


def clamp(v, lo, hi):
    return max(lo, min(v, hi))


def n_tiles(grid, tile):
    return tuple(-(-g // t) for g, t in zip(grid, tile))


def key_indices(shape, offsets, window, tile):
    """int64 [B, H, N, kt*ky*kx]: the flat key tokens of every query."""
    B, H, T, Y, X, _ = shape
    kt, ky, kx = window
    tt, ty, tx = tile
    keys = np.empty((B, H, T * Y * X, kt * ky * kx), np.int64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                st = clamp(tile_centre(t, tt, T) - kt // 2, 0, T - kt)
                for y in range(Y):
                    cy = tile_centre(y, ty, Y)
                    for x in range(X):
                        cx = tile_centre(x, tx, X)
                        row = []
                        for j in range(kt):
                            dy, dx = offsets[b, h, t // tt, y // ty, x // tx, j]
                            sy = clamp(cy + int(dy) - ky // 2, 0, Y - ky)
                            sx = clamp(cx + int(dx) - kx // 2, 0, X - kx)
                            for yy in range(sy, sy + ky):
                                for xx in range(sx, sx + kx):
                                    row.append(((st + j) * Y + yy) * X + xx)
                        keys[b, h, (t * Y + y) * X + x] = row
    return keys


def gather(xp, a, keys):
    """a [B, H, N, D] -> a[b, h, keys[b, h, n, w]]: [B, H, N, W, D]."""
    B, H = keys.shape[:2]
    return a[np.arange(B)[:, None, None, None],
             np.arange(H)[None, :, None, None], keys]


def attention(xp, q, k, v, keys, scale):
    """Softmax attention of q over the listed keys; q, k, v [B,H,T,Y,X,D]."""
    shape = q.shape
    flat = lambda a: a.reshape(shape[0], shape[1], -1, shape[-1])
    kk, vv = gather(xp, flat(k), keys), gather(xp, flat(v), keys)
    logits = scale * xp.einsum("bhnd,bhnwd->bhnw", flat(q), kk)
    logits = logits - logits.max(axis=-1, keepdims=True)
    p = xp.exp(logits)
    p = p / p.sum(axis=-1, keepdims=True)
    return xp.einsum("bhnw,bhnwd->bhnd", p, vv).reshape(shape)


def naive_dsa3d(q, k, v, offsets, window, tile, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    keys = key_indices(q.shape, offsets, window, tile)
    f64 = lambda a: np.asarray(a, np.float64)
    return attention(np, f64(q), f64(k), f64(v), keys, scale)


def dense_attention(q, k, v):
    B, H, T, Y, X, D = q.shape
    f = lambda a: np.asarray(a, np.float64).reshape(B, H, -1, D)
    logits = np.einsum("bhnd,bhmd->bhnm", f(q), f(k)) / math.sqrt(D)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhnm,bhmd->bhnd", p, f(v)).reshape(q.shape)


def naive_offsets(q, k, window, tile, radius):
    B, H, T, Y, X, D = q.shape
    kt, ky, kx = window
    tt, ty, tx = tile
    nT, nY, nX = n_tiles((T, Y, X), tile)
    out = np.zeros((B, H, nT, nY, nX, kt, 2), np.int32)
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    for b in range(B):
        for h in range(H):
            for it in range(nT):
                for iy in range(nY):
                    for ix in range(nX):
                        q_mean = q[b, h, it * tt:(it + 1) * tt,
                                   iy * ty:(iy + 1) * ty,
                                   ix * tx:(ix + 1) * tx].reshape(-1, D).mean(0)
                        st = clamp(tile_centre(it * tt, tt, T) - kt // 2, 0,
                                   T - kt)
                        cy, cx = tile_centre(iy * ty, ty, Y), tile_centre(
                            ix * tx, tx, X)
                        for j in range(kt):
                            best = None
                            for dy in range(-radius, radius + 1):
                                for dx in range(-radius, radius + 1):
                                    sy = clamp(cy + dy - ky // 2, 0, Y - ky)
                                    sx = clamp(cx + dx - kx // 2, 0, X - kx)
                                    k_mean = k[b, h, st + j, sy:sy + ky,
                                               sx:sx + kx].reshape(-1, D).mean(0)
                                    score = float(q_mean @ k_mean)
                                    rank = (abs(dy) + abs(dx), dy, dx)
                                    if (best is None or score > best[0] or
                                            (score == best[0] and rank < best[1])):
                                        best = (score, rank, dy, dx)
                            out[b, h, it, iy, ix, j] = best[2:]
    return out


# ---------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------

def random_problem(seed, grid=None, window=None, tile=None, batch=None,
                   heads=None, head_dim=None, max_offset=3):
    rng = np.random.default_rng(seed)
    grid = grid or tuple(int(rng.integers(1, g + 1)) for g in (4, 6, 6))
    window = window or tuple(int(rng.integers(1, g + 1)) for g in grid)
    tile = tile or tuple(int(rng.integers(1, g + 1)) for g in grid)
    batch = batch or int(rng.integers(1, 3))
    heads = heads or int(rng.integers(1, 3))
    head_dim = head_dim or int(rng.choice([8, 16, 32, 64]))
    shape = (batch, heads, *grid, head_dim)
    q, k, v = (rng.normal(0, 1.5, shape).astype(np.float32) for _ in range(3))
    offsets = rng.integers(-max_offset, max_offset + 1,
                           (batch, heads, *n_tiles(grid, tile), window[0], 2)
                           ).astype(np.int32)
    return q, k, v, offsets, window, tile


def scaled_atol(reference, factor):
    return factor * max(1.0, float(np.abs(reference).max()))


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_forward_matches_naive_on_random_shapes(seed):
    q, k, v, offsets, window, tile = random_problem(seed)
    out = megaslide.dsa3d(q, k, v, offsets, window, tile)
    assert out.dtype == np.float32 and out.shape == q.shape
    np.testing.assert_allclose(
        out, naive_dsa3d(q, k, v, offsets, window, tile), **FWD_TOL)


def test_forward_partial_border_tiles():
    # 5x7x6 grid with 2x3x4 tiles: the last tile along every axis is partial,
    # so its centre is that of the frames it has.
    q, k, v, offsets, window, tile = random_problem(
        100, grid=(5, 7, 6), window=(3, 3, 3), tile=(2, 3, 4), batch=2,
        heads=2, head_dim=16)
    np.testing.assert_allclose(
        megaslide.dsa3d(q, k, v, offsets, window, tile),
        naive_dsa3d(q, k, v, offsets, window, tile), **FWD_TOL)


@pytest.mark.parametrize("seed", range(4))
def test_window_equal_to_grid_is_dense_attention(seed):
    rng = np.random.default_rng(200 + seed)
    grid = tuple(int(rng.integers(1, g + 1)) for g in (3, 6, 6))
    q, k, v, offsets, window, tile = random_problem(
        200 + seed, grid=grid, window=grid, max_offset=9)
    np.testing.assert_allclose(megaslide.dsa3d(q, k, v, offsets, window, tile),
                               dense_attention(q, k, v), **FWD_TOL)


def test_offsets_past_the_border_are_clamped():
    q, k, v, offsets, window, tile = random_problem(
        300, grid=(3, 8, 8), window=(2, 3, 3), tile=(1, 4, 4), batch=1,
        heads=2, head_dim=8)
    far = np.empty_like(offsets)
    far[..., 0] = 50
    far[..., 1] = -50
    out = megaslide.dsa3d(q, k, v, far, window, tile)
    np.testing.assert_allclose(out, naive_dsa3d(q, k, v, far, window, tile),
                               **FWD_TOL)
    # Every window is pinned to the bottom-left corner: y in [5, 8),
    # x in [0, 3) of its frames, whatever the tile.
    corner = np.empty_like(offsets)
    for iy, cy in enumerate((1, 5)):
        for ix, cx in enumerate((1, 5)):
            corner[:, :, :, iy, ix, :, 0] = 6 - cy
            corner[:, :, :, iy, ix, :, 1] = 1 - cx
    np.testing.assert_array_equal(
        out, megaslide.dsa3d(q, k, v, corner, window, tile))


def test_explicit_scale_and_non_contiguous_inputs():
    q, k, v, offsets, window, tile = random_problem(
        400, grid=(2, 4, 5), window=(2, 3, 3), tile=(1, 2, 2), batch=2,
        heads=2, head_dim=8)
    ref = naive_dsa3d(q, k, v, offsets, window, tile, scale=0.7)
    # A transposed float32 view is made contiguous, not rejected.
    q_view = np.ascontiguousarray(np.swapaxes(q, 0, 1)).swapaxes(0, 1)
    assert not q_view.flags.c_contiguous
    np.testing.assert_allclose(
        megaslide.dsa3d(q_view, k, v, offsets, window, tile, scale=0.7), ref,
        **FWD_TOL)


# ---------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------

def numeric_gradients(q, k, v, offsets, window, tile, w, eps=1e-3):
    """Central differences of sum(out * w) through the float64 reference."""
    keys = key_indices(q.shape, offsets, window, tile)
    scale = 1 / math.sqrt(q.shape[-1])
    args = [np.asarray(a, np.float64) for a in (q, k, v)]
    loss = lambda: float((attention(np, *args, keys, scale) * w).sum())
    grads = []
    for a in args:
        g = np.empty_like(a)
        flat, gflat = a.reshape(-1), g.reshape(-1)
        for i in range(flat.size):
            saved = flat[i]
            flat[i] = saved + eps
            up = loss()
            flat[i] = saved - eps
            down = loss()
            flat[i] = saved
            gflat[i] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


@pytest.mark.parametrize("problem", [
    dict(grid=(3, 3, 4), window=(2, 2, 3), tile=(2, 2, 3), batch=1, heads=2,
         head_dim=8),
    dict(grid=(2, 4, 3), window=(2, 4, 3), tile=(1, 3, 2), batch=2, heads=1,
         head_dim=8),  # dense
])
def test_backward_matches_finite_differences(problem):
    q, k, v, offsets, window, tile = random_problem(500, **problem)
    w = np.random.default_rng(501).normal(size=q.shape).astype(np.float32)
    got = megaslide.dsa3d_backward(q, k, v, offsets, w, window, tile)
    expected = numeric_gradients(q, k, v, offsets, window, tile,
                                 w.astype(np.float64))
    for name, g, ref in zip(("dq", "dk", "dv"), got, expected):
        assert g.dtype == np.float32 and g.shape == q.shape
        np.testing.assert_allclose(g, ref, rtol=1e-3,
                                   atol=scaled_atol(ref, 1e-4), err_msg=name)


@pytest.mark.parametrize("seed", range(6))
def test_backward_matches_jax_autodiff(seed):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy
    q, k, v, offsets, window, tile = random_problem(600 + seed)
    w = np.random.default_rng(700 + seed).normal(size=q.shape).astype(
        np.float32)
    keys = key_indices(q.shape, offsets, window, tile)
    scale = 1 / math.sqrt(q.shape[-1])

    def loss(q, k, v):
        return (attention(jnp, q, k, v, keys, scale) * w.astype(np.float64)
                ).sum()

    expected = jax.grad(loss, argnums=(0, 1, 2))(
        *(jnp.asarray(a, jnp.float64) for a in (q, k, v)))
    got = megaslide.dsa3d_backward(q, k, v, offsets, w, window, tile)
    for name, g, ref in zip(("dq", "dk", "dv"), got, expected):
        ref = np.asarray(ref)
        assert ref.dtype == np.float64
        np.testing.assert_allclose(g, ref, rtol=1e-4,
                                   atol=scaled_atol(ref, 1e-4), err_msg=name)


# ---------------------------------------------------------------------------
# Offsets
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(10))
def test_offsets_match_naive_block_matching(seed):
    q, k, _, _, window, tile = random_problem(800 + seed)
    radius = seed % 4
    got = megaslide.dsa3d_offsets(q, k, window, tile, radius)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got,
                                  naive_offsets(q, k, window, tile, radius))


def test_offsets_follow_planted_motion():
    # Frame 1 holds frame 0's bright patch moved by (+2, -1); the query tile
    # over the patch finds the move, and 3D-DSA with those offsets attends
    # to the moved patch.
    shape = (1, 1, 2, 12, 12, 8)
    q, k = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    feature = np.arange(1, 9, dtype=np.float32)
    k[0, 0, 0, 3:6, 3:6] = feature
    k[0, 0, 1, 5:8, 2:5] = feature
    q[0, 0, :, 3:6, 3:6] = feature
    offsets = megaslide.dsa3d_offsets(q, k, (2, 3, 3), (2, 3, 3), 3)
    np.testing.assert_array_equal(offsets[0, 0, 0, 1, 1], [[0, 0], [2, -1]])
    np.testing.assert_array_equal(
        offsets, naive_offsets(q, k, (2, 3, 3), (2, 3, 3), 3))


def test_offsets_all_tie_with_constant_keys():
    q, _, _, _, window, tile = random_problem(
        900, grid=(3, 7, 9), window=(2, 3, 3), tile=(2, 2, 4), batch=2,
        heads=2, head_dim=16)
    k = np.full(q.shape, 0.3, np.float32)
    for radius in (0, 1, 4):
        offsets = megaslide.dsa3d_offsets(q, k, window, tile, radius)
        assert offsets.shape == (2, 2, 2, 4, 3, 2, 2)
        assert not offsets.any()


# ---------------------------------------------------------------------------
# Argument checking
# ---------------------------------------------------------------------------

@pytest.fixture
def small():
    return random_problem(1000, grid=(2, 4, 4), window=(2, 2, 2),
                          tile=(1, 2, 2), batch=1, heads=2, head_dim=8)


def test_public_names():
    for name in ("dsa3d", "dsa3d_backward", "dsa3d_offsets"):
        assert name in megaslide.__all__
        assert getattr(megaslide, name).__doc__


@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_float64_is_rejected_not_cast(small, arg):
    q, k, v, offsets, window, tile = small
    args = dict(q=q, k=k, v=v)
    args[arg] = args[arg].astype(np.float64)
    with pytest.raises(TypeError, match=f"{arg} must have dtype float32, got "
                                        f"float64"):
        megaslide.dsa3d(**args, offsets=offsets, window=window, tile=tile)


def test_other_dtypes_are_rejected(small):
    q, k, v, offsets, window, tile = small
    with pytest.raises(TypeError, match="offsets must have dtype int32, got "
                                        "int64"):
        megaslide.dsa3d(q, k, v, offsets.astype(np.int64), window, tile)
    with pytest.raises(TypeError, match="d_out must have dtype float32, got float16"):
        megaslide.dsa3d_backward(q, k, v, offsets, q.astype(np.float16),
                                 window, tile)
    with pytest.raises(TypeError, match="k must have dtype float32, got float64"):
        megaslide.dsa3d_offsets(q, k.astype(np.float64), window, tile, 1)
    with pytest.raises(TypeError, match="radius must be an int"):
        megaslide.dsa3d_offsets(q, k, window, tile, 1.5)
    with pytest.raises(TypeError, match="window must be a tuple of 3 ints"):
        megaslide.dsa3d(q, k, v, offsets, (2, 2.0, 2), tile)
    # The extension checks too: it never reads a buffer of the wrong type.
    with pytest.raises(TypeError, match="float32"):
        megaslide._megaslide.dsa3d_forward(q.astype(np.float64), k, v,
                                           offsets, window, tile, 1.0)


def test_bad_shapes_name_the_argument(small):
    q, k, v, offsets, window, tile = small
    with pytest.raises(ValueError, match=r"q must have shape \(B, H, T, Y, X, "
                                         r"D\), got shape \(2, 2, 4, 4, 8\)"):
        megaslide.dsa3d(q[0], k[0], v[0], offsets, window, tile)
    with pytest.raises(ValueError, match=r"v has shape \(1, 2, 2, 4, 3, 8\), "
                                         r"expected \(1, 2, 2, 4, 4, 8\)"):
        megaslide.dsa3d(q, k, v[..., :3, :], offsets, window, tile)
    with pytest.raises(ValueError, match=r"d_out has shape"):
        megaslide.dsa3d_backward(q, k, v, offsets, q[:, :1], window, tile)
    with pytest.raises(ValueError, match=r"offsets has shape \(1, 2, 2, 2, 2, "
                                         r"1, 2\), expected \(1, 2, 2, 2, 2, "
                                         r"2, 2\)"):
        megaslide.dsa3d(q, k, v, offsets[..., :1, :], window, tile)
    with pytest.raises(ValueError, match="every dimension"):
        megaslide.dsa3d(q[:, :0], k[:, :0], v[:, :0], offsets, window, tile)


def test_bad_windows_and_tiles(small):
    q, k, v, offsets, window, tile = small
    with pytest.raises(ValueError, match=r"window \(3, 2, 2\) exceeds the "
                                         r"token grid \(T, Y, X\) = \(2, 4, 4\) "
                                         r"along t"):
        megaslide.dsa3d(q, k, v, offsets, (3, 2, 2), tile)
    with pytest.raises(ValueError, match="exceeds the token grid"):
        megaslide.dsa3d_offsets(q, k, (1, 5, 1), tile, 1)
    with pytest.raises(ValueError, match=r"tile must be positive, got "
                                         r"\(1, 0, 2\)"):
        megaslide.dsa3d(q, k, v, offsets, window, (1, 0, 2))
    with pytest.raises(ValueError, match="window must be positive"):
        megaslide.dsa3d_backward(q, k, v, offsets, q, (0, 2, 2), tile)
    with pytest.raises(ValueError, match="radius must be non-negative"):
        megaslide.dsa3d_offsets(q, k, window, tile, -1)
    with pytest.raises(ValueError, match="scale must be positive and finite"):
        megaslide.dsa3d(q, k, v, offsets, window, tile, scale=0.0)
