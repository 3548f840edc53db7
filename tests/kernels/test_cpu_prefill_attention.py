"""The C++ multi-query attention (``kernels/cpu/attention.py``: ``decode_attention(...,
many=True)``, a prefill chunk over the packed cache) against the pure-torch reference
``ops/attention.py``: queries inside the quantized region (causal within tiles), odd chunk
lengths across tile boundaries, GQA, sliding windows, masks, every preset and cache layout,
values of another head dim than the keys (MLA decompressed; more in
``test_cpu_value_head_dim.py``)."""

import pytest
import torch

from kvarn_compile.config import get_config
from kvarn_compile.kernels.cpu import attention as cpu_attention
from kvarn_compile.ops import append as append_ref, attention as attention_ref
from kvarn_compile.state import BUF, allocate_layer, unpack
from kvarn_compile.testing.oracles import oracle_attention

G, D, H = 32, 32, 2
TILE_NAMES = ("codes", "row_scale", "row_zero", "col_scale")
TOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _chunked(past, chunk, cfg, *, heads=H, d=D, dtype=torch.float32, seed=0, max_len=None, dv=None):
    """A cache that holds ``past[row]`` tokens, then a chunk of ``chunk`` more per row (two
    appends, as a chunked prefill writes them), with uneven key channels; values of head
    dim ``dv`` (default ``d``)."""
    gen = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    max_len = max_len or max(past) + chunk + 2 * cfg.group_size
    st = allocate_layer(cfg, batch=len(past), kv_heads=heads, head_dim=d, value_head_dim=dv,
                        max_len=max_len, dtype=dtype)
    for row, n in enumerate(past):
        sub = [t[row:row + 1] for t in st.buffers]
        start = 0
        for size in (n, chunk):
            if not size:
                continue
            k = torch.randn(1, heads, size, d, generator=gen) * (0.5 + torch.rand(d, generator=gen) * 2) + 0.3
            v = torch.randn(1, heads, size, dv, generator=gen)
            append_ref.append_(sub, k.to(dtype), v.to(dtype), torch.tensor([start]))
            start += size
    return st


def _many(q, buffers, scale, causal=True, window=0, mask=None):
    b = lambda name: buffers[BUF[name]]  # noqa: E731
    k = [b(f"k_{n}") for n in TILE_NAMES]
    v = [b(f"v_{n}") for n in TILE_NAMES]
    return cpu_attention.decode_attention(
        q, (b("sink_k"), b("sink_v")), k, v, (b("tail_k"), b("tail_v")), b("lengths"), b("n_tiles"),
        scale=scale, causal=causal, window=window, mask=mask, k_plain=unpack(buffers).k_plain,
        many=True)


def _check(q, st, *, scale=None, causal=True, window=0, mask=None, tol=2e-5):
    """The kernel equals the reference within ``tol``; for head dims above 64, where both
    sum long fp32 dot products in different orders (the output's channel 0 sums all
    rotated channels), it may instead be as close to the fp64 oracle as the reference."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ref = attention_ref.attention(q.float(), st.buffers, mask, scale, causal, window).float()
    out = _many(q.float(), st.buffers, scale, causal, window, mask)
    assert out.shape == (*q.shape[:-1], ref.shape[-1]) and out.dtype == torch.float32
    close = torch.allclose(out, ref, atol=tol, rtol=tol, equal_nan=True)
    if max(q.shape[-1], out.shape[-1]) <= 64 or close:
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol, equal_nan=True)
        return out
    orc = oracle_attention(q.float(), st.buffers, mask, scale=scale, causal=causal, window=window)
    ref_err = (ref.double() - orc).abs().max().item()
    err = (out.double() - orc).abs().max().item()
    assert err <= 1.5 * ref_err + 1e-6, f"kernel error {err:.3g} vs the reference's {ref_err:.3g} (D={q.shape[-1]})"
    return out


@pytest.mark.parametrize("preset", ["k4v2", "k4v4", "k2v2"])
@pytest.mark.parametrize("tq", [1, 17, 37, 100])
@pytest.mark.parametrize("group_q", [1, 3])
@pytest.mark.parametrize("window", [0, 45])
def test_prefill_chunk_after_a_packed_past_matches_the_reference(preset, tq, group_q, window):
    # rows: a packed past and a chunk that freezes tiles of its own; a chunk that starts in
    # the sink; a past that ends mid-tile
    past = [3 * G + 5, 0, 2 * G]
    st = _chunked(past, tq, get_config(preset, group_size=G))
    assert int(st.buffers[BUF["n_tiles"]].max()) > 0
    q = torch.randn(len(past), H * group_q, tq, D)
    _check(q, st, window=window)


LAYOUTS = {   # (preset, overrides, model dtype, head dim or (key, value) head dims)
    "k3v3": ("k4v2", {"key_bits": 3, "value_bits": 3}, torch.float32, D),
    "k8v4": ("k4v2", {"key_bits": 8, "value_bits": 4}, torch.float32, D),
    "k4v4-d16": ("k4v4", {}, torch.float32, 16),
    "k2v2-d64-g64": ("k2v2", {"group_size": 64}, torch.float32, 64),
    "k4v2-d128-g128": ("k4v2", {"group_size": 128}, torch.float32, 128),
    "k4v2-d80": ("k4v2", {}, torch.float32, 80),            # Paley rotation: H != H.T
    "k4v2-d96-bf16": ("k4v2", {}, torch.bfloat16, 96),
    "k4v2-fp16": ("k4v2", {}, torch.float16, D),
    "bf16-scales": ("k4v2", {"scale_dtype": "bfloat16"}, torch.float32, D),
    "fp32-scales": ("k2v2", {"scale_dtype": "float32", "exact_dtype": "float32"}, torch.float32, D),
    "no-sink": ("k4v2", {"sink_tokens": 0}, torch.float32, D),
    "two-tile-sink": ("k4v2", {"sink_tokens": 2 * G}, torch.float32, D),
    "recent": ("k4v2", {"recent_window": G}, torch.float32, D),
    "key-frames": ("k4v2", {"key_frame": "auto"}, torch.float32, D),
    "mla-d192-dv128": ("k4v2", {}, torch.float32, (192, 128)),       # MLA decompressed
    "dv-wider-k4v4-fp16": ("k4v4", {}, torch.float16, (D, 64)),
    "dv-k3v3": ("k4v2", {"key_bits": 3, "value_bits": 3}, torch.float32, (64, 32)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_prefill_chunk_across_cache_layouts(layout):
    preset, over, dtype, d = LAYOUTS[layout]
    d, dv = d if isinstance(d, tuple) else (d, d)
    cfg = get_config(preset, **{"group_size": G, **over})
    g = cfg.group_size
    past = [2 * g + 7, g + 3]
    tq = g + 19                       # crosses tile boundaries, not a multiple of anything
    st = _chunked(past, tq, cfg, d=d, dtype=dtype, dv=dv)
    if layout == "key-frames":        # a real mix of plain and rotated key tiles
        kp = unpack(st.buffers).k_plain
        kp.copy_((torch.rand(kp.shape) < 0.5).to(kp.dtype))
    q = torch.randn(len(past), 3 * H, tq, d).to(dtype)
    _check(q, st, window=0)
    _check(q, st, window=g + 5)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("per_head", [False, True])
def test_prefill_chunk_masks_indexed_by_absolute_position(kind, per_head):
    past, tq = [3 * G + 10, 2 * G + 1], 45
    st = _chunked(past, tq, get_config("k4v2", group_size=G))
    gen = torch.Generator().manual_seed(5)
    m = st.buffers[BUF["k_codes"]].shape[2] * G + G + 64
    heads = 3 * H if per_head else 1
    # the model's causal mask (as HF passes it with a StaticCache), then holes everywhere
    qpos = st.buffers[BUF["lengths"]][:, None] - tq + torch.arange(tq)[None, :]       # [B, Tq]
    causal = torch.arange(m)[None, None, :] <= qpos[:, :, None]                       # [B, Tq, M]
    q = torch.randn(2, 3 * H, tq, D)
    for holes in (False, True):
        keep = causal[:, None].expand(2, heads, tq, m).clone()
        if holes:
            keep &= torch.rand(2, heads, tq, m, generator=gen) > 0.3
        mask = keep if kind == "bool" else torch.where(keep, torch.randn(keep.shape, generator=gen), float("-inf"))
        for causal_flag in (True, False):
            _check(q, st, scale=0.25, causal=causal_flag, mask=mask)


def test_not_causal_empty_rows_short_rows_and_thread_counts():
    st = _chunked([3 * G + 7, 0, 5], 20, get_config("k4v2", group_size=G))
    st.buffers[BUF["lengths"]][1] = 0                         # an empty row
    for name in ("committed", "n_tiles"):
        st.buffers[BUF[name]][1] = 0
    q = torch.randn(3, 2 * H, 40, D)                          # more queries than row 2 holds
    for causal in (True, False):
        out = _check(q, st, scale=0.3, causal=causal)
    assert (out[1] == 0).all()                                # an empty row sees nothing
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _many(q, st.buffers, 0.3)
    finally:
        torch.set_num_threads(n)
    torch.testing.assert_close(one, _many(q, st.buffers, 0.3), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("where", ["tile", "sink", "tail"])
def test_nan_keys_poison_the_rows_that_see_them(where):
    st = _chunked([G + 3 * G + 10, G + 3 * G + 10], 30, get_config("k4v2", group_size=G))
    b = st.buffers
    if where == "tile":
        b[BUF["k_col_scale"]][0, 1, 0] = float("nan")          # tile 0 of head 1, row 0
    elif where == "sink":
        b[BUF["sink_k"]][0, 1, 3] = float("nan")
    else:
        b[BUF["tail_k"]][0, 1, 2] = float("nan")
    q = torch.randn(2, 2 * H, 30, D)
    for window in (0, 60):
        out = _check(q, st, scale=0.2, window=window)
        assert not out[0, :2].isnan().any() and not out[1].isnan().any()
        assert out[0, 2:].isnan().any() == (where == "tail" or window == 0)


def test_a_long_chunk_matches_the_decode_loop_and_the_reference():
    """Many tasks per (row, head): the query blocks of one chunk together equal the decode
    step's loop over the same queries (both exact)."""
    cfg = get_config("k4v2", group_size=G)
    st = _chunked([4 * G + 9], 300, cfg, max_len=4 * G + 9 + 300 + G)
    q = torch.randn(1, 3 * H, 300, D)
    out = _check(q, st, scale=0.2)
    b = lambda name: st.buffers[BUF[name]]  # noqa: E731
    loop = cpu_attention.decode_attention(
        q, (b("sink_k"), b("sink_v")), [b(f"k_{n}") for n in TILE_NAMES], [b(f"v_{n}") for n in TILE_NAMES],
        (b("tail_k"), b("tail_v")), b("lengths"), b("n_tiles"), scale=0.2)
    torch.testing.assert_close(out, loop, atol=2e-5, rtol=2e-5)
