"""The C++ CPU kernels on a cache whose values have another head dim than the keys
(multi-head latent attention decompressed: keys and queries D = 192, values Dv = 128).

Scores run over D (q, sink_k / tail_k, K tiles in the D-sized rotated frame), outputs over
Dv (sink_v / tail_v, V tiles in the Dv-sized frame, the output). Checked against the
pure-torch reference (``ops/attention.py``, ``ops/append.py``):

* the decode step (Tq = 1, GQA with 2 query heads per kv head) and the multi-query path
  (Tq = 40, causal; ``many=True``) of ``decode_attention``, direct and through
  ``torch.ops.kvarn.attention``, with the sink, packed tiles and tail all populated and
  a mix of plain and rotated key tiles (per-tile key frames);
* the tiles-only ``tile_attention`` (its output in the values' rotated frame);
* the append: tokens one at a time through ``torch.ops.kvarn.append_`` (the C++ decode
  append, and the C++ tile quantizer where a tile freezes) against the reference append:
  the same packed state bit for bit;
* a Dv = D cache stays on the same code (the (64, 64) cases) and mismatched buffers are
  refused, never read with the wrong geometry.
"""

import pytest
import torch

import kvarn_compile.ops  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile.config import get_config
from kvarn_compile.kernels.cpu import attention as cpu_attention, quantize as cpu_quantize
from kvarn_compile.ops import append as append_ref, attention as attention_ref
from kvarn_compile.quant.rotation import rotation_matrix
from kvarn_compile.state import BUF, allocate_layer, unpack
from kvarn_compile.testing.oracles import oracle_attention

G, H = 128, 2
DIMS = [(192, 128), (64, 128), (64, 64)]       # (key head dim D, value head dim Dv)
PRESETS = ["k4v2", "k4v4"]
TILE_NAMES = ("codes", "row_scale", "row_zero", "col_scale")
LENGTHS = (600, 470)          # sink 128 + 3 tiles + 88 in the tail; sink + 2 tiles + 86
TOL = 2e-5


def _assert_matches(out, ref, q, buffers, *, scale, causal=True, window=0, mask=None, what=""):
    """The kernel equals the reference within TOL; where a head dim is above 64, where both
    sum long fp32 dot products in different orders (the rotation back sums all Dv rotated
    channels into each output channel), it may instead be as close to the fp64 oracle
    (plain softmax attention over the dequantized cache) as the reference is."""
    assert out.shape == ref.shape and out.dtype == torch.float32, what
    if torch.allclose(out, ref, atol=TOL, rtol=TOL) or max(q.shape[-1], out.shape[-1]) <= 64:
        torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL, msg=lambda m: f"{what}: {m}")
        return
    orc = oracle_attention(q.float(), buffers, mask, scale=scale, causal=causal, window=window)
    ref_err = (ref.double() - orc).abs().max().item()
    err = (out.double() - orc).abs().max().item()
    assert err <= 1.5 * ref_err + 1e-6, f"{what}: kernel error {err:.3g} vs the reference's {ref_err:.3g}"


def _state(cfg, d, dv, *, lengths=LENGTHS, heads=H, dtype=torch.float32, seed=0):
    """A cache holding ``lengths[row]`` tokens per row (written by the reference append in
    two chunks), keys with uneven channels; head 0 of row 0 has a bias-like key channel
    from token 300 on, so that some of its tiles are stored in the plain key frame."""
    gen = torch.Generator().manual_seed(seed)
    st = allocate_layer(cfg, batch=len(lengths), kv_heads=heads, head_dim=d, value_head_dim=dv,
                        max_len=max(lengths) + G, dtype=dtype)
    for row, n in enumerate(lengths):
        k = torch.randn(1, heads, n, d, generator=gen) * (0.2 + 0.5 * torch.rand(d, generator=gen)) + 0.3
        v = torch.randn(1, heads, n, dv, generator=gen) * (0.5 + torch.rand(dv, generator=gen))
        if row == 0:      # > 16x the median channel range: the dominance rule picks plain
            k[0, 0, 300:, 5] += 60.0
        sub = [t[row:row + 1] for t in st.buffers]
        for lo, hi in ((0, n - 37), (n - 37, n)):
            append_ref.append_(sub, k[:, :, lo:hi].to(dtype), v[:, :, lo:hi].to(dtype), torch.tensor([lo]))
    return st


def _kernel(q, buffers, scale, *, many, causal=True, window=0, k_plain="state"):
    b = lambda name: buffers[BUF[name]]  # noqa: E731
    return cpu_attention.decode_attention(
        q, (b("sink_k"), b("sink_v")), [b(f"k_{n}") for n in TILE_NAMES],
        [b(f"v_{n}") for n in TILE_NAMES], (b("tail_k"), b("tail_v")), b("lengths"), b("n_tiles"),
        scale=scale, causal=causal, window=window,
        k_plain=unpack(buffers).k_plain if k_plain == "state" else k_plain, many=many)


def _assert_layout(st, d, dv, cfg):
    f = unpack(st.buffers)
    assert f.sink_k.shape[-1] == d and f.sink_v.shape[-1] == dv and f.tail_v.shape[-1] == dv
    assert f.v.col_scale.shape[-1] == dv and f.v.codes.shape[-1] == dv * cfg.value_bits // 8
    assert st.n_tiles.tolist() == [3, 2]                         # sink + tiles + tail populated
    assert int(st.lengths[0]) > cfg.sink + 3 * G                 # a non-empty tail
    plain = f.k_plain
    assert plain is not None and plain[0, 0, 2] == 1 and plain[1].sum() == 0   # both key frames


@pytest.fixture(scope="module")
def states():
    return {}


def _cached(states, preset, d, dv):
    key = (preset, d, dv)
    if key not in states:
        cfg = get_config(preset, group_size=G)
        states[key] = (cfg, _state(cfg, d, dv))
    return states[key]


@pytest.mark.parametrize("d,dv", DIMS)
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("tq", [1, 40])
def test_attention_matches_the_reference(monkeypatch, states, preset, d, dv, tq):
    """Decode (Tq = 1) and a causal 40-query block, GQA (2 query heads per kv head), both
    kernel paths, against the reference; the op on CPU runs the kernel, not a fallback."""
    cfg, st = _cached(states, preset, d, dv)
    _assert_layout(st, d, dv, cfg)
    gen = torch.Generator().manual_seed(d + dv + tq)
    q = torch.randn(2, 2 * H, tq, d, generator=gen)
    scale = d ** -0.5
    ref = attention_ref.attention(q, st.buffers, None, scale, True, 0).float()
    assert ref.shape == (2, 2 * H, tq, dv)
    for many in (False, True):
        out = _kernel(q, st.buffers, scale, many=many)
        _assert_matches(out, ref, q, st.buffers, scale=scale, what=f"many={many}")
    calls = []
    real = cpu_attention.attention_state
    monkeypatch.setattr(cpu_attention, "attention_state",
                        lambda *a, **kw: calls.append(r := real(*a, **kw)) or r)
    op = torch.ops.kvarn.attention(q, st.buffers, None, scale, True, 0)
    assert calls and calls[0] is not None, "the CPU op did not run the C++ kernel"
    assert torch.equal(op, _kernel(q, st.buffers, scale, many=tq > 16))


@pytest.mark.parametrize("d,dv", DIMS)
def test_windows_masks_and_forced_key_frames(states, d, dv):
    """Sliding windows, a bool mask with holes, and random per-tile key frames, both paths."""
    cfg, st = _cached(states, "k4v2", d, dv)
    gen = torch.Generator().manual_seed(7)
    kp = unpack(st.buffers).k_plain
    saved = kp.clone()
    try:
        kp.copy_((torch.rand(kp.shape, generator=gen) < 0.5).to(kp.dtype))
        for tq, many in ((1, False), (3, False), (40, True)):
            q = torch.randn(2, 2 * H, tq, d, generator=gen)
            m = st.buffers[BUF["k_codes"]].shape[2] * G + 2 * G + 64
            mask = torch.rand(2, 1, tq, m, generator=gen) > 0.2
            for window, msk in ((150, None), (0, mask), (300, mask)):
                ref = attention_ref.attention(q, st.buffers, msk, 0.1, True, window).float()
                m_arg = msk.expand(2, 2 * H, tq, m) if msk is not None else None
                b = lambda name: st.buffers[BUF[name]]  # noqa: E731
                out = cpu_attention.decode_attention(
                    q, (b("sink_k"), b("sink_v")), [b(f"k_{n}") for n in TILE_NAMES],
                    [b(f"v_{n}") for n in TILE_NAMES], (b("tail_k"), b("tail_v")), b("lengths"),
                    b("n_tiles"), scale=0.1, window=window, mask=m_arg, k_plain=kp, many=many)
                _assert_matches(out, ref, q, st.buffers, scale=0.1, window=window, mask=msk,
                                what=f"tq={tq} window={window} mask={msk is not None}")
    finally:
        kp.copy_(saved)


@pytest.mark.parametrize("d,dv", DIMS)
def test_many_splits_and_thread_counts(d, dv):
    """Group 32: many tiles a row, so the decode step splits a (row, head) over threads and
    merges the splits (the Dv-sized partial outputs) by log-sum-exp; fp16 cache, bf16 scales."""
    cfg = get_config("k4v2", group_size=32, scale_dtype="bfloat16")
    st = _state(cfg, d, dv, lengths=(600, 333), heads=1, dtype=torch.float16)
    assert int(st.n_tiles.min()) >= 8
    gen = torch.Generator().manual_seed(3)
    n = torch.get_num_threads()
    for tq, many in ((1, False), (2, False), (40, True)):
        q = torch.randn(2, 2, tq, d, generator=gen)
        ref = attention_ref.attention(q, st.buffers, None, d ** -0.5, True, 0).float()
        outs = []
        try:
            for threads in (1, 2, 4):
                torch.set_num_threads(threads)
                outs.append(_kernel(q, st.buffers, d ** -0.5, many=many))
        finally:
            torch.set_num_threads(n)
        for out in outs:
            _assert_matches(out, ref, q, st.buffers, scale=d ** -0.5, what=f"tq={tq}")


@pytest.mark.parametrize("d,dv", DIMS)
@pytest.mark.parametrize("preset", PRESETS)
def test_tile_attention_is_in_the_values_rotated_frame(states, preset, d, dv):
    """Tiles only: out_rot [B, Hq, Tq, Dv] in the Dv-sized rotated frame; rotated back it is
    the reference's tile region (plain key tiles take the un-rotated q)."""
    cfg, st = _cached(states, preset, d, dv)
    f = unpack(st.buffers)
    q = torch.randn(2, 2 * H, 3, d, generator=torch.Generator().manual_seed(11))
    q_rot = q @ rotation_matrix(d)
    out, lse = cpu_attention.tile_attention(
        q_rot, list(f.k.core), list(f.v.core), f.n_tiles, scale=0.2, k_plain=f.k_plain, q=q)
    assert out.shape == (2, 2 * H, 3, dv)
    ref_out, ref_lse = attention_ref.tile_region(q, f, None, 0.2, False, 0, int(f.n_tiles.max()))
    torch.testing.assert_close(out @ rotation_matrix(dv).T, ref_out, atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse, ref_lse, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("d,dv", DIMS)
@pytest.mark.parametrize("preset", PRESETS)
def test_token_by_token_append_equals_the_reference(monkeypatch, preset, d, dv):
    """600 tokens one at a time through the op on CPU (the C++ decode append; the C++ tile
    quantizer where a tile freezes, V rotated in its own Dv frame) and through the reference:
    every buffer equal bit for bit after every step."""
    cfg = get_config(preset, group_size=G)
    fast, ref = (allocate_layer(cfg, batch=2, kv_heads=H, head_dim=d, value_head_dim=dv,
                                max_len=640, dtype=torch.float16) for _ in range(2))
    appends, freezes = [], []
    real_append, real_freeze = cpu_attention.append_decode, cpu_quantize.freeze
    monkeypatch.setattr(cpu_attention, "append_decode",
                        lambda *a, **kw: appends.append(r := real_append(*a, **kw)) or r)
    monkeypatch.setattr(cpu_quantize, "freeze",
                        lambda *a, **kw: freezes.append(r := real_freeze(*a, **kw)) or r)
    gen = torch.Generator().manual_seed(d * dv)
    k = (torch.randn(2, H, 600, d, generator=gen) * (0.5 + 2 * torch.rand(d, generator=gen))).half()
    k[0, 1, 256:, 3] += 300.0                    # plain key tiles there
    v = torch.randn(2, H, 600, dv, generator=gen).half()
    for t in range(600):
        pos = torch.full((2,), t, dtype=torch.long)
        torch.ops.kvarn.append_(fast.buffers, k[:, :, t:t + 1], v[:, :, t:t + 1], pos, cfg.op_method,
                                cfg.sinkhorn_iters, cfg.recent_window, 0, False, "")
        append_ref.append_(ref.buffers, k[:, :, t:t + 1], v[:, :, t:t + 1], pos,
                           cfg.op_method, cfg.sinkhorn_iters, cfg.recent_window)
        want = ref.fields.named()
        for name, a in fast.fields.named().items():
            b = want[name]
            same = torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.is_floating_point() \
                else torch.equal(a, b)
            assert same, f"token {t}: {name} differs"
    assert fast.n_tiles.tolist() == [3, 3] and unpack(fast.buffers).k_plain.any()
    # the C++ decode append ran the steps no tile froze in: from Python, or as the op's
    # native kernel (csrc/ops.cpp), which never reaches Python
    assert appends.count(True) + 600 - len(appends) >= 500, "the C++ decode append was not used"
    assert len(freezes) == 2 * 3 and all(freezes), "the C++ tile quantizer was not used"   # per row


def test_mismatched_buffers_are_refused_not_misread():
    """Value buffers of another head dim than the V tiles (or a rotation of the wrong size)
    raise instead of reading memory with the wrong geometry; supports() reads both dims."""
    cfg = get_config("k4v2", group_size=G)
    st = _state(cfg, 64, 128, lengths=(300,))
    other = _state(cfg, 64, 64, lengths=(300,))
    b = lambda name: st.buffers[BUF[name]]  # noqa: E731
    q = torch.randn(1, 2 * H, 1, 64)
    k = [b(f"k_{n}") for n in TILE_NAMES]
    v = [b(f"v_{n}") for n in TILE_NAMES]
    sink_v64 = other.buffers[BUF["sink_v"]]
    tail_v64 = other.buffers[BUF["tail_v"]]
    with pytest.raises(RuntimeError, match="head dims"):
        cpu_attention.decode_attention(q, (b("sink_k"), sink_v64), k, v, (b("tail_k"), tail_v64),
                                       b("lengths"), b("n_tiles"), scale=0.1)
    v_short = [v[0], v[1][..., :G // 2], *v[2:]]          # row scales of half the tokens
    with pytest.raises(RuntimeError, match="tile geometry"):
        cpu_attention.decode_attention(q, (b("sink_k"), b("sink_v")), k, v_short,
                                       (b("tail_k"), b("tail_v")), b("lengths"), b("n_tiles"), scale=0.1)
    assert cpu_attention.supports(192, torch.float16, value_head_dim=128)
    assert cpu_attention.supports(64, torch.bfloat16, torch.float32, value_head_dim=64)
    assert not cpu_attention.supports(64, torch.float16, value_head_dim=72)
    assert not cpu_attention.supports(72, torch.float16, value_head_dim=64)
    assert cpu_attention.bits_of(k, v) == (4, 2)
    k4v4 = _state(get_config("k4v4", group_size=G), 192, 128, lengths=(300,))
    f = unpack(k4v4.buffers)
    assert cpu_attention.bits_of(list(f.k.core), list(f.v.core)) == (4, 4)
