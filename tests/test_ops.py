"""The packed runtime cache and its ops: kvarn_compile.state + kvarn_compile.ops.

Every check compares against an independent oracle:

* attention over the packed cache == plain float64 softmax attention over the dequantized
  cache that ``materialize`` builds (which the runtime itself never builds);
* the packed state == the tile quantizer ``reference.quantize_cache`` run on the whole
  sequence in one go, bit for bit, however the tokens were appended;
* byte counts == a closed formula of the layout.

Small shapes (G=32, D=32) keep the whole file fast on two CPU cores.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvarn_compile.ops  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile import get_config
from kvarn_compile.ops import append as append_ref
from kvarn_compile.quant import NonFiniteError, quantize_cache
from kvarn_compile.state import BASE_FIELDS, StateLayout, allocate_layer, fp16_cache_bytes, unpack
from kvarn_compile.testing import oracle_attention

pytestmark = pytest.mark.usefixtures("one_thread")

G = 32          # tile length (and sink length) used throughout
D = 32          # head dim
H = 2           # kv heads
CAP = 256       # tokens per row

PRESETS = {
    "k4v2": get_config("k4v2", group_size=G),
    "k2v2": get_config("k2v2", group_size=G),
    "k4v4": get_config("k4v4", group_size=G),
    "k4v2-fp8": get_config("k4v2", group_size=G, scale_dtype="float8_e4m3fn"),
    "k4v2-kauto": get_config("k4v2", group_size=G, key_frame="auto"),
    "k4v2-krot": get_config("k4v2", group_size=G, key_frame="rotated"),   # the reference rule
}
TILE_BUFFERS = ("k_codes", "k_row_scale", "k_row_zero", "k_col_scale",
                "v_codes", "v_row_scale", "v_row_zero", "v_col_scale")
FACTOR_BUFFERS = ("k_row_factor", "k_col_factor", "v_row_factor", "v_col_factor")


# ------------------------------------------------------------------------------ helpers


def new_state(cfg=PRESETS["k4v2"], *, batch=2, heads=H, head_dim=D, max_len=CAP,
              dtype=torch.float32, spec_tokens=0):
    return allocate_layer(cfg, batch=batch, kv_heads=heads, head_dim=head_dim, max_len=max_len,
                          dtype=dtype, spec_tokens=spec_tokens)


def kv(batch, tokens, *, heads=H, head_dim=D, dtype=torch.float32, bias_outlier=False):
    """Random K/V with uneven channel scales (some outlier channels), like real keys.

    ``bias_outlier``: kv head 0 also gets a huge channel turning with position (a k_proj
    bias after RoPE), so key_frame="auto" stores its tiles plain and head 1's rotated.
    """
    spread = 1 + 4 * torch.rand(head_dim)
    k = torch.randn(batch, heads, tokens, head_dim) * spread + 0.5
    if bias_outlier:
        k[:, 0, :, 5] += 400 * torch.cos(0.3 * torch.arange(tokens) + torch.rand(1) * 6)
    v = torch.randn(batch, heads, tokens, head_dim)
    return k.to(dtype), v.to(dtype)


class Seq:
    """A layer state plus the exact tokens every row is supposed to hold."""

    def __init__(self, cfg=PRESETS["k4v2"], *, batch=2, outliers=False, **alloc):
        self.cfg, self.outliers = cfg, outliers      # outliers: keys with a huge bias channel
        self.state = new_state(cfg, batch=batch, **alloc)
        self.k = [torch.zeros(H, 0, D) for _ in range(batch)]
        self.v = [torch.zeros(H, 0, D) for _ in range(batch)]

    @property
    def buffers(self):
        return self.state.buffers

    def write(self, tokens, start=None, *, hold=0):
        """Append ``tokens`` new random tokens per row at ``start`` (default: each row's end)."""
        b = len(self.k)
        start = self.state.lengths.tolist() if start is None else list(start)
        k, v = kv(b, tokens, bias_outlier=self.outliers)
        c = self.cfg
        append_ref.append_(self.buffers, k, v, torch.tensor(start), method=c.op_method, iters=c.sinkhorn_iters,
                  recent=c.recent_window, hold=hold)
        for row, p in enumerate(start):
            self.k[row] = torch.cat([self.k[row][:, :p], k[row]], 1)
            self.v[row] = torch.cat([self.v[row][:, :p], v[row]], 1)
        return k, v

    def lengths(self):
        return [x.shape[1] for x in self.k]


def fused(q, buffers, mask=None, *, scale=None, causal=True, window=0):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.kvarn.attention(q, buffers, mask, scale, causal, window)


def assert_attention_matches(q, buffers, mask=None, *, tol=1e-5, **kw):
    out = fused(q, buffers, mask, **kw)
    ref = oracle_attention(q, buffers, mask, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def snapshot(buffers):
    return [t.clone() for t in buffers]


def assert_unchanged(buffers, before, what=""):
    assert len(buffers) == len(before)
    for name, now, then in zip(StateLayout.of(buffers).names, buffers, before, strict=True):
        assert bits_equal(now, then), f"{what}: {name} changed"


def tile_buffers(buffers):
    named = unpack(buffers).named()
    return {n: named[n] for n in TILE_BUFFERS + FACTOR_BUFFERS + ("k_plain",) if n in named}


def bits_equal(a, b):
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def assert_tiles_equal_reference(buffers, row, k, v, cfg):
    """Row ``row``'s frozen tiles == quantize_cache of its whole (exact-dtype) sequence."""
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


# ------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("grp", [1, 3, 7])
@pytest.mark.parametrize("tq", [1, 9])
def test_attention_matches_dequantized_cache(preset, grp, tq):
    """Rows of different lengths (row 0 restarted), tiles, tails, boundary crossings, GQA/MHA."""
    seq = Seq(PRESETS[preset], outliers=preset.endswith("kauto"))
    seq.write(75)                       # both rows: sink + 1 tile + 11 tail tokens
    seq.write(58, start=[0, 75])        # row 0 starts over (58: no tile), row 1 -> 133 (3 tiles)
    assert seq.lengths() == [58, 133]
    steps = 7 if tq == 1 else 1         # row 0 crosses the 64 boundary (a tile freezes) either way
    # keys of the kauto data reach |k| ~ 400: fp32 scores of that size carry ~1e-5 absolute
    # rounding, which the softmax turns into ~1e-4 relative output noise
    tol = 2e-4 if preset.endswith("kauto") else 1e-5
    for _ in range(steps):
        seq.write(tq)
        q = torch.randn(2, H * grp, tq, D)
        assert_attention_matches(q, seq.buffers, tol=tol)
    assert seq.state.n_tiles.tolist() == [1, 3]
    assert seq.state.lengths.tolist() == seq.lengths()


def test_materialize_is_exact_outside_tiles_and_close_inside():
    seq = Seq()
    seq.write(75)
    seq.write(58, start=[0, 75])
    k_hat, v_hat = append_ref.materialize(seq.buffers, dtype=torch.float32)
    for row, (k, v) in enumerate(zip(seq.k, seq.v)):
        n = k.shape[1]
        frozen = G + int(seq.state.n_tiles[row]) * G if int(seq.state.n_tiles[row]) else 0
        exact = torch.ones(n, dtype=torch.bool)
        exact[G:frozen] = False
        for got, want in ((k_hat[row, :, :n], k), (v_hat[row, :, :n], v)):
            assert torch.equal(got[:, exact], want[:, exact].half().float())   # fp16 sink/tail
            if frozen:
                err = (got[:, ~exact] - want[:, ~exact]).norm() / want[:, ~exact].norm()
                assert err < 0.5                                               # 2-4 bit codes
        assert (k_hat[row, :, n:] == 0).all() and (v_hat[row, :, n:] == 0).all()


@pytest.mark.parametrize("tq", [1, 20])
def test_attention_sink_only_cache(tq):
    """Fewer tokens than the sink: no tiles and no tail slots are in use."""
    seq = Seq()
    if tq < 20:
        seq.write(20 - tq)             # the prompt before the queries
    seq.write(tq)
    assert seq.lengths() == [20, 20] and seq.state.n_tiles.tolist() == [0, 0]
    assert_attention_matches(torch.randn(2, 6, tq, D), seq.buffers)


@pytest.mark.parametrize("tq", [1, 9])
@pytest.mark.parametrize("window", [1, 17, 40])
def test_attention_sliding_window(tq, window):
    seq = Seq()
    seq.write(75)
    seq.write(58, start=[0, 75])
    seq.write(tq)
    assert_attention_matches(torch.randn(2, 6, tq, D), seq.buffers, window=window)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("tq", [1, 9])
def test_attention_with_mask_indexed_by_absolute_position(kind, tq):
    seq = Seq()
    seq.write(75)
    seq.write(58, start=[0, 75])
    seq.write(tq)
    if kind == "bool":                  # [B, 1, Tq, capacity], broadcast over heads
        mask = torch.rand(2, 1, tq, CAP) > 0.3
        mask[..., 0] = True             # every query sees at least one key
    else:                               # [B, Hq, Tq, capacity] additive, with some -inf
        mask = torch.randn(2, 6, tq, CAP)
        mask[torch.rand(2, 6, tq, CAP) < 0.2] = float("-inf")
        mask[..., 0] = 0.0
    assert_attention_matches(torch.randn(2, 6, tq, D), seq.buffers, mask)
    # a padding mask that hides everything but position 0 -> output is V[0] exactly
    pad = torch.zeros(2, 1, 1, CAP, dtype=torch.bool)
    pad[..., 0] = True
    out = fused(torch.randn(2, 6, tq, D), seq.buffers, pad)
    v0 = append_ref.materialize(seq.buffers)[1][:, :, :1].float().repeat_interleave(3, 1)
    torch.testing.assert_close(out, v0.expand_as(out))


def test_attention_mask_shorter_than_the_cache_raises():
    seq = Seq()
    seq.write(75)
    with pytest.raises(ValueError, match="mask covers 50 key positions"):
        fused(torch.randn(2, 6, 1, D), seq.buffers, torch.ones(2, 1, 1, 50, dtype=torch.bool))


def test_attention_not_causal_and_custom_scale():
    seq = Seq()
    seq.write(100)
    assert_attention_matches(torch.randn(2, 6, 9, D), seq.buffers, causal=False, scale=0.3)


def test_attention_with_recent_window():
    """recent_window=G keeps G committed tokens beyond the incomplete tile in high precision."""
    cfg = get_config("k4v2", group_size=G, recent_window=G)
    seq = Seq(cfg)
    seq.write(75)
    assert seq.state.n_tiles.tolist() == [0, 0]      # 75 - 32 sink - 32 recent < one tile
    for _ in range(22):                               # 97 = 32 + 32 + 32 + 1 -> one tile frozen
        seq.write(1)
    assert seq.state.n_tiles.tolist() == [1, 1]
    assert_attention_matches(torch.randn(2, 6, 1, D), seq.buffers)
    seq.write(9)
    assert_attention_matches(torch.randn(2, 6, 9, D), seq.buffers)
    for row in range(2):
        assert_tiles_equal_reference(seq.buffers, row, seq.k[row], seq.v[row], cfg)


def test_attention_over_uncommitted_tokens():
    """Draft tokens (hold) are attended from the tail like any other."""
    seq = Seq(spec_tokens=8)
    seq.write(60)
    seq.write(8, hold=8)                              # 68 tokens, 60 committed: no tile freezes
    assert seq.state.n_tiles.tolist() == [0, 0]
    assert_attention_matches(torch.randn(2, 6, 8, D), seq.buffers)


def test_attention_fp16_and_bf16_queries():
    for dtype in (torch.float16, torch.bfloat16):
        st = new_state(dtype=dtype)
        k, v = kv(2, 100, dtype=dtype)
        append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long))
        q = torch.randn(2, 6, 1, D, dtype=dtype)
        out = fused(q, st.buffers)
        assert out.dtype == dtype
        ref = oracle_attention(q, st.buffers)
        torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)  # output rounding only


# ------------------------------------------------------------------------------ packed state
def _assert_states_identical(a, b):
    """Every meaningful byte equal: counters, sink, frozen tiles, live tail positions."""
    fa, fb = unpack(a).named(), unpack(b).named()
    for name in ("lengths", "committed", "n_tiles", "capacity", "sink_k", "sink_v"):
        assert torch.equal(fa[name], fb[name]), name
    n = int(fa["n_tiles"].max())
    other = tile_buffers(b)
    for name, t in tile_buffers(a).items():
        assert bits_equal(t[:, :, :n], other[name][:, :, :n]), name
    ka, va = append_ref.materialize(a)
    kb, vb = append_ref.materialize(b)
    assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("preset", ["k4v2", "k2v2", "k4v2-fp8", "recent", "k4v2-kauto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_single_token_appends_equal_one_prefill_and_quantize_cache(preset, dtype):
    cfg = get_config("k4v2", group_size=G, recent_window=G) if preset == "recent" else PRESETS[preset]
    n = G + 4 * G + 7                                 # sink + 4 tiles + 7 (fewer with recent)
    k, v = kv(2, n, dtype=dtype, bias_outlier=preset.endswith("kauto"))
    one_go, stepwise, chunked = (new_state(cfg, dtype=dtype) for _ in range(3))
    append_ref.append_(one_go.buffers, k, v, torch.zeros(2, dtype=torch.long), recent=cfg.recent_window)
    for t in range(n):
        append_ref.append_(stepwise.buffers, k[:, :, t:t + 1], v[:, :, t:t + 1], torch.full((2,), t),
                  recent=cfg.recent_window)
    for lo, hi in ((0, 5), (5, 40), (40, 97), (97, n)):   # chunks straddling tile edges
        append_ref.append_(chunked.buffers, k[:, :, lo:hi], v[:, :, lo:hi], torch.full((2,), lo),
                  recent=cfg.recent_window)
    assert one_go.n_tiles.tolist() == [4 - (preset == "recent")] * 2
    _assert_states_identical(one_go.buffers, stepwise.buffers)
    _assert_states_identical(one_go.buffers, chunked.buffers)
    for row in range(2):
        assert_tiles_equal_reference(one_go.buffers, row, k[row], v[row], cfg)


def _expected_nbytes(cfg, *, batch, heads, head_dim, max_len, exact_size, spec_tokens=0):
    g, kb, vb = cfg.group_size, cfg.key_bits, cfg.value_bits
    s = min(cfg.sink, max_len)
    n = (max_len - s) // g
    w = g + cfg.recent_window + g * math.ceil(spec_tokens / g)
    fp8 = cfg.scale_dtype == "float8_e4m3fn"
    ss = 1 if fp8 else torch.empty(0, dtype=cfg.torch_scale_dtype).element_size()
    zs = 2 if fp8 else ss
    k_tile = head_dim * g * kb // 8 + head_dim * (ss + zs) + g * ss
    v_tile = g * head_dim * vb // 8 + g * (ss + zs) + head_dim * ss
    factors = 4 * 2 if fp8 else 0
    factors += 1 if cfg.key_frame == "auto" else 0   # one key-frame flag byte per tile
    per_row_head = 2 * s * head_dim * exact_size + n * (k_tile + v_tile + factors) \
        + 2 * w * head_dim * exact_size
    return batch * heads * per_row_head + 4 * batch * 8


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_match_the_layout_formula(preset, dtype):
    cfg = PRESETS[preset]
    st = new_state(cfg, batch=3, max_len=250, dtype=dtype, spec_tokens=5)
    assert st.nbytes == sum(t.numel() * t.element_size() for t in st.buffers)
    assert st.nbytes == _expected_nbytes(cfg, batch=3, heads=H, head_dim=D, max_len=250,
                                         exact_size=2, spec_tokens=5)
    # only the sink and the tail are high precision, whatever the capacity
    layout = StateLayout.of(st.buffers)
    hi = [layout.index(n) for n in ("sink_k", "sink_v", "tail_k", "tail_v")]
    big = new_state(cfg, batch=3, max_len=4000, dtype=dtype, spec_tokens=5)
    assert [big.buffers[i].nbytes for i in hi] == [st.buffers[i].nbytes for i in hi]
    for i, t in enumerate(big.buffers):
        if i not in hi and i < len(BASE_FIELDS) and t.dim() > 1:
            assert t.dtype in (torch.uint8, cfg.torch_scale_dtype, torch.float16)
            assert t.shape[2] == (4000 - G) // G          # quantized storage: one slot per tile


def test_state_is_far_smaller_than_fp16_for_long_sequences():
    cfg = get_config("k4v2")                              # G=128, the reference preset
    ratios = {}
    for tokens in (4096, 8192, 32768):
        st = new_state(cfg, batch=1, heads=1, head_dim=128, max_len=tokens)
        fp16 = fp16_cache_bytes(batch=1, kv_heads=1, head_dim=128, tokens=tokens)
        ratios[tokens] = fp16 / st.nbytes
    # a quantized K+V tile pair is 4.74x smaller than fp16; the fp16 sink (128 tokens) and
    # tail (128 slots) cost a fixed 256 tokens on top, which is ~1/16 of a 4k sequence
    tile = 128 * 128 * 4 // 8 + 128 * 4 + 128 * 2 + 128 * 128 * 2 // 8 + 128 * 4 + 128 * 2
    assert 2 * 128 * 128 * 2 / tile == pytest.approx(4.74, abs=0.01)
    assert ratios[4096] > 3.7
    assert ratios[8192] > 4.0
    assert ratios[32768] > 4.5
    # and the bytes holding actual tokens (not preallocated slots) of a full 4k row
    st = new_state(cfg, batch=1, heads=1, head_dim=128, max_len=4096)
    k, v = kv(1, 4096, heads=1, head_dim=128)
    append_ref.append_(st.buffers, k, v, torch.zeros(1, dtype=torch.long))
    used = st.used_bytes()
    assert st.n_tiles.tolist() == [31]
    assert used["tiles"] == 31 * (tile + 1)               # + one key-frame flag byte per tile
    assert used["sink"] == used["tail"] == 2 * 128 * 128 * 2


# ------------------------------------------------------------------------------ rollback
def test_rollback_never_freezes_rejected_tokens():
    cfg = PRESETS["k4v2"]
    seq = Seq(cfg, spec_tokens=16)
    seq.write(84)                                      # committed: sink + tile [32, 64) + 20
    assert seq.state.n_tiles.tolist() == [1, 1]
    draft_k, _ = seq.write(16, hold=16)               # draft 84..99 crosses the 96 edge
    assert seq.state.lengths.tolist() == [100, 100]
    assert seq.state.committed.tolist() == [84, 84]
    assert seq.state.n_tiles.tolist() == [1, 1]        # nothing uncommitted was frozen
    # the target accepts 84..89, rejects 90..99 and writes its own 8 tokens at 90
    new_k, _ = seq.write(8, start=[90, 90])
    assert seq.state.lengths.tolist() == [98, 98] == seq.lengths()
    assert seq.state.committed.tolist() == [98, 98]
    assert seq.state.n_tiles.tolist() == [2, 2]        # tile [64, 96) holds accepted tokens only
    for row in range(2):
        assert torch.equal(seq.k[row][:, 84:90], draft_k[row][:, :6])
        assert torch.equal(seq.k[row][:, 90:], new_k[row])
        assert_tiles_equal_reference(seq.buffers, row, seq.k[row], seq.v[row], cfg)
    k_hat, _ = append_ref.materialize(seq.buffers, dtype=torch.float32)
    assert torch.equal(k_hat[:, :, 96:98], new_k[:, :, 6:8].half().float())
    assert (k_hat[:, :, 98:] == 0).all()                # rejected 98, 99 are gone
    assert_attention_matches(torch.randn(2, 6, 8, D), seq.buffers)


def test_commit_freezes_and_crop_below_frozen_raises():
    cfg = PRESETS["k4v2"]
    seq = Seq(cfg, spec_tokens=40)
    seq.write(60)
    seq.write(40, hold=40)                              # 100 tokens, 60 committed
    assert seq.state.n_tiles.tolist() == [0, 0]
    append_ref.crop_(seq.buffers, torch.tensor([70, 61]))        # rows roll back independently
    assert seq.state.lengths.tolist() == [70, 61]
    assert seq.state.committed.tolist() == [60, 60]
    seq.k = [seq.k[0][:, :70], seq.k[1][:, :61]]
    seq.v = [seq.v[0][:, :70], seq.v[1][:, :61]]
    torch.ops.kvarn.commit_(seq.buffers, torch.tensor([70, 61]), "kvarn", 8, 0, False, "")
    assert seq.state.committed.tolist() == [70, 61]
    assert seq.state.n_tiles.tolist() == [1, 0]        # row 0 has a complete committed tile
    for row in range(2):
        assert_tiles_equal_reference(seq.buffers, row, seq.k[row], seq.v[row], cfg)
    before = snapshot(seq.buffers)
    with pytest.raises(ValueError, match=r"batch row 0 would go back to 63 tokens, but tokens < 64"):
        append_ref.crop_(seq.buffers, torch.tensor([63, 61]))
    with pytest.raises(ValueError, match="batch row 1 would go back to -1"):
        append_ref.crop_(seq.buffers, torch.tensor([70, -1]))
    assert_unchanged(seq.buffers, before)
    append_ref.crop_(seq.buffers, torch.tensor([64, 10]))       # down to the frozen edge is fine
    assert seq.state.lengths.tolist() == [64, 10]
    # committed tokens cannot be rewritten; a fresh write continues at the end
    before = snapshot(seq.buffers)
    with pytest.raises(ValueError, match="tokens < 64 are committed"):
        seq.write(1, start=[63, 10])
    assert_unchanged(seq.buffers, before)


def test_commit_rejects_bad_shapes():
    st = new_state()
    before = snapshot(st.buffers)
    with pytest.raises(ValueError, match="expected upto shaped"):
        append_ref.commit_(st.buffers, torch.tensor([1, 2, 3]))
    assert_unchanged(st.buffers, before)


def test_write_at_zero_starts_a_new_sequence_in_that_row_only():
    seq = Seq()
    seq.write(100)
    before = snapshot(seq.buffers)
    seq.write(10, start=[0, 100])
    assert seq.state.lengths.tolist() == [10, 110]
    assert seq.state.n_tiles.tolist() == [0, 2]
    for i, name in enumerate(StateLayout.of(seq.buffers).names):  # row 0: only sink and counters moved
        if name not in ("sink_k", "sink_v", "lengths", "committed", "n_tiles"):
            assert torch.equal(seq.buffers[i][0], before[i][0]), name
    k_hat, _ = append_ref.materialize(seq.buffers, dtype=torch.float32)
    assert torch.equal(k_hat[0, :, :10], seq.k[0].half().float())
    assert (k_hat[0, :, 10:] == 0).all()
    # row 1 simply continued: its old tokens are intact
    assert torch.equal(k_hat[1, :, :G], seq.k[1][:, :G].half().float())
    assert_attention_matches(torch.randn(2, 6, 10, D), seq.buffers)


# ------------------------------------------------------------------------------ bad input
def _bad_calls(st):
    """(description, callable, ValueError match) for invalid appends to a 2-row state.

    The state holds 80 tokens per row, 75 committed, 5 uncommitted; capacity CAP.
    """
    ok_k, ok_v = kv(2, 3)
    at_end = st.lengths.clone()

    def app(k=ok_k, v=ok_v, start=at_end, hold=0, op=False):
        if op:
            return lambda: torch.ops.kvarn.append_(st.buffers, k, v, start, "kvarn", 8, 0, hold,
                                                   False, "")
        return lambda: append_ref.append_(st.buffers, k, v, start, hold=hold)

    return [
        ("wrong kv heads", app(k=torch.randn(2, 3, 3, D), v=torch.randn(2, 3, 3, D)), "kv_heads=2"),
        ("wrong batch", app(k=torch.randn(1, H, 3, D), v=torch.randn(1, H, 3, D)), "batch=2"),
        ("wrong head dim", app(k=torch.randn(2, H, 3, 16), v=torch.randn(2, H, 3, 16)), "head_dim=32"),
        ("3-d keys", app(k=torch.randn(2, 3, D)), "expected keys shaped"),
        ("k/v token mismatch", app(v=torch.randn(2, H, 4, D)), "expected values shaped"),
        ("zero tokens", app(k=torch.randn(2, H, 0, D), v=torch.randn(2, H, 0, D)), "tokens>=1"),
        ("int keys", app(k=torch.ones(2, H, 3, D, dtype=torch.int32)), "floating-point keys"),
        ("meta keys", app(k=torch.randn(2, H, 3, D, device="meta")), "keys on cpu"),
        ("meta keys via op", app(k=torch.randn(2, H, 3, D, device="meta"), op=True), "keys on cpu"),
        ("meta values via op", app(v=torch.randn(2, H, 3, D, device="meta"), op=True), "values on cpu"),
        ("start_pos shape", app(start=torch.tensor([80])), "start_pos"),
        ("float start_pos", app(start=torch.tensor([80.0, 80.0])), "start_pos"),
        ("past capacity", app(k=torch.randn(2, H, CAP - 79, D), v=torch.randn(2, H, CAP - 79, D)),
         f"would hold {CAP + 1} tokens, but the cache was allocated for {CAP}"),
        ("gap", app(start=torch.tensor([80, 81])), "row 1 writes at position 81, but it holds 80"),
        ("negative position", app(start=torch.tensor([-1, 80])), "position -1"),
        ("committed twice", app(start=torch.tensor([80, 74])), "tokens < 75 are committed"),
        ("committed twice via op", app(start=torch.tensor([74, 80]), op=True), "tokens < 75 are committed"),
        ("tail overflow", app(k=torch.randn(2, H, 60, D), v=torch.randn(2, H, 60, D), hold=60),
         "would keep 76 tokens in the 64-slot high-precision tail"),
    ]


def _partial_state():
    st = new_state(spec_tokens=5)
    k, v = kv(2, 75)
    append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long))
    k, v = kv(2, 5)
    append_ref.append_(st.buffers, k, v, torch.full((2,), 75), hold=5)
    assert st.lengths.tolist() == [80, 80] and st.committed.tolist() == [75, 75]
    assert st.tail_len == 2 * G
    return st


def test_bad_appends_raise_and_leave_the_cache_unchanged():
    st = _partial_state()
    before = snapshot(st.buffers)
    for what, call, match in _bad_calls(st):
        with pytest.raises(ValueError, match=match):
            call()
        assert_unchanged(st.buffers, before, what)
    # the same state still accepts a valid write afterwards
    k, v = kv(2, 3)
    append_ref.append_(st.buffers, k, v, st.lengths.clone())
    assert st.lengths.tolist() == [83, 83]


def test_runtime_rejects_methods_it_cannot_read():
    st = new_state()
    before = snapshot(st.buffers)
    k, v = kv(2, 100)
    with pytest.raises(ValueError, match="method 'kvarn' or 'hadamard', but got 'kivi'"):
        append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long), method="kivi")
    assert_unchanged(st.buffers, before)
    # hadamard tiles are rotated like kvarn's, so the fused attention reads them correctly
    cfg = get_config("k4v2", group_size=G, method="hadamard")
    append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long), method="hadamard")
    assert_attention_matches(torch.randn(2, 6, 1, D), st.buffers)
    for row in range(2):
        assert_tiles_equal_reference(st.buffers, row, k[row], v[row], cfg)


def test_check_finite_raises_naming_layer_and_position():
    st = _partial_state()
    before = snapshot(st.buffers)
    k, v = kv(2, 3)
    v[1, 0, 2, 5] = float("nan")
    with pytest.raises(NonFiniteError, match=r"layers\.3.*batch row 1, kv head 0, token position 82"):
        append_ref.append_(st.buffers, k, v, st.lengths.clone(), check_finite=True, name="layers.3")
    with pytest.raises(NonFiniteError):
        torch.ops.kvarn.append_(st.buffers, k, v, st.lengths.clone(), "kvarn", 8, 0, 0, True,
                                "layers.3")
    k[0, 1, 0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="batch row 0, kv head 1, token position 80"):
        append_ref.append_(st.buffers, k, v, st.lengths.clone(), check_finite=True)
    assert_unchanged(st.buffers, before)
    assert issubclass(NonFiniteError, ValueError)


def test_nan_token_reads_back_as_nan_only_at_that_token():
    st = new_state()
    k, v = kv(2, 75)
    bad = {5: "sink", 40: "tile", 70: "tail"}
    for p in bad:
        k[1, 0, p, 3] = float("nan")
        v[1, 1, p, 7] = float("nan")
    append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long))
    assert st.n_tiles.tolist() == [1, 1]                 # position 40 is inside a frozen tile
    k_hat, v_hat = append_ref.materialize(st.buffers, dtype=torch.float32)
    nan_k = torch.isnan(k_hat).any(-1)                   # [B, H, cap]
    nan_v = torch.isnan(v_hat).any(-1)
    assert not nan_k[0].any() and not nan_v[0].any()
    assert nan_k[1, 0].nonzero().flatten().tolist() == list(bad)
    assert nan_v[1, 1].nonzero().flatten().tolist() == list(bad)
    assert not nan_k[1, 1].any() and not nan_v[1, 0].any()
    # the finite tokens of the NaN tile are quantized from finite statistics only
    good = torch.ones(75, dtype=torch.bool)
    good[list(bad)] = False
    assert torch.isfinite(k_hat[1, :, :75][:, good]).all()
    err = (k_hat[1, :, 32:64] - k[1, :, 32:64]).nan_to_num(0).norm() / k[1, :, 32:64].nan_to_num(0).norm()
    assert err < 0.5


# ------------------------------------------------------------------------------ opcheck
def _opcheck(op, args, utils=("test_schema", "test_autograd_registration", "test_faketensor",
                              "test_aot_dispatch_dynamic")):
    torch.library.opcheck(op, args, test_utils=utils)


# SchemaCheckMode (opcheck's test_schema) compares every input before and after the call with
# torch.allclose, which has no CPU float8_e4m3fn kernel ("mul_cpu_reduced_float" not
# implemented), so test_schema cannot run on a cache with fp8 scales; the fp16-scale cases
# run it on the same op and schema.
def _utils(preset):
    base = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    return base[1:] if preset == "k4v2-fp8" else base


def test_keys_that_require_grad_leave_no_autograd_history_in_the_packed_buffers():
    """A forward outside no_grad (a model in training mode, an unfrozen adapter): the cache
    ops run below autograd, so the packed buffers never join an autograd graph."""
    st = new_state(PRESETS["k4v2"])
    k, v = kv(2, 90)
    k.requires_grad_(True)
    v.requires_grad_(True)
    torch.ops.kvarn.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long), "kvarn", 8, 0, 0,
                            False, "")
    empty = torch.zeros(2, k.shape[1], 4, D)
    torch.ops.kvarn.append_from_(st.buffers, k[:, :, :1], v[:, :, :1], torch.full((2,), 90),
                                 "kvarn", 8, 0, 0, False, "", empty, empty, False)
    assert not any(b.requires_grad or b.grad_fn is not None for b in st.buffers)


@pytest.mark.parametrize("preset", ["k4v2", "k4v2-fp8"])
def test_opcheck_append_and_commit(preset):
    cfg = PRESETS[preset]
    st = new_state(cfg, spec_tokens=8)
    k, v = kv(2, 90)
    _opcheck(torch.ops.kvarn.append_.default,
             (st.buffers, k, v, torch.zeros(2, dtype=torch.long), "kvarn", 8, 0, 6, False, ""),
             _utils(preset))
    append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long), hold=6)
    assert st.committed.tolist() == [84, 84] and st.n_tiles.tolist() == [1, 1]
    k, v = kv(2, 6)
    _opcheck(torch.ops.kvarn.append_.default,                       # draft tokens, rollback pos
             (st.buffers, k, v, torch.tensor([90, 86]), "kvarn", 8, 0, 6, False, "layers.0"),
             _utils(preset))
    append_ref.append_(st.buffers, k, v, torch.tensor([90, 86]), hold=6)
    assert st.lengths.tolist() == [96, 92] and st.committed.tolist() == [90, 86]
    _opcheck(torch.ops.kvarn.commit_.default,                       # commit freezes row 0's tile
             (st.buffers, st.lengths.clone(), "kvarn", 8, 0, False, ""), _utils(preset))
    torch.ops.kvarn.commit_(st.buffers, st.lengths.clone(), "kvarn", 8, 0, False, "")
    assert st.n_tiles.tolist() == [2, 1]


@pytest.mark.parametrize("preset", ["k4v2", "k4v2-fp8"])
def test_opcheck_attention(preset):
    st = new_state(PRESETS[preset])
    k, v = kv(2, 100)
    append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long))
    utils = _utils(preset)
    op = torch.ops.kvarn.attention.default
    _opcheck(op, (torch.randn(2, 6, 1, D), st.buffers, None, 0.2, True, 0), utils)
    _opcheck(op, (torch.randn(2, 6, 5, D), st.buffers, torch.rand(2, 1, 5, CAP) > 0.2, 0.2, True, 0),
             utils)
    _opcheck(op, (torch.randn(2, 6, 5, D), st.buffers, torch.randn(2, 6, 5, CAP), 0.2, True, 16),
             utils)
    # The op is inference-only: it has no backward formula, so with a query that requires
    # grad test_aot_dispatch_dynamic (which runs a backward) cannot pass by design; the
    # registration itself (an autograd kernel that raises on backward) is checked.
    q = torch.randn(2, 6, 1, D, requires_grad=True)
    _opcheck(op, (q, st.buffers, None, 0.2, True, 0),
             tuple(u for u in utils if u != "test_aot_dispatch_dynamic"))
    with pytest.raises(RuntimeError, match="no autograd formula|does not require grad"):
        op(q, st.buffers, None, 0.2, True, 0).sum().backward()


# ------------------------------------------------------------------------------ torch.compile
def _counting(backend):
    from torch._dynamo.backends.registry import lookup_backend

    inner, graphs = lookup_backend(backend), []

    def compile_fn(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return inner(gm, example_inputs, **kwargs)

    return compile_fn, graphs


def _step(buffers, k, v, start, q):
    torch.ops.kvarn.append_(buffers, k, v, start, "kvarn", 8, 0, 0, False, "layer")
    return torch.ops.kvarn.attention(q, buffers, None, 0.125, True, 0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_decode_matches_eager_without_recompiles(backend):
    torch._dynamo.reset()
    eager, compiled = new_state(), new_state()
    k, v = kv(2, 60)
    for st in (eager, compiled):
        append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long))
    compile_fn, graphs = _counting(backend)
    step = torch.compile(_step, backend=compile_fn, fullgraph=True)
    for _ in range(4):                                   # 60 -> 64 freezes a tile on the way
        k, v = kv(2, 1)
        q = torch.randn(2, 6, 1, D)
        start = eager.lengths.clone()
        want = _step(eager.buffers, k, v, start.clone(), q)
        got = step(compiled.buffers, k, v, start.clone(), q)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        _assert_states_identical(eager.buffers, compiled.buffers)
    assert compiled.n_tiles.tolist() == [1, 1]
    assert len(graphs) == 1
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.kvarn.append_.default in ops or torch.ops.kvarn.append_ in ops


def test_compiled_chunks_of_varying_length_compile_once_dynamic():
    torch._dynamo.reset()
    eager, compiled = new_state(), new_state()
    compile_fn, graphs = _counting("aot_eager")
    step = torch.compile(_step, backend=compile_fn, fullgraph=True)
    counts = []
    for t in (20, 7, 13, 30, 1, 5, 1):
        k, v = kv(2, t)
        q = torch.randn(2, 6, t, D)
        start = eager.lengths.clone()
        want = _step(eager.buffers, k, v, start.clone(), q)
        got = step(compiled.buffers, k, v, start.clone(), q)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        _assert_states_identical(eager.buffers, compiled.buffers)
        counts.append(len(graphs))
    # the first length compiles statically, the second recompiles with a dynamic token count
    # that serves every later length; T=1 gets one graph of its own because dynamo always
    # specializes sizes 0 and 1. Nothing recompiles per step after that.
    assert counts == [1, 2, 2, 2, 3, 3, 3]


# ------------------------------------------------------------------------------ key frames
def test_key_frame_auto_stores_outlier_heads_plain_and_attends_exactly():
    """key_frame="auto": head 0 (a huge turning channel) is stored plain, head 1 rotated;
    the fused attention still equals attention over the dequantized cache."""
    seq = Seq(PRESETS["k4v2-kauto"], outliers=True)
    seq.write(75)
    seq.write(58, start=[0, 75])
    frames = seq.state.k_plain
    assert frames is not None and frames.dtype == torch.uint8
    assert frames[:, 0, :1].all() and not frames[:, 1].any()
    for grp, tq in ((1, 1), (3, 9)):
        seq.write(tq)
        assert_attention_matches(torch.randn(2, H * grp, tq, D), seq.buffers, tol=2e-4)
    assert new_state(PRESETS["k4v2-krot"]).k_plain is None
    assert new_state(PRESETS["k4v2"]).k_plain is not None          # key_frame="auto" by default


def test_key_frame_auto_lowers_key_error_on_bias_outliers():
    """Plain tiles of an outlier head keep the other channels' error at their own scale;
    the rotated layout spreads the outlier's rounding noise over every channel."""
    k, v = kv(1, G + 4 * G, bias_outlier=True)
    errs = {}
    for name in ("k4v2-krot", "k4v2-kauto"):
        st = new_state(PRESETS[name], batch=1)
        append_ref.append_(st.buffers, k, v, torch.zeros(1, dtype=torch.long))
        kd, _ = append_ref.materialize(st.buffers, dtype=torch.float32)
        region = slice(G, G + 4 * G)
        rest = [c for c in range(D) if c != 5]              # every channel but the outlier
        diff = kd[0, 0, region][:, rest] - k[0, 0, region][:, rest]
        errs[name] = diff.norm() / k[0, 0, region][:, rest].norm()
    assert errs["k4v2-kauto"] < 0.25 * errs["k4v2-krot"]


def test_constant_key_offset_costs_no_more_than_its_own_rounding():
    """A constant per-channel offset (|o| = 100-150) added to keys that are stored plain
    leaves every key within its tile's rounding bound (half a code step of that channel,
    which the offset does not change, plus the fp16 rounding of the zero point that absorbs
    the offset), and leaves the attention error where it was without the offset."""
    import torch.nn.functional as F

    cfg = PRESETS["k4v2-kauto"]
    k, v = kv(1, G + 3 * G, heads=1, bias_outlier=True)
    off = torch.zeros(D)
    off[9], off[20] = 100.0, -150.0
    q = torch.randn(1, 2, 1, D)
    region = slice(G, 4 * G)
    errs = []
    for shift in (0.0, 1.0):
        x = k + shift * off
        st = new_state(cfg, batch=1, heads=1)
        append_ref.append_(st.buffers, x, v, torch.zeros(1, dtype=torch.long))
        assert st.k_plain[0, 0, :3].all()
        kd = append_ref.materialize(st.buffers, dtype=torch.float32)[0][0, 0, region]
        tiles = x[0, 0, region].reshape(3, G, D)
        step = ((tiles.amax(1) - tiles.amin(1)) / 15).repeat_interleave(G, 0)   # [3G, D]
        zero_ulp = 2.0 ** (torch.floor(torch.log2(tiles.abs().amax(1) + 1e-30)) - 10)
        bound = step / 2 + zero_ulp.repeat_interleave(G, 0) / 2 + 1e-3 * step
        assert ((kd - x[0, 0, region]).abs() <= bound).all()
        exact = F.scaled_dot_product_attention(q, x[:, :, :4 * G], v[:, :, :4 * G], enable_gqa=True)
        errs.append((fused(q, st.buffers) - exact).norm() / exact.norm())
    assert errs[1] <= 1.25 * errs[0] + 1e-3


# ------------------------------------------------------------------------------ clip="mse"
def test_clip_mse_runtime_state_equals_quantize_cache_and_lowers_2bit_error():
    """kvarn+clip: the packed state after decode-step appends equals quantize_cache of the
    same tokens with clip="mse", attention still equals the dequantized oracle, and the
    2-bit keys reconstruct better than with min-max ranges (values are unchanged)."""
    cfg = get_config("k2v2", group_size=G, clip="mse")
    assert cfg.op_method == "kvarn+clip"
    n = G + 3 * G + 5
    k, v = kv(2, n)
    stepwise = new_state(cfg)
    for t in range(n):
        append_ref.append_(stepwise.buffers, k[:, :, t:t + 1], v[:, :, t:t + 1], torch.full((2,), t),
                  method=cfg.op_method)
    for row in range(2):
        assert_tiles_equal_reference(stepwise.buffers, row, k[row], v[row], cfg)
    assert_attention_matches(torch.randn(2, H * 3, 1, D), stepwise.buffers)
    plain = new_state(PRESETS["k2v2"])
    append_ref.append_(plain.buffers, k, v, torch.zeros(2, dtype=torch.long))
    region = slice(G, 4 * G)
    errs = [(append_ref.materialize(st.buffers, dtype=torch.float32)[0][:, :, region] - k[:, :, region]).norm()
            for st in (stepwise, plain)]
    assert errs[0] < 0.9 * errs[1]
    v_clip, v_plain = (append_ref.materialize(st.buffers, dtype=torch.float32)[1] for st in (stepwise, plain))
    assert torch.equal(v_clip, v_plain)
    with pytest.raises(ValueError, match="kvarn\\+clip"):
        append_ref.append_(plain.buffers, k[:, :, :1], v[:, :, :1], torch.zeros(2, dtype=torch.long),
                  method="kvarn+fast")
