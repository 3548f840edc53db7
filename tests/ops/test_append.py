"""The cache-write ops over the packed state (:mod:`kvarn_compile.ops.append`): ``append_``,
``commit_``, crop, rollback of draft tokens, bad input, non-finite values, key frames, clip.

Every check compares against an independent oracle:

* the packed state == the tile quantizer ``kvarn_compile.quant.quantize_cache`` run on the
  whole sequence in one go, bit for bit, however the tokens were appended;
* ``materialize`` (the dequantized cache the runtime never builds) is exact outside the tiles;
* a refused call leaves every buffer of the state unchanged.

Attention over the packed cache: ``tests/ops/test_attention.py``; byte counts of the layout:
``tests/test_state.py``; opcheck of every op: ``tests/ops/test_library.py``. Small shapes
(G=32, D=32) keep the whole file fast on two CPU cores.
"""

from __future__ import annotations

import pytest
import torch

import kvarn_compile.ops  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile import get_config
from kvarn_compile.ops import append as append_ref
from kvarn_compile.quant import NonFiniteError
from kvarn_compile.state import StateLayout
from kvarn_compile.testing import (
    SMALL_CAP, SMALL_D, SMALL_G, SMALL_H, small_kv, small_presets,
    PackedSequence, assert_attention_matches, assert_states_identical, assert_tiles_equal_reference,
    assert_unchanged, attend, packed_state, snapshot,
)

pytestmark = pytest.mark.usefixtures("one_thread")

G, D, H, CAP = SMALL_G, SMALL_D, SMALL_H, SMALL_CAP     # the kit's small geometry
PRESETS = small_presets()
kv = small_kv


# ------------------------------------------------------------------------------ packed state
def test_materialize_is_exact_outside_tiles_and_close_inside():
    seq = PackedSequence()
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


@pytest.mark.parametrize("preset", ["k4v2", "k2v2", "k4v2-fp8", "recent", "k4v2-kauto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_single_token_appends_equal_one_prefill_and_quantize_cache(preset, dtype):
    cfg = get_config("k4v2", group_size=G, recent_window=G) if preset == "recent" else PRESETS[preset]
    n = G + 4 * G + 7                                 # sink + 4 tiles + 7 (fewer with recent)
    k, v = kv(2, n, dtype=dtype, bias_outlier=preset.endswith("kauto"))
    one_go, stepwise, chunked = (packed_state(cfg, dtype=dtype) for _ in range(3))
    append_ref.append_(one_go.buffers, k, v, torch.zeros(2, dtype=torch.long), recent=cfg.recent_window)
    for t in range(n):
        append_ref.append_(stepwise.buffers, k[:, :, t:t + 1], v[:, :, t:t + 1], torch.full((2,), t),
                  recent=cfg.recent_window)
    for lo, hi in ((0, 5), (5, 40), (40, 97), (97, n)):   # chunks straddling tile edges
        append_ref.append_(chunked.buffers, k[:, :, lo:hi], v[:, :, lo:hi], torch.full((2,), lo),
                  recent=cfg.recent_window)
    assert one_go.n_tiles.tolist() == [4 - (preset == "recent")] * 2
    assert_states_identical(one_go.buffers, stepwise.buffers)
    assert_states_identical(one_go.buffers, chunked.buffers)
    for row in range(2):
        assert_tiles_equal_reference(one_go.buffers, row, k[row], v[row], cfg)


# ------------------------------------------------------------------------------ rollback
def test_rollback_never_freezes_rejected_tokens():
    cfg = PRESETS["k4v2"]
    seq = PackedSequence(cfg, spec_tokens=16)
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


def test_commit_freezes_and_crop_into_tiles_revises_them():
    cfg = PRESETS["k4v2"]
    seq = PackedSequence(cfg, spec_tokens=40)
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
    with pytest.raises(ValueError, match="batch row 1 would go back to -1"):
        append_ref.crop_(seq.buffers, torch.tensor([70, -1]))
    assert_unchanged(seq.buffers, before)
    # into the packed tile: its surviving tokens return to the tail as the values attention read
    k_hat, v_hat = append_ref.materialize(seq.buffers, dtype=torch.float32)
    append_ref.crop_(seq.buffers, torch.tensor([50, 10]))
    assert seq.state.lengths.tolist() == [50, 10]
    assert seq.state.committed.tolist() == [50, 10]
    assert seq.state.n_tiles.tolist() == [0, 0]
    k_cut, v_cut = append_ref.materialize(seq.buffers, dtype=torch.float32)
    for got, want in ((k_cut, k_hat), (v_cut, v_hat)):
        torch.testing.assert_close(got[0, :, :50], want[0, :, :50].half().float(), rtol=0, atol=0)
        assert (got[0, :, 50:] == 0).all() and (got[1, :, 10:] == 0).all()
    # writing on: the revised tile fills with new tokens and freezes again; attention reads
    # exactly the dequantized prefix and the new tokens
    seq.k = [seq.k[0][:, :50], seq.k[1][:, :10]]
    seq.v = [seq.v[0][:, :50], seq.v[1][:, :10]]
    new_k, _ = seq.write(30, start=[50, 10])
    assert seq.state.n_tiles.tolist() == [1, 0]
    assert_attention_matches(torch.randn(2, 6, 3, D), seq.buffers)


def test_a_write_before_the_end_rolls_back_committed_tiles_first():
    """A static cache cropped and written again: the write at p discards tokens >= p, tiles
    included; what is kept reads as before."""
    cfg = PRESETS["k4v2"]
    seq = PackedSequence(cfg)
    seq.write(130)                                     # sink 32 + 3 tiles + 2
    assert seq.state.n_tiles.tolist() == [3, 3]
    k_hat, _ = append_ref.materialize(seq.buffers, dtype=torch.float32)
    new_k, _ = seq.write(4, start=[70, 130])           # row 0 goes back into tile [64, 96)
    assert seq.state.lengths.tolist() == [74, 134]
    assert seq.state.n_tiles.tolist() == [1, 3]
    k_now, _ = append_ref.materialize(seq.buffers, dtype=torch.float32)
    assert torch.equal(k_now[0, :, :64], k_hat[0, :, :64])            # sink and tile 0 kept
    assert torch.equal(k_now[0, :, 64:70], k_hat[0, :, 64:70].half().float())   # in the tail
    assert torch.equal(k_now[0, :, 70:74], new_k[0].half().float())
    assert (k_now[0, :, 74:] == 0).all()
    assert torch.equal(k_now[1, :, :130], k_hat[1, :, :130])


def test_commit_rejects_bad_shapes():
    st = packed_state()
    before = snapshot(st.buffers)
    with pytest.raises(ValueError, match="expected upto shaped"):
        append_ref.commit_(st.buffers, torch.tensor([1, 2, 3]))
    assert_unchanged(st.buffers, before)


def test_write_at_zero_starts_a_new_sequence_in_that_row_only():
    seq = PackedSequence()
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
        ("tail overflow", app(k=torch.randn(2, H, 60, D), v=torch.randn(2, H, 60, D), hold=60),
         "would keep 76 tokens in the 64-slot high-precision tail"),
    ]


def _partial_state():
    st = packed_state(spec_tokens=5)
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
    st = packed_state()
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
    st = packed_state()
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


# ------------------------------------------------------------------------------ key frames
def test_key_frame_auto_lowers_key_error_on_bias_outliers():
    """Plain tiles of an outlier head keep the other channels' error at their own scale;
    the rotated layout spreads the outlier's rounding noise over every channel."""
    k, v = kv(1, G + 4 * G, bias_outlier=True)
    errs = {}
    for name in ("k4v2-krot", "k4v2-kauto"):
        st = packed_state(PRESETS[name], batch=1)
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
        st = packed_state(cfg, batch=1, heads=1)
        append_ref.append_(st.buffers, x, v, torch.zeros(1, dtype=torch.long))
        assert st.k_plain[0, 0, :3].all()
        kd = append_ref.materialize(st.buffers, dtype=torch.float32)[0][0, 0, region]
        tiles = x[0, 0, region].reshape(3, G, D)
        step = ((tiles.amax(1) - tiles.amin(1)) / 15).repeat_interleave(G, 0)   # [3G, D]
        zero_ulp = 2.0 ** (torch.floor(torch.log2(tiles.abs().amax(1) + 1e-30)) - 10)
        bound = step / 2 + zero_ulp.repeat_interleave(G, 0) / 2 + 1e-3 * step
        assert ((kd - x[0, 0, region]).abs() <= bound).all()
        exact = F.scaled_dot_product_attention(q, x[:, :, :4 * G], v[:, :, :4 * G], enable_gqa=True)
        errs.append((attend(q, st.buffers) - exact).norm() / exact.norm())
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
    stepwise = packed_state(cfg)
    for t in range(n):
        append_ref.append_(stepwise.buffers, k[:, :, t:t + 1], v[:, :, t:t + 1], torch.full((2,), t),
                  method=cfg.op_method)
    for row in range(2):
        assert_tiles_equal_reference(stepwise.buffers, row, k[row], v[row], cfg)
    assert_attention_matches(torch.randn(2, H * 3, 1, D), stepwise.buffers)
    plain = packed_state(PRESETS["k2v2"])
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


def test_adopt_takes_a_left_padded_prompt_and_refuses_a_row_that_reads_only_zeros():
    """``adopt_`` (a prompt an uncompiled forward wrote into the model's cache): a left-padded
    row whose pad keys and values are exactly zero (a zero pad embedding) is a prompt and is
    adopted; a row whose positions [0, p) all read zero (a copy of a cache a compiled model
    keeps packed) is refused with a one-line error, the state left as it was."""
    from kvarn_compile.config import get_config
    from kvarn_compile.ops import append as append_ref
    from kvarn_compile.state import allocate_layer, unpack

    g, h, d, p = 32, 2, 16, 50
    st = allocate_layer(get_config("k4v2", group_size=g), batch=2, kv_heads=h, head_dim=d,
                        max_len=128, dtype=torch.float32)
    cache_k, cache_v = torch.zeros(2, h, 128, d), torch.zeros(2, h, 128, d)
    cache_k[:, :, :p], cache_v[:, :, :p] = torch.randn(2, h, p, d), torch.randn(2, h, p, d)
    cache_k[1, :, :9] = 0.0                          # row 1: 9 pad positions, exactly zero
    cache_v[1, :, :9] = 0.0
    append_ref.adopt_(st.buffers, cache_k, cache_v, torch.tensor([p, p]), "kvarn", 8, 0, 0,
                      False, "layer", False)
    assert unpack(st.buffers).lengths.tolist() == [p, p]

    fresh = allocate_layer(get_config("k4v2", group_size=g), batch=2, kv_heads=h, head_dim=d,
                           max_len=128, dtype=torch.float32)
    before = [t.clone() for t in fresh.buffers]
    cache_k[1, :, :p] = 0.0
    cache_v[1, :, :p] = 0.0
    with pytest.raises(ValueError, match=r"only zeros in positions 0\.\.49 \(batch row 1\)"):
        append_ref.adopt_(fresh.buffers, cache_k, cache_v, torch.tensor([p, p]), "kvarn", 8, 0,
                          0, False, "layer", False)
    assert all(torch.equal(a, b) for a, b in zip(fresh.buffers, before))
