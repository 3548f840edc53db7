"""The kernel implementations of the kvarn ops against the pure-torch reference: the CUDA
path (Triton kernels + LSE merge) run on CPU tensors under TRITON_INTERPRET=1, and the
C++ CPU kernel (the whole decode step in one call) that the op dispatches to on CPU."""

import pytest
import torch

from kvarn_compile.config import get_config
from kvarn_compile.kernels import triton_available
from kvarn_compile.kernels.cpu import attention as cpu_attention
from kvarn_compile.ops import dispatch as triton_impl
from kvarn_compile.ops import append as append_ref, attention as attention_ref
from kvarn_compile.quant.quantize import QuantizedTiles, dequantize_tiles
from kvarn_compile.quant.rotation import rotation_matrix
from kvarn_compile.state import BUF, allocate_layer, unpack
from kvarn_compile.testing import reference_attention

# Triton is a dependency and conftest sets TRITON_INTERPRET=1: the Triton paths always run
# here (on CPU tensors through the interpreter), and fail rather than skip when they break.
assert triton_available(), "triton must run here (TRITON_INTERPRET=1 on CPU, or CUDA)"

G, D, H = 32, 32, 2


def _filled(lengths, preset="k4v2", **kw):
    st = allocate_layer(get_config(preset, group_size=G, **kw), batch=len(lengths), kv_heads=H,
                        head_dim=D, max_len=256, dtype=torch.float32)
    for row, n in enumerate(lengths):
        k, v = torch.randn(1, H, n, D), torch.randn(1, H, n, D)
        sub = [t[row:row + 1] for t in st.buffers]
        append_ref.append_(sub, k, v, torch.tensor([0]))
    return st


@pytest.mark.parametrize("kernel", ["triton", "cpu"])
@pytest.mark.parametrize("lengths", [[150, 97], [129, 40], [20, 200]])
@pytest.mark.parametrize("group_q", [1, 3])
@pytest.mark.parametrize("window", [0, 50])
@pytest.mark.parametrize("preset", ["k4v2", "k2v2", "k4v4"])
def test_attention_kernel_path_matches_reference(kernel, lengths, group_q, window, preset):
    if kernel == "triton" and preset != "k4v2":
        pytest.skip("bit widths are covered by tests/kernels/test_triton.py")
    st = _filled(lengths, preset)
    q = torch.randn(len(lengths), H * group_q, 1, D)
    assert triton_impl.kernel_applies(q, st.buffers, None)
    ref = attention_ref.attention(q, st.buffers, None, D ** -0.5, True, window)
    out = triton_impl.attention(q, st.buffers, None, D ** -0.5, True, window, kernel=kernel)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_cpu_op_dispatches_to_the_kernel_and_matches_the_reference(monkeypatch):
    st = _filled([200, 90])
    q = torch.randn(2, 2 * H, 1, D)
    calls = []
    real = cpu_attention.attention_state
    monkeypatch.setattr(cpu_attention, "attention_state", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = torch.ops.kvarn.attention(q, st.buffers, None, 0.2, True, 0)
    assert calls, "the CPU op did not use the C++ kernel"
    torch.testing.assert_close(out, attention_ref.attention(q, st.buffers, None, 0.2, True, 0), atol=2e-5, rtol=2e-5)
    monkeypatch.setenv("KVARN_CPU_KERNEL", "0")
    calls.clear()
    torch.ops.kvarn.attention(q, st.buffers, None, 0.2, True, 0)
    assert not calls


def test_attention_kernel_runs_under_every_mask_with_the_reference_result(monkeypatch):
    """The CUDA op's kernel applies masks per position: one that attends everywhere, one that
    hides a quantized position (the decode case no longer: ``kernel_applies`` says so), and
    a query block inside the quantized region; never the reference."""
    from kvarn_compile.kernels.triton import attention as triton_attention

    st = _filled([170, 170])
    calls = []
    real = triton_attention.kvarn_attention
    monkeypatch.setattr(triton_attention, "kvarn_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    q = torch.randn(2, H, 1, D)
    full = torch.ones(2, 1, 1, 256, dtype=torch.bool)
    hole = full.clone()
    hole[..., 40] = False
    assert triton_impl.kernel_applies(q, st.buffers, full)
    assert not triton_impl.kernel_applies(q, st.buffers, hole)
    for mask in (full, hole):
        torch.testing.assert_close(triton_impl.attention(q, st.buffers, mask, 0.2, True, 0),
                                   attention_ref.attention(q, st.buffers, mask, 0.2, True, 0),
                                   atol=2e-5, rtol=2e-5)
    q = torch.randn(2, H, 100, D)
    torch.testing.assert_close(triton_impl.attention(q, st.buffers, None, 0.2, True, 0),
                               attention_ref.attention(q, st.buffers, None, 0.2, True, 0),
                               atol=2e-5, rtol=2e-5)
    assert len(calls) == 3


def test_prefill_chunk_overlapping_tiles_falls_back():
    st = _filled([100])
    q = torch.randn(1, H, 100, D)          # queries inside the quantized region need causality
    assert not triton_impl.kernel_applies(q, st.buffers, None)


@pytest.mark.parametrize("tq", [3, 40])
def test_cpu_op_runs_the_cpp_kernel_for_queries_inside_the_quantized_region(tq, monkeypatch):
    """A prefill chunk (more than CPU_KERNEL_MAX_QUERIES queries: the multi-query path) and a
    short block whose queries need causal masking inside the tiles (the decode loop, exact
    per position) both run C++ on CPU, never the reference."""
    st = _filled([G + 3 * G + 1, G + 2 * G + 1])            # the newest tiles end after the oldest query
    q = torch.randn(2, 3 * H, tq, D)
    assert not triton_impl.kernel_applies(q, st.buffers, None)
    calls = []
    real = cpu_attention.attention_state
    monkeypatch.setattr(cpu_attention, "attention_state",
                        lambda *a, **k: calls.append(None if (r := real(*a, **k)) is None
                                                     else a[0].shape[2] > k["max_decode_queries"]) or r)
    mask = torch.rand(2, 1, tq, 256) > 0.2
    for m in (None, mask):
        out = torch.ops.kvarn.attention(q, st.buffers, m, 0.2, True, 0)
        torch.testing.assert_close(out, attention_ref.attention(q, st.buffers, m, 0.2, True, 0), atol=2e-5, rtol=2e-5)
    assert calls == [tq > triton_impl.CPU_KERNEL_MAX_QUERIES] * 2
    fp8 = _filled([150], scale_dtype="float8_e4m3fn")             # fp8 scales: the reference
    calls.clear()
    torch.ops.kvarn.attention(q[:1], fp8.buffers, None, 0.2, True, 0)
    assert calls == [None]                  # the kernel declines: the reference ran


def test_freeze_kernel_writes_the_reference_tiles():
    k, v = torch.randn(1, H, 3 * G, D), torch.randn(1, H, 3 * G, D)
    ref = allocate_layer(get_config("k4v2", group_size=G), batch=1, kv_heads=H, head_dim=D,
                         max_len=128, dtype=torch.float32)
    append_ref.append_(ref.buffers, k, v, torch.tensor([0]))
    got = allocate_layer(get_config("k4v2", group_size=G), batch=1, kv_heads=H, head_dim=D,
                         max_len=128, dtype=torch.float32)
    tk, tv = k[0, :, G:3 * G].half().float(), v[0, :, G:3 * G].half().float()   # tiles 0..1 (after the sink)
    assert triton_impl.freeze_tiles_triton(got.buffers, 0, tk, tv, 0, "kvarn", 8)
    for name in ("k_codes", "v_codes"):
        a, b = getattr(ref, name)[:, :, :2].int(), getattr(got, name)[:, :, :2].int()
        assert (a != b).float().mean() < 0.005, name        # rounding ties only


@pytest.mark.parametrize("d,dv,g,fits", [(128, 128, 128, True), (512, 64, 128, True),
                                         (256, 256, 128, True), (128, 128, 256, False),
                                         (128, 512, 128, False), (1024, 128, 128, False)])
def test_tiles_the_quantizer_does_not_fit_go_to_the_reference(d, dv, g, fits, caplog):
    """The Triton tile quantizer holds a whole fp32 tile in registers: tiles past what an
    sm_90 SM holds (``tile_fits``; static report: ptxas fails or the launch asks for more
    shared memory than an SM has) are never launched. Its launcher refuses them with a
    one-line error; the op's tile kernel declines them, said once a shape, and the reference
    quantizes them (nothing written by the kernel)."""
    from kvarn_compile.kernels import quantize_tiles_into
    from kvarn_compile.kernels.triton import append as triton_append
    from kvarn_compile.kernels.triton.quantize import tile_fits
    from kvarn_compile.state import Geometry

    assert (tile_fits("k", d, g) and tile_fits("v", dv, g)) == fits
    st = allocate_layer(get_config("k4v2", group_size=g), batch=1, kv_heads=1, head_dim=d,
                        value_head_dim=dv, max_len=2 * g, dtype=torch.float32)
    f = unpack(st.buffers)
    assert triton_impl.tiles_fit(Geometry.of(f)) == fits
    k1 = torch.zeros(1, 1, 1, d)
    assert triton_append.applies(f, k1, "kvarn", 0, False, v=torch.zeros(1, 1, 1, dv)) == fits
    if fits:
        return
    before = [t.clone() for t in st.buffers]
    tk, tv = torch.randn(1, g, d), torch.randn(1, g, dv)
    with caplog.at_level("WARNING", logger="kvarn_compile.ops"):
        assert not triton_impl.freeze_tiles_triton(st.buffers, 0, tk, tv, 0, "kvarn", 8)
        assert not triton_impl.freeze_tiles_triton(st.buffers, 0, tk, tv, 0, "kvarn", 8)
    assert all(torch.equal(a, b) for a, b in zip(before, st.buffers))
    said = [r.getMessage() for r in caplog.records if "does not fit" in r.getMessage()]
    assert len(said) <= 1 and (said or (d, dv, g) in triton_impl._UNFIT_LOGGED)
    kind, dim = ("k", d) if not tile_fits("k", d, g) else ("v", dv)
    x = torch.randn(1, 1, g, dim)
    with pytest.raises(NotImplementedError, match=r"Expected a tile the Triton quantizer fits"):
        quantize_tiles_into(x, *getattr(f, kind).core, kind=kind, bits=4 if kind == "k" else 2,
                            rotate=True, normalize=True)


# ------------------------------------------------------------------------------ C++ CPU kernel
TILE_NAMES = ("codes", "row_scale", "row_zero", "col_scale")


def _state(lengths, cfg, *, heads=H, d=D, max_len=256, dtype=torch.float32, seed=0):
    """A cache filled by one append per row (lengths[row] tokens), with uneven channels."""
    gen = torch.Generator().manual_seed(seed)
    st = allocate_layer(cfg, batch=len(lengths), kv_heads=heads, head_dim=d, max_len=max_len, dtype=dtype)
    for row, n in enumerate(lengths):
        if n:
            k = torch.randn(1, heads, n, d, generator=gen) * (0.5 + torch.rand(d, generator=gen) * 2)
            v = torch.randn(1, heads, n, d, generator=gen)
            append_ref.append_([t[row:row + 1] for t in st.buffers], k.to(dtype), v.to(dtype), torch.tensor([0]))
    return st


def _tiles(buffers):
    return ([buffers[BUF[f"k_{n}"]] for n in TILE_NAMES], [buffers[BUF[f"v_{n}"]] for n in TILE_NAMES])


def _cpu(q, buffers, scale, causal=True, window=0, mask=None, k_plain=None):
    k, v = _tiles(buffers)
    b = lambda name: buffers[BUF[name]]  # noqa: E731
    return cpu_attention.decode_attention(
        q, (b("sink_k"), b("sink_v")), k, v, (b("tail_k"), b("tail_v")), b("lengths"), b("n_tiles"),
        scale=scale, causal=causal, window=window, mask=mask, k_plain=k_plain)


def _dequantized(buffers):
    """fp64 dequantized tiles in their stored frame: K [B,H,N,D,G], V [B,H,N,G,D]."""
    k, v = _tiles(buffers)
    g, d = k[3].shape[-1], v[3].shape[-1]
    kd = dequantize_tiles(QuantizedTiles(*k, bits=8 * k[0].shape[-1] // g)).double()
    vd = dequantize_tiles(QuantizedTiles(*v, bits=8 * v[0].shape[-1] // d)).double()
    return kd, vd


def _oracle_tiles(q, buffers, scale, *, kv_start=None, k_plain=None):
    """Plain softmax attention over the dequantized tiles, in fp64 (the kit's
    ``reference_attention``), rotated value frame: a rotated key tile is scored with q @ H,
    i.e. it is the key k @ H^T in q's frame, a plain key tile (``k_plain``) with q itself.
    Every query sees every valid tile key from ``kv_start`` on; (out, lse)."""
    kd, vd = _dequantized(buffers)                                    # K [B,H,N,D,G], V [B,H,N,G,D]
    bsz, heads, n, d, g = kd.shape
    keys = kd.transpose(-1, -2)                                       # [B,H,N,G,D], stored frame
    rotated = keys @ rotation_matrix(d).double().T                    # the same keys in q's frame
    plain = torch.zeros(bsz, heads, n, dtype=torch.bool) if k_plain is None else k_plain[..., :n].bool()
    keys = torch.where(plain[..., None, None], keys, rotated).reshape(bsz, heads, n * g, d)
    n_tiles = buffers[BUF["n_tiles"]]
    return reference_attention(q, keys, vd.reshape(bsz, heads, n * g, d), lengths=n_tiles * g,
                               scale=scale, causal=False, kv_start=kv_start, return_lse=True)


def _oracle_full(q, buffers, scale, *, k_plain=None, window=0):
    """fp64 causal attention (the kit's ``reference_attention``) over sink + dequantized tiles
    (plain frame; plain key tiles as stored) + tail, from ``append_ref.materialize``."""
    kf, vf = append_ref.materialize(buffers, dtype=torch.float64)     # [B,H,cap,D], un-rotated
    s = buffers[BUF["sink_k"]].shape[2]
    kd, _ = _dequantized(buffers)
    g = kd.shape[-1]
    if k_plain is not None:
        for b, h, j in k_plain.nonzero().tolist():
            if j < int(buffers[BUF["n_tiles"]][b]):
                kf[b, h, s + j * g:s + (j + 1) * g] = kd[b, h, j].transpose(0, 1)
    return reference_attention(q, kf, vf, lengths=buffers[BUF["lengths"]], scale=scale,
                               window=window)


@pytest.mark.parametrize("kv_start", [False, True])
@pytest.mark.parametrize("plain", ["none", "zeros", "mixed", "all"])
@pytest.mark.parametrize("preset", ["k4v2", "k2v2"])
def test_cpu_tile_attention_with_plain_key_tiles_matches_torch(kv_start, plain, preset):
    st = _state([G + 5 * G + 3, G + 2 * G + 20], get_config(preset, group_size=G))
    n = st.buffers[BUF["k_codes"]].shape[2]
    q = torch.randn(2, 2 * H, 3, D)
    k_plain = {"none": None, "zeros": torch.zeros(2, H, n, dtype=torch.uint8),
               "mixed": (torch.rand(2, H, n) < 0.5).to(torch.uint8),
               "all": torch.ones(2, H, n, dtype=torch.uint8)}[plain]
    start = torch.tensor([[0, 40, 70], [5, 0, 100]]) if kv_start else None
    k, v = _tiles(st.buffers)
    q_rot = q @ rotation_matrix(D)
    out, lse = cpu_attention.tile_attention(q_rot, k, v, st.buffers[BUF["n_tiles"]], scale=0.3,
                                            kv_start=start, k_plain=k_plain, q=q)
    ref_out, ref_lse = _oracle_tiles(q, st.buffers, 0.3, kv_start=start, k_plain=k_plain)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)
    if plain == "zeros":       # all-zero flags: exactly the unflagged computation
        same = cpu_attention.tile_attention(q_rot, k, v, st.buffers[BUF["n_tiles"]], scale=0.3, kv_start=start)
        assert torch.equal(out, same[0]) and torch.equal(lse, same[1])
    if plain != "none":        # q derived from q_rot when not given
        again = cpu_attention.tile_attention(q_rot, k, v, st.buffers[BUF["n_tiles"]], scale=0.3,
                                             kv_start=start, k_plain=k_plain)
        torch.testing.assert_close(again[0], out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 70])
def test_cpu_decode_attention_with_plain_key_tiles_matches_torch(window):
    st = _state([G + 5 * G + 3, G + 4 * G, 40], get_config("k4v2", group_size=G))
    n = st.buffers[BUF["k_codes"]].shape[2]
    q = torch.randn(3, 2 * H, 2, D)
    k_plain = (torch.rand(3, H, n) < 0.5).to(torch.uint8)
    out = _cpu(q, st.buffers, 0.2, window=window, k_plain=k_plain)
    torch.testing.assert_close(out.double(), _oracle_full(q, st.buffers, 0.2, k_plain=k_plain, window=window),
                               atol=2e-5, rtol=1e-5)
    plain_off = _cpu(q, st.buffers, 0.2, window=window, k_plain=torch.zeros_like(k_plain))
    assert torch.equal(plain_off, _cpu(q, st.buffers, 0.2, window=window))
    torch.testing.assert_close(plain_off, attention_ref.attention(q, st.buffers, None, 0.2, True, window),
                               atol=2e-5, rtol=2e-5)


# cache layouts: (preset, overrides, model dtype, head dim). Code rows of a multiple of 16
# bytes take the in-register unpack loops, others (3-bit, short rows) the byte-unpack path.
LAYOUTS = {
    "k4v2": ("k4v2", {}, torch.float32, D),
    "k2v2-g64": ("k2v2", {"group_size": 64}, torch.float32, D),
    "k4v4-d16": ("k4v4", {}, torch.float32, 16),
    "k3v3": ("k4v2", {"key_bits": 3, "value_bits": 3}, torch.float32, D),
    "k8v4": ("k4v2", {"key_bits": 8, "value_bits": 4}, torch.float32, D),
    "k2v8": ("k4v2", {"key_bits": 2, "value_bits": 8}, torch.float32, D),
    "k3v2-d64": ("k4v2", {"key_bits": 3}, torch.float32, 64),
    "k2v2-d64-g64": ("k2v2", {"group_size": 64}, torch.float32, 64),
    "k4v4-d64": ("k4v4", {}, torch.float32, 64),
    "k4v2-d128-g128": ("k4v2", {"group_size": 128}, torch.float32, 128),
    "k4v2-d80": ("k4v2", {}, torch.float32, 80),            # Paley rotation: H != H.T
    "k4v2-d96-bf16": ("k4v2", {}, torch.bfloat16, 96),
    "k4v2-fp16": ("k4v2", {}, torch.float16, D),
    "bf16-scales": ("k4v2", {"scale_dtype": "bfloat16"}, torch.float32, D),
    "fp32-scales": ("k2v2", {"scale_dtype": "float32", "exact_dtype": "float32"}, torch.float32, D),
    "no-sink": ("k4v2", {"sink_tokens": 0}, torch.float32, D),
    "two-tile-sink": ("k4v2", {"sink_tokens": 2 * G}, torch.float32, D),
    "recent": ("k4v2", {"recent_window": G}, torch.float32, D),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("tq", [1, 4, 16])
@pytest.mark.parametrize("window", [0, 45])
def test_cpu_kernel_path_matches_reference_across_layouts(layout, tq, window):
    preset, over, dtype, d = LAYOUTS[layout]
    cfg = get_config(preset, **{"group_size": G, **over})
    g = cfg.group_size
    s = cfg.sink
    # rows: several tiles + a partial tail, the query in the tile this append froze,
    # sink only, and a short sink
    lengths = [s + 3 * g + 17, s + 2 * g, s + 5, 9]
    st = _state(lengths, cfg, d=d, dtype=dtype, max_len=s + 4 * g + 40)
    q = torch.randn(len(lengths), 3 * H, tq, d).to(dtype)
    if tq == 1:        # decoding: every row's quantized tokens are visible to its query
        assert triton_impl.kernel_applies(q, st.buffers, None)
    ref = attention_ref.attention(q, st.buffers, None, d ** -0.5, True, window)
    out = triton_impl.attention(q, st.buffers, None, d ** -0.5, True, window, kernel="cpu")
    tol = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    # the kernel itself, with fp32 queries, also where the dispatcher would not use it
    # (queries inside the quantized region: causal masking within tiles)
    q32 = q.float()
    torch.testing.assert_close(_cpu(q32, st.buffers, d ** -0.5, window=window),
                               attention_ref.attention(q32, st.buffers, None, d ** -0.5, True, window).float(),
                               atol=2e-5, rtol=2e-5)


def test_cpu_kernel_query_in_the_tile_frozen_by_its_own_append_takes_the_kernel_path():
    st = _state([G + 4 * G, G + 2 * G], get_config("k4v2", group_size=G))
    assert st.buffers[BUF["n_tiles"]].tolist() == [4, 2]     # the newest token is quantized
    q = torch.randn(2, 2 * H, 1, D)
    assert triton_impl.kernel_applies(q, st.buffers, None)
    torch.testing.assert_close(triton_impl.attention(q, st.buffers, None, 0.2, True, 0, kernel="cpu"),
                               attention_ref.attention(q, st.buffers, None, 0.2, True, 0), atol=2e-5, rtol=2e-5)
    q2 = torch.randn(2, 2 * H, 2, D)                          # the older query sees only part of it
    assert not triton_impl.kernel_applies(q2, st.buffers, None)


@pytest.mark.parametrize("kind", ["bool", "float", "half"])
@pytest.mark.parametrize("tq", [1, 5])
def test_cpu_kernel_masks_indexed_by_absolute_position(kind, tq):
    lengths = [G + 3 * G + 21, G + 2 * G + 9]
    st = _state(lengths, get_config("k4v2", group_size=G))
    gen = torch.Generator().manual_seed(3)
    keep = torch.rand(2, 1, tq, 256, generator=gen) > 0.3
    keep[..., G:G + 3 * G] = True                           # the quantized region: all attend
    mask = keep if kind == "bool" else torch.where(keep, torch.rand(keep.shape, generator=gen), float("-inf"))
    if kind != "bool":
        mask[..., G:G + 3 * G] = 0.0
    if kind == "half":
        mask = mask.half()
    q = torch.randn(2, 2 * H, tq, D)
    assert triton_impl.kernel_applies(q, st.buffers, mask)
    ref = attention_ref.attention(q, st.buffers, mask, 0.25, True, 0)
    torch.testing.assert_close(triton_impl.attention(q, st.buffers, mask, 0.25, True, 0, kernel="cpu"), ref,
                               atol=2e-5, rtol=2e-5)
    # masks that also hide quantized positions, per head: the kernel masks tiles too
    keep = torch.rand(2, 2 * H, tq, 256, generator=gen) > 0.3
    mask = keep if kind == "bool" else torch.where(keep, torch.randn(keep.shape, generator=gen), float("-inf"))
    torch.testing.assert_close(_cpu(q, st.buffers, 0.25, mask=mask),
                               attention_ref.attention(q, st.buffers, mask, 0.25, True, 0), atol=2e-5, rtol=2e-5)


def test_cpu_kernel_not_causal_empty_rows_and_thread_counts():
    st = _state([G + 3 * G + 7, 0, G + 1], get_config("k4v2", group_size=G))
    q = torch.randn(3, 2 * H, 2, D)
    for causal in (True, False):
        ref = attention_ref.attention(q, st.buffers, None, 0.3, causal, 0)
        out = _cpu(q, st.buffers, 0.3, causal=causal)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert (out[1] == 0).all()                              # an empty row sees nothing
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _cpu(q, st.buffers, 0.3)
    finally:
        torch.set_num_threads(n)
    torch.testing.assert_close(one, _cpu(q, st.buffers, 0.3), atol=1e-6, rtol=1e-6)


def test_cpu_kernel_path_falls_back_for_fp8_scales_fp64_caches_and_bad_queries():
    st = _state([G + 3 * G + 7], get_config("k4v2", group_size=G, scale_dtype="float8_e4m3fn"))
    q = torch.randn(1, 2 * H, 1, D)
    assert not triton_impl.kernel_applies(q, st.buffers, None)
    torch.testing.assert_close(triton_impl.attention(q, st.buffers, None, 0.2, True, 0, kernel="cpu"),
                               attention_ref.attention(q, st.buffers, None, 0.2, True, 0))
    st = _state([G + 3 * G + 7], get_config("k4v2", group_size=G), dtype=torch.float64)
    q = torch.randn(1, 2 * H, 1, D, dtype=torch.float64)
    assert triton_impl.kernel_applies(q, st.buffers, None)
    torch.testing.assert_close(triton_impl.attention(q, st.buffers, None, 0.2, True, 0, kernel="cpu"),
                               attention_ref.attention(q, st.buffers, None, 0.2, True, 0))
    with pytest.raises(ValueError, match="expected queries"):
        triton_impl.attention(torch.randn(1, 2 * H - 1, 1, D), st.buffers, None, 0.2, True, 0, kernel="cpu")


@pytest.mark.parametrize("where", ["tile", "sink", "tail"])
def test_cpu_kernel_nan_keys_poison_exactly_the_rows_that_see_them(where):
    """Like the reference: a query that sees a NaN key reads NaN (all channels); one that
    cannot (sliding window, other batch row) is untouched. A whole NaN tile is not dropped."""
    st = _state([G + 4 * G + 10, G + 4 * G + 10], get_config("k4v2", group_size=G))
    b = st.buffers
    if where == "tile":
        b[BUF["k_col_scale"]][0, 1, 0] = float("nan")      # the whole tile 0 of head 1, row 0
    elif where == "sink":
        b[BUF["sink_k"]][0, 1, 3] = float("nan")
    else:
        b[BUF["tail_k"]][0, 1, 2] = float("nan")
    q = torch.randn(2, 2 * H, 1, D)
    for window in (0, 60):
        ref = attention_ref.attention(q, b, None, 0.2, True, window)
        out = triton_impl.attention(q, b, None, 0.2, True, window, kernel="cpu")
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5, equal_nan=True)
        seen = where == "tail" or window == 0
        assert bool(out[0, 2:].isnan().all()) == seen        # q heads 2, 3 read kv head 1
        assert not out[0, :2].isnan().any() and not out[1].isnan().any()


# ------------------------------------------------------------------------------ build failures
def test_a_failed_kernel_build_is_an_error_under_require_and_a_warning_otherwise(monkeypatch, caplog):
    """CI runs with KVARN_CPU_KERNEL=require (conftest): a kernel that does not build fails
    the tests. Users keep the reference with a warning that names the build error."""
    def broken():
        raise OSError("c++: command not found")

    monkeypatch.setattr(cpu_attention, "_module", broken)
    cpu_attention._built.cache_clear()
    try:
        monkeypatch.setenv("KVARN_CPU_KERNEL", "require")
        with pytest.raises(cpu_attention.KernelBuildError, match="c\\+\\+: command not found"):
            cpu_attention.available()
        cpu_attention._built.cache_clear()
        monkeypatch.setenv("KVARN_CPU_KERNEL", "1")
        with caplog.at_level("WARNING", logger="kvarn_compile.kernels.cpu.attention"):
            assert cpu_attention.available() is False
        assert "c++: command not found" in caplog.text and "reference" in caplog.text
        st = _filled([200, 90])
        q = torch.randn(2, 2 * H, 1, D)
        torch.testing.assert_close(torch.ops.kvarn.attention(q, st.buffers, None, 0.2, True, 0),
                                   attention_ref.attention(q, st.buffers, None, 0.2, True, 0))
    finally:
        monkeypatch.undo()
        cpu_attention._built.cache_clear()
    assert cpu_attention.available()          # the real build is back


def test_the_cpu_kernel_builds_here():
    """The shipped fast path builds on this machine (this fails, never skips, when it does not)."""
    module = cpu_attention.build()
    assert hasattr(module, "kvarn_attention")


def test_freeze_kernel_writes_the_reference_key_frames():
    """key_frame="auto": the Triton freeze picks each K tile's frame like the reference and
    quantizes plain tiles with per-channel RTN (no rotation), the others with KVarN."""
    cfg = get_config("k4v2", group_size=G, key_frame="auto")
    k, v = torch.randn(1, H, 4 * G, D), torch.randn(1, H, 4 * G, D)
    k[:, 0, 2 * G:, 5] += 300.0                        # head 0, tiles 1..2: a bias-like channel
    ref = allocate_layer(cfg, batch=1, kv_heads=H, head_dim=D, max_len=160, dtype=torch.float32)
    append_ref.append_(ref.buffers, k, v, torch.tensor([0]))
    got = allocate_layer(cfg, batch=1, kv_heads=H, head_dim=D, max_len=160, dtype=torch.float32)
    tk, tv = k[0, :, G:4 * G].half().float(), v[0, :, G:4 * G].half().float()
    assert triton_impl.freeze_tiles_triton(got.buffers, 0, tk, tv, 0, "kvarn", 8)
    assert ref.k_plain[0, :, :3].tolist() == [[0, 1, 1], [0, 0, 0]]
    assert torch.equal(got.k_plain[0, :, :3], ref.k_plain[0, :, :3])
    for name in ("k_codes", "v_codes"):
        a, b = getattr(ref, name)[:, :, :3].int(), getattr(got, name)[:, :, :3].int()
        assert (a != b).float().mean() < 0.005, name        # rounding ties only
    torch.testing.assert_close(got.k_row_scale[:, :, :3], ref.k_row_scale[:, :, :3], rtol=2e-3, atol=0)


# ------------------------------------------------------------------------------ append fast path
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_decode_append_is_the_reference_append(dtype, monkeypatch):
    """The C++ decode-step append (every row continues, no tile completes) leaves exactly the
    state the reference append leaves, step by step, through tile freezes (reference), new
    sequences, multi-token writes and a batch row that restarts."""
    cfg = get_config("k4v2", group_size=G)
    fast, ref = (allocate_layer(cfg, batch=2, kv_heads=H, head_dim=D, max_len=200, dtype=dtype)
                 for _ in range(2))
    calls = []
    real = cpu_attention.append_decode
    monkeypatch.setattr(cpu_attention, "append_decode",
                        lambda *a, **kw: calls.append(r := real(*a, **kw)) or r)
    gen = torch.Generator().manual_seed(0)
    plan = [(0, 20), (20, 1), (21, 3)] + [(24 + i, 1) for i in range(60)] + [(84, 2), (0, 5), (5, 1)]
    for start, t in plan:
        k = (torch.randn(2, H, t, D, generator=gen) * 3).to(dtype)
        v = torch.randn(2, H, t, D, generator=gen).to(dtype)
        pos = torch.full((2,), start, dtype=torch.long)
        torch.ops.kvarn.append_(fast.buffers, k, v, pos, "kvarn", 8, 0, 0, False, "x")
        append_ref.append_(ref.buffers, k, v, pos)
        for name, a, b in zip(ref.fields.named(), fast.buffers, ref.buffers):
            assert torch.equal(a, b) if not a.is_floating_point() else \
                torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (start, t, name)
    # both paths were taken: the C++ append (from Python, or as the op's native kernel, which
    # never reaches Python) and the reference
    assert calls.count(True) + len(plan) - len(calls) >= 50 and calls.count(False) >= 3


def test_native_append_kernel_keeps_decode_steps_out_of_python_and_leaves_the_rest_to_it(monkeypatch):
    """Once the C++ kernel is built, ``kvarn::append_`` / ``append_from_`` run the decode-step
    append natively (``csrc/ops.cpp``): a decode step reaches no Python, the state equals the
    reference's. A tile that completes, a bad method, ``KVARN_CPU_KERNEL=0`` and an
    ``append_from_`` whose model cache was not released by this process all go to the Python
    kernels, which do what they always did."""
    from kvarn_compile.ops import buffers as buffers_mod

    cfg = get_config("k4v2", group_size=G)
    fast, ref = (allocate_layer(cfg, batch=1, kv_heads=H, head_dim=D, max_len=200,
                                dtype=torch.float32) for _ in range(2))
    calls = []
    real = cpu_attention.append_decode
    monkeypatch.setattr(cpu_attention, "append_decode",
                        lambda *a, **kw: calls.append(r := real(*a, **kw)) or r)
    gen = torch.Generator().manual_seed(1)
    kv = lambda t: (torch.randn(1, H, t, D, generator=gen), torch.randn(1, H, t, D, generator=gen))  # noqa: E731

    def both(start, t, method="kvarn"):
        k, v = kv(t)
        pos = torch.tensor([start])
        torch.ops.kvarn.append_(fast.buffers, k, v, pos, method, 8, 0, 0, False, "x")
        append_ref.append_(ref.buffers, k, v, pos)
        for a, b in zip(fast.buffers, ref.buffers):
            assert torch.equal(a, b)

    both(0, 10)                                   # a new sequence: Python (registers the kernel)
    seen = len(calls)
    for p in range(10, 20):
        both(p, 1)
    assert len(calls) == seen                     # ten decode steps, none reached Python
    with pytest.raises(ValueError, match="method"):
        both(20, 1, "kivi")
    monkeypatch.setenv("KVARN_CPU_KERNEL", "0")
    both(20, 1)                                   # the reference (kernel off), state equal
    monkeypatch.delenv("KVARN_CPU_KERNEL")
    # append_from_: a model cache this process never released may hold a prompt to adopt
    cache = torch.zeros(1, H, 200, D)
    k, v = kv(1)
    seen = len(calls)
    torch.ops.kvarn.append_from_(fast.buffers, k, v, torch.tensor([21]), "kvarn", 8, 0, 0, False,
                                 "x", cache, cache, False)
    assert len(calls) == seen + 1                 # Python ran it
    assert buffers_mod.releasable(cache)          # a whole CPU buffer on Linux
    buffers_mod.release_storage(cache)            # released: nothing to adopt, native again
    k, v = kv(1)
    torch.ops.kvarn.append_from_(fast.buffers, k, v, torch.tensor([22]), "kvarn", 8, 0, 0,
                                 False, "x", cache, cache, True)
    assert len(calls) == seen + 1
    cache.add_(0)                                 # written since its release: Python again
    k, v = kv(1)
    torch.ops.kvarn.append_from_(fast.buffers, k, v, torch.tensor([23]), "kvarn", 8, 0, 0,
                                 False, "x", cache, cache, True)
    assert len(calls) == seen + 2
    assert unpack(fast.buffers).lengths.tolist() == [24]


def test_cpu_decode_append_leaves_errors_to_the_reference():
    """Writes the fast path does not take raise the reference's errors, state unchanged."""
    cfg = get_config("k4v2", group_size=G)
    st = allocate_layer(cfg, batch=1, kv_heads=H, head_dim=D, max_len=70, dtype=torch.float32)
    torch.ops.kvarn.append_(st.buffers, torch.randn(1, H, 69, D), torch.randn(1, H, 69, D),
                            torch.tensor([0]), "kvarn", 8, 0, 0, False, "x")
    before = [t.clone() for t in st.buffers]
    with pytest.raises(ValueError, match="allocated for 70"):
        torch.ops.kvarn.append_(st.buffers, torch.randn(1, H, 2, D), torch.randn(1, H, 2, D),
                                torch.tensor([69]), "kvarn", 8, 0, 0, False, "x")
    with pytest.raises(ValueError, match="float16 high-precision"):
        torch.ops.kvarn.append_(st.buffers, torch.full((1, H, 1, D), 1e6), torch.randn(1, H, 1, D),
                                torch.tensor([69]), "kvarn", 8, 0, 0, False, "x")
    with pytest.raises(ValueError, match="method"):
        torch.ops.kvarn.append_(st.buffers, torch.randn(1, H, 1, D), torch.randn(1, H, 1, D),
                                torch.tensor([69]), "kivi", 8, 0, 0, False, "x")
    assert all(torch.equal(a, b) for a, b in zip(st.buffers, before))


def test_the_cpp_kernels_index_the_state_as_state_py_lays_it_out():
    """The C++ kernels read a state's flat buffer list by position (``csrc/kvarn_common.h``):
    their member order is ``state.BASE_FIELDS``, or they would read and write the wrong
    buffers without a word."""
    from kvarn_compile.state import BASE_FIELDS

    assert cpu_attention.state_members() == list(BASE_FIELDS)
