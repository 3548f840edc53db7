"""K/V generators, packed states and their checks, and the lowering fixtures."""

from __future__ import annotations

import torch

from kvarn_compile.testing.oracles import oracle_attention

def random_kv(batch: int, heads: int, tokens: int, head_dim: int, *, scale: float = 1.0,
              dtype: torch.dtype = torch.float32, bias_outlier: bool = False,
              seed: int | None = None, generator: torch.Generator | None = None,
              value_head_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V [batch, heads, tokens, head_dim] like real keys: uneven channel scales
    (1-5x) and a +0.5 offset on the keys, standard normal values, both times ``scale``
    (values of ``value_head_dim`` channels where given).

    ``bias_outlier``: kv head 0 also gets a huge key channel (5) turning with position, like
    a k_proj bias after RoPE, so ``key_frame="auto"`` stores its tiles plain and the other
    heads' rotated. Draws from ``torch.Generator().manual_seed(seed)`` if ``seed`` is given,
    else from ``generator`` (default: the global generator).
    """
    g = torch.Generator().manual_seed(seed) if seed is not None else generator
    spread = 1 + 4 * torch.rand(head_dim, generator=g)
    k = torch.randn(batch, heads, tokens, head_dim, generator=g) * spread + 0.5
    if bias_outlier:
        k[:, 0, :, 5] += 400 * torch.cos(0.3 * torch.arange(tokens) + torch.rand(1, generator=g) * 6)
    v = torch.randn(batch, heads, tokens, value_head_dim or head_dim, generator=g)
    return (k * scale).to(dtype), (v * scale).to(dtype)


def kv_like(*lead: int, tokens: int = 256, d: int = 64, device: torch.device | str | None = None,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """One K or V tensor [*lead, tokens, d] for the quantizer tests: uneven channel scales
    (0.5-2.5x), an offset channel (3: +8) and a heavy channel (7: x6), like post-RoPE keys."""
    x = torch.randn(*lead, tokens, d, generator=generator) * (0.5 + torch.rand(d, generator=generator) * 2)
    x[..., 3] += 8.0
    x[..., 7] *= 6.0
    return x if device is None else x.to(device)


# ============================================================================ packed states
#: The small geometry of the op tests (fast on two CPU cores): tile length (and sink) G,
#: head dim D, kv heads H, tokens per row CAP; ``packed_state``/``PackedSequence`` defaults.
SMALL_G, SMALL_D, SMALL_H, SMALL_CAP = 32, 32, 2, 256


def small_presets() -> dict:
    """The presets the op tests sweep, at group size :data:`SMALL_G`."""
    from kvarn_compile.config import get_config

    g = SMALL_G
    return {
        "k4v2": get_config("k4v2", group_size=g),
        "k2v2": get_config("k2v2", group_size=g),
        "k4v4": get_config("k4v4", group_size=g),
        "k4v2-fp8": get_config("k4v2", group_size=g, scale_dtype="float8_e4m3fn"),
        "k4v2-kauto": get_config("k4v2", group_size=g, key_frame="auto"),
        "k4v2-krot": get_config("k4v2", group_size=g, key_frame="rotated"),   # the reference rule
    }


def small_kv(batch, tokens, *, heads=SMALL_H, head_dim=SMALL_D, **kw):
    """Random K/V [batch, heads, tokens, head_dim] in the small geometry (:func:`random_kv`)."""
    return random_kv(batch, heads, tokens, head_dim, **kw)


def packed_state(cfg=None, *, batch: int = 2, heads: int = 2, head_dim: int = 32,
                 max_len: int = 256, dtype: torch.dtype = torch.float32, spec_tokens: int = 0,
                 value_head_dim: int | None = None):
    """An empty layer state (:func:`kvarn_compile.state.allocate_layer`) with small defaults:
    ``cfg`` k4v2 at group_size 32, 2 rows, 2 kv heads of 32 channels, 256 tokens."""
    from kvarn_compile.config import get_config
    from kvarn_compile.state import allocate_layer

    cfg = get_config("k4v2", group_size=32) if cfg is None else cfg
    return allocate_layer(cfg, batch=batch, kv_heads=heads, head_dim=head_dim, max_len=max_len,
                          dtype=dtype, spec_tokens=spec_tokens, value_head_dim=value_head_dim)


def attend(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None = None, *,
           scale: float | None = None, causal: bool = True, window: int = 0) -> torch.Tensor:
    """``torch.ops.kvarn.attention`` with the default scale 1/sqrt(D)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.kvarn.attention(q, buffers, mask, scale, causal, window)


def assert_attention_matches(q: torch.Tensor, buffers: list[torch.Tensor],
                             mask: torch.Tensor | None = None, *, tol: float = 1e-5, **kw) -> None:
    """``kvarn::attention`` equals :func:`oracle_attention` (float64 over the dequantized
    cache) within ``tol`` (relative, and absolute to the output's scale)."""
    out = attend(q, buffers, mask, **kw)
    ref = oracle_attention(q, buffers, mask, **kw)
    assert out.shape == ref.shape == (*q.shape[:-1], ref.shape[-1]) and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality (float8 compared as bytes)."""
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def snapshot(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in buffers]


def assert_unchanged(buffers: list[torch.Tensor], before: list[torch.Tensor], what: str = "") -> None:
    """Every buffer of a state equals its :func:`snapshot`."""
    from kvarn_compile.state import StateLayout

    assert len(buffers) == len(before)
    for name, now, then in zip(StateLayout.of(buffers).names, buffers, before, strict=True):
        assert bits_equal(now, then), f"{what}: {name} changed"


TILE_BUFFERS = ("k_codes", "k_row_scale", "k_row_zero", "k_col_scale",
                "v_codes", "v_row_scale", "v_row_zero", "v_col_scale")
FACTOR_BUFFERS = ("k_row_factor", "k_col_factor", "v_row_factor", "v_col_factor")


def tile_buffers(buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-tile members of a state (codes, scales, zero points, fp8 factors, key frames)."""
    from kvarn_compile.state import unpack

    named = unpack(buffers).named()
    return {n: named[n] for n in TILE_BUFFERS + FACTOR_BUFFERS + ("k_plain",) if n in named}


def assert_tiles_equal_reference(buffers: list[torch.Tensor], row: int, k: torch.Tensor,
                                 v: torch.Tensor, cfg) -> None:
    """Row ``row``'s frozen tiles == ``quantize_cache`` of its whole (exact-dtype) sequence
    ``k``/``v`` [H, T, D], bit for bit."""
    from kvarn_compile.quant import quantize_cache
    from kvarn_compile.state import unpack

    f = unpack(buffers)
    named = f.named()
    exact = f.tail_k.dtype
    ref = quantize_cache(k.to(exact), v.to(exact), cfg)
    n = int(f.n_tiles[row])
    assert n == (0 if ref.k_tiles is None else ref.k_tiles.codes.shape[-3])
    if n == 0:
        return
    for kind, tiles in (("k", ref.k_tiles), ("v", ref.v_tiles)):
        fields = {"codes": tiles.codes, "row_scale": tiles.row_scale,
                  "row_zero": tiles.row_zero, "col_scale": tiles.col_scale}
        if tiles.row_scale_factor is not None:
            fields.update(row_factor=tiles.row_scale_factor, col_factor=tiles.col_scale_factor)
        for field, want in fields.items():
            got = named[f"{kind}_{field}"][row, :, :n]
            assert bits_equal(got, want), f"{kind}_{field} of row {row} differs from quantize_cache"
        if kind == "k" and tiles.plain is not None:
            assert torch.equal(f.k_plain[row, :, :n], tiles.plain)


def assert_states_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Every meaningful byte equal: counters, sink, frozen tiles, live tail positions."""
    from kvarn_compile.ops.append import materialize
    from kvarn_compile.state import unpack

    fa, fb = unpack(a).named(), unpack(b).named()
    for name in ("lengths", "committed", "n_tiles", "capacity", "sink_k", "sink_v"):
        assert torch.equal(fa[name], fb[name]), name
    n = int(fa["n_tiles"].max())
    other = tile_buffers(b)
    for name, t in tile_buffers(a).items():
        assert bits_equal(t[:, :, :n], other[name][:, :, :n]), name
    ka, va = materialize(a)
    kb, vb = materialize(b)
    assert torch.equal(ka, kb) and torch.equal(va, vb)


class PackedSequence:
    """A layer state (:func:`kvarn_compile.state.allocate_layer`) plus the exact tokens
    every row is supposed to hold; :meth:`write` appends random K/V (:func:`random_kv`)."""

    def __init__(self, cfg=None, *, batch: int = 2, heads: int = 2, head_dim: int = 32,
                 max_len: int = 256, dtype: torch.dtype = torch.float32, spec_tokens: int = 0,
                 outliers: bool = False, value_head_dim: int | None = None):
        self.outliers = outliers                     # keys with a huge bias channel
        self.heads, self.head_dim = heads, head_dim
        self.value_head_dim = value_head_dim or head_dim
        self.state = packed_state(cfg, batch=batch, heads=heads, head_dim=head_dim,
                                  max_len=max_len, dtype=dtype, spec_tokens=spec_tokens,
                                  value_head_dim=self.value_head_dim)
        self.cfg = self.state.config
        self.k = [torch.zeros(heads, 0, head_dim) for _ in range(batch)]
        self.v = [torch.zeros(heads, 0, self.value_head_dim) for _ in range(batch)]

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self.state.buffers

    def write(self, tokens: int, start=None, *, hold: int = 0):
        """Append ``tokens`` new random tokens per row at ``start`` (default: each row's end)."""
        from kvarn_compile.ops.append import append_

        b = len(self.k)
        start = self.state.lengths.tolist() if start is None else list(start)
        k, v = random_kv(b, self.heads, tokens, self.head_dim, bias_outlier=self.outliers,
                         value_head_dim=self.value_head_dim)
        c = self.cfg
        append_(self.buffers, k, v, torch.tensor(start), method=c.op_method, iters=c.sinkhorn_iters,
                recent=c.recent_window, hold=hold)
        for row, p in enumerate(start):
            self.k[row] = torch.cat([self.k[row][:, :p], k[row]], 1)
            self.v[row] = torch.cat([self.v[row][:, :p], v[row]], 1)
        return k, v

    def lengths(self) -> list[int]:
        return [x.shape[1] for x in self.k]


def latent_sequence(preset: str = "k4v2", *, rank: int = 64, rope: int = 16, heads: int = 1,
                    group: int = 32, max_len: int = 256, outliers: bool = False,
                    dtype: torch.dtype = torch.float32, **overrides) -> PackedSequence:
    """An empty *latent state* (absorbed multi-head latent attention: the latent, ``rank``
    channels, as the keys at the preset's key bits; the RoPE key, ``rope``, as the values at
    ``LATENT_ROPE_BITS``) with the tokens it should hold; ``outliers``: per-tile key frames
    (``key_frame="auto"``) and keys written with a huge channel (tiles stored plain)."""
    from kvarn_compile.config import LATENT_ROPE_BITS, get_config

    overrides.setdefault("key_frame", "auto" if outliers else "rotated")
    overrides.setdefault("value_bits", LATENT_ROPE_BITS)
    cfg = get_config(preset, group_size=group, **overrides)
    return PackedSequence(cfg, heads=heads, head_dim=rank, value_head_dim=rope, max_len=max_len,
                          dtype=dtype, outliers=outliers)


def latent_rows(preset: str = "k4v2", *, tq: int = 1, frames: bool = False, **kw) -> PackedSequence:
    """A :func:`latent_sequence` (group 32) with two rows of 85 and 160 tokens: row 0 a sink,
    one tile and a partial tail; row 1 a sink and four tiles, the last frozen by the write of
    the newest ``tq`` tokens (the queries), so a multi-query step needs causal bounds inside
    the tiles. ``frames``: a mix of key frames in row 1 (the tiles written with a huge latent
    channel stored plain, the later ones rotated)."""
    from kvarn_compile.state import unpack

    seq = latent_sequence(preset, outliers=frames, **kw)
    seq.write(75)
    seq.outliers = False
    seq.write(85 - tq, start=[0, 75])                # row 0 restarts, row 1 goes on
    seq.write(tq)
    f = unpack(seq.buffers)
    assert f.n_tiles.tolist() == [1, 4] and f.lengths.tolist() == [85, 160]
    if frames:
        plain = f.k_plain[1, 0, :4].bool()
        assert plain.any() and not plain.all(), "expected a mix of key frames in row 1"
    return seq


# ============================================================================ rewritten attention


def no_graph_caches():
    """A context: compile for real (no FX/AOT graph-cache hit, which would skip the lowering;
    no persisted autotune timings) but keep the compiled-kernel cache: unlike
    force_disable_caches, compiled C++/Triton kernels are reused across tests."""
    import contextlib

    from kvarn_compile._torch_compat import inductor

    stack = contextlib.ExitStack()
    stack.enter_context(inductor().config.patch(fx_graph_cache=False, autotune_local_cache=False))
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return stack


def packed_cache(*, batch=2, kv_heads=2, head_dim=16, max_len=200, prompt=150, new=1, group=32,
                 preset="k4v2", scale_dtype="float16", device="cpu", seed=0, frames=False):
    """A packed layer state holding ``prompt`` tokens of standard normal K/V, the last ``new``
    written by a second append; ``frames``: per-tile key frames, with a bias-like key
    channel in kv head 0 (plain tiles)."""
    from kvarn_compile.config import get_config
    from kvarn_compile.ops.append import append_
    from kvarn_compile.state import allocate_layer

    g = torch.Generator().manual_seed(seed)
    cfg = get_config(preset, group_size=group, scale_dtype=scale_dtype,
                     key_frame="auto" if frames else "rotated")
    st = allocate_layer(cfg, batch=batch, kv_heads=kv_heads, head_dim=head_dim, max_len=max_len,
                        dtype=torch.float32, device=device)
    first = prompt - new
    for start, n in ((0, first), (first, new)):
        if n:
            k = torch.randn(batch, kv_heads, n, head_dim, generator=g).to(device)
            v = torch.randn(batch, kv_heads, n, head_dim, generator=g).to(device)
            if frames:
                k[:, 0, :, 1] += 200.0
            append_(st.buffers, k, v, torch.full((batch,), start, device=device))
    return st


def shared_decomposition_case():
    """(the dense decomposition with its options, its arguments, the reference output) of a
    small packed cache (:func:`packed_cache`): what the ``shared`` lowering compiles once
    per geometry."""
    import functools

    from kvarn_compile.lowering import decompose
    from kvarn_compile.ops.attention import attention
    from kvarn_compile.quant.rotation import rotation_matrix

    st = packed_cache(device="cpu")
    q = torch.randn(2, 4, 24, 16)
    fn = functools.partial(decompose.attention_dense, n_buffers=len(st.buffers), has_mask=False,
                           scale=0.3, causal=True, window=0)
    args = [q, *st.buffers, rotation_matrix(16, "cpu")]
    return fn, args, attention(q, st.buffers, None, 0.3, True, 0)


# ============================================================================ tiny models
# Tiny random-weight transformers models (no hub access): 2 layers, head_dim 32, the weights
# fixed by torch.manual_seed, initializer_range raised so greedy decoding does not collapse
# onto one token. With the preset k4v2 at group_size=32 the first 32 tokens are the sink and
# tokens 32..63 the first frozen tile, so a 60-token prompt plus 6 new tokens (5 for later
# runs) freezes a tile in the middle of decoding.
