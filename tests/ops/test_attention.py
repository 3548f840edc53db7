"""``kvarn::attention`` over the packed cache (:mod:`kvarn_compile.ops.attention`).

Every check compares against the float64 oracle ``kvarn_compile.testing.oracle_attention``:
plain softmax attention over the dequantized cache that ``materialize`` builds (which the
runtime itself never builds). Rows of different lengths, sink-only caches, tiles, tails and
tile boundaries, GQA/MHA, masks indexed by absolute position, sliding windows, draft tokens,
fp16/bf16 queries, per-tile key frames. The device kernels the op dispatches to are tested in
``tests/ops/test_dispatch.py``. Small shapes (G=32, D=32) keep the file fast on two CPU cores.
"""

from __future__ import annotations

import pytest
import torch

import kvarn_compile.ops  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile import get_config
from kvarn_compile.ops import append as append_ref
from kvarn_compile.testing import (
    SMALL_CAP, SMALL_D, SMALL_G, SMALL_H, small_kv, small_presets,
    PackedSequence, assert_attention_matches, assert_tiles_equal_reference, attend, oracle_attention,
    packed_state,
)

pytestmark = pytest.mark.usefixtures("one_thread")

G, D, H, CAP = SMALL_G, SMALL_D, SMALL_H, SMALL_CAP     # the kit's small geometry
PRESETS = small_presets()
kv = small_kv


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("grp", [1, 3, 7])
@pytest.mark.parametrize("tq", [1, 9])
def test_attention_matches_dequantized_cache(preset, grp, tq):
    """Rows of different lengths (row 0 restarted), tiles, tails, boundary crossings, GQA/MHA."""
    seq = PackedSequence(PRESETS[preset], outliers=preset.endswith("kauto"))
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


@pytest.mark.parametrize("tq", [1, 20])
def test_attention_sink_only_cache(tq):
    """Fewer tokens than the sink: no tiles and no tail slots are in use."""
    seq = PackedSequence()
    if tq < 20:
        seq.write(20 - tq)             # the prompt before the queries
    seq.write(tq)
    assert seq.lengths() == [20, 20] and seq.state.n_tiles.tolist() == [0, 0]
    assert_attention_matches(torch.randn(2, 6, tq, D), seq.buffers)


@pytest.mark.parametrize("tq", [1, 9])
@pytest.mark.parametrize("window", [1, 17, 40])
def test_attention_sliding_window(tq, window):
    seq = PackedSequence()
    seq.write(75)
    seq.write(58, start=[0, 75])
    seq.write(tq)
    assert_attention_matches(torch.randn(2, 6, tq, D), seq.buffers, window=window)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("tq", [1, 9])
def test_attention_with_mask_indexed_by_absolute_position(kind, tq):
    seq = PackedSequence()
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
    out = attend(torch.randn(2, 6, tq, D), seq.buffers, pad)
    v0 = append_ref.materialize(seq.buffers)[1][:, :, :1].float().repeat_interleave(3, 1)
    torch.testing.assert_close(out, v0.expand_as(out))


@pytest.mark.parametrize("kind", ["bf16-shared", "fp32-per-head", "bool-shared", "short"])
def test_tile_inputs_read_the_mask_as_it_is(kind):
    """The tile kernels' mask over the quantized tokens: a bool or float mask that covers them
    is the model's own tensor (a view of its storage, any float dtype, its head dim kept), a
    too-short one an fp32 copy of the same shape class; one mask shared by the query heads
    is never copied per head. The tile partials equal those over a per-head fp32 bias."""
    from kvarn_compile.ops import attention as attention_ref
    from kvarn_compile.ops import regions

    seq = PackedSequence()
    seq.write(75)
    seq.write(58, start=[0, 75])
    tq, hq = 3, 6
    seq.write(tq)
    q = torch.randn(2, hq, tq, D)
    heads = hq if kind == "fp32-per-head" else 1
    length = CAP - 5 if kind == "short" else CAP
    mask = torch.randn(2, heads, tq, length)
    mask[torch.rand(mask.shape) < 0.2] = float("-inf")
    if kind == "bf16-shared":
        mask = mask.to(torch.bfloat16)
    elif kind == "bool-shared":
        mask = mask > -1.0
    ins = attention_ref.tile_inputs(q, seq.buffers, mask, True, 0)
    bias = ins[-1]
    n_max, g = ins[2].shape[2], ins[5].shape[-1]
    assert bias.shape == (2, heads, tq, n_max * g)
    own = kind in ("bf16-shared", "fp32-per-head", "bool-shared")
    assert (bias.untyped_storage().data_ptr() == mask.untyped_storage().data_ptr()) == own
    s = seq.buffers[0].shape[2]                              # sink slots: tile 0's position
    per_head = regions.bias_at(mask, (s + torch.arange(n_max * g))[None, :].expand(2, -1),
                               (2, hq, tq))
    want = attention_ref.tile_partials(*ins[:-1], per_head, 0.3, 1)
    got = attention_ref.tile_partials(*ins, 0.3, 1)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("tq", [1, 9])
@pytest.mark.parametrize("window", [0, 17])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_attention_weights_are_what_attention_applies(tq, window, masked):
    """``kvarn::attention_weights`` (a model returning its weights): applied to the
    dequantized values they give the attention's output; each query's weights sum to 1, and
    they are 0 past each row's length, up to the ``keys`` columns asked for."""
    seq = PackedSequence()
    seq.write(75)
    seq.write(58, start=[0, 75])        # rows of 58 and 133 tokens: tiles, tails, a restart
    seq.write(tq)
    q = torch.randn(2, 6, tq, D)
    mask = None
    if masked:
        mask = torch.rand(2, 1, tq, CAP) > 0.3
        mask[..., 0] = True
    keys = 150                          # beyond both rows' lengths
    w = torch.ops.kvarn.attention_weights(q, seq.buffers, mask, D ** -0.5, True, window, keys)
    assert w.shape == (2, 6, tq, keys) and w.dtype == torch.float32
    v = append_ref.materialize(seq.buffers, dtype=torch.float64)[1][:, :, :keys]
    out = w.double() @ v.repeat_interleave(3, 1)
    torch.testing.assert_close(out, oracle_attention(q, seq.buffers, mask, window=window),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 6, tq))
    for row, n in enumerate(seq.lengths()):
        assert not w[row, ..., n:].any()


def test_attention_weights_refuse_bad_queries_and_key_counts():
    seq = PackedSequence()
    seq.write(40)
    with pytest.raises(ValueError, match="expected keys >= 0"):
        torch.ops.kvarn.attention_weights(torch.randn(2, 6, 1, D), seq.buffers, None, 0.2, True, 0, -1)
    with pytest.raises(ValueError, match="KVarN"):     # the attention's own query check
        torch.ops.kvarn.attention_weights(torch.randn(2, 6, 1, D + 16), seq.buffers, None, 0.2,
                                          True, 0, 40)


def test_attention_mask_shorter_than_the_cache_raises():
    seq = PackedSequence()
    seq.write(75)
    with pytest.raises(ValueError, match="mask covers 50 key positions"):
        attend(torch.randn(2, 6, 1, D), seq.buffers, torch.ones(2, 1, 1, 50, dtype=torch.bool))


def test_attention_not_causal_and_custom_scale():
    seq = PackedSequence()
    seq.write(100)
    assert_attention_matches(torch.randn(2, 6, 9, D), seq.buffers, causal=False, scale=0.3)


def test_attention_with_recent_window():
    """recent_window=G keeps G committed tokens beyond the incomplete tile in high precision."""
    cfg = get_config("k4v2", group_size=G, recent_window=G)
    seq = PackedSequence(cfg)
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
    seq = PackedSequence(spec_tokens=8)
    seq.write(60)
    seq.write(8, hold=8)                              # 68 tokens, 60 committed: no tile freezes
    assert seq.state.n_tiles.tolist() == [0, 0]
    assert_attention_matches(torch.randn(2, 6, 8, D), seq.buffers)


def test_attention_fp16_and_bf16_queries():
    for dtype in (torch.float16, torch.bfloat16):
        st = packed_state(dtype=dtype)
        k, v = kv(2, 100, dtype=dtype)
        append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long))
        q = torch.randn(2, 6, 1, D, dtype=dtype)
        out = attend(q, st.buffers)
        assert out.dtype == dtype
        ref = oracle_attention(q, st.buffers)
        torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)  # output rounding only


# ------------------------------------------------------------------------------ value head dims
@pytest.mark.parametrize("preset", ["k4v2", "k4v4", "k4v2-kauto", "k4v2-fp8"])
@pytest.mark.parametrize("dims", [(48, 32), (32, 64)], ids=["d48-dv32", "d32-dv64"])
def test_attention_with_values_of_another_head_dim(preset, dims):
    """Keys and values of different head dims (multi-head latent attention decompressed: K
    192 = 128 + 64 RoPE channels, V 128): each side rotated and quantized in its own frame,
    the output [B, Hq, Tq, Dv]; decode and multi-query steps, windows, masks."""
    d, dv = dims
    seq = PackedSequence(PRESETS[preset], head_dim=d, value_head_dim=dv,
                         outliers=preset.endswith("kauto"))
    st = seq.state
    assert (st.head_dim, st.value_head_dim) == (d, dv) and st.geometry.value_head_dim == dv
    assert st.sink_v.shape[-1] == st.tail_v.shape[-1] == st.v_col_scale.shape[-1] == dv
    seq.write(75)
    seq.write(58, start=[0, 75])                    # row 0 restarts, row 1: 3 tiles
    tol = 2e-4 if preset.endswith("kauto") else 1e-5
    for tq in (1, 1, 9):
        seq.write(tq)
        q = torch.randn(2, 2 * H, tq, d)
        assert_attention_matches(q, seq.buffers, tol=tol)
        assert_attention_matches(q, seq.buffers, tol=tol, window=17)
    mask = torch.rand(2, 1, 9, CAP) > 0.3
    assert_attention_matches(torch.randn(2, 2 * H, 9, d), seq.buffers, mask, tol=tol)
    # the packed values are the true values within the preset's rounding (not the keys', not
    # another frame's): what the oracle above reads back is the real V
    _, v_hat = append_ref.materialize(seq.buffers, dtype=torch.float32)
    n = seq.lengths()[1]
    rel = ((v_hat[1, :, :n] - seq.v[1]).norm() / seq.v[1].norm()).item()
    assert 0 < rel < 0.5, rel
    for row in range(2):
        assert_tiles_equal_reference(seq.buffers, row, seq.k[row], seq.v[row], seq.cfg)


def test_values_of_another_head_dim_refuse_a_wrong_append():
    """An append whose values have the keys' head dim is refused before anything is written."""
    st = packed_state(head_dim=32, value_head_dim=64)
    k, v = kv(2, 5)                                  # both 32 channels
    with pytest.raises(ValueError, match=r"expected values shaped .*head_dim=64\], but got \(2, 2, 5, 32\)"):
        append_ref.append_(st.buffers, k, v, torch.zeros(2, dtype=torch.long))
    assert st.lengths.tolist() == [0, 0]


# ------------------------------------------------------------------------------ key frames
def test_key_frame_auto_stores_outlier_heads_plain_and_attends_exactly():
    """key_frame="auto": head 0 (a huge turning channel) is stored plain, head 1 rotated;
    the fused attention still equals attention over the dequantized cache."""
    seq = PackedSequence(PRESETS["k4v2-kauto"], outliers=True)
    seq.write(75)
    seq.write(58, start=[0, 75])
    frames = seq.state.k_plain
    assert frames is not None and frames.dtype == torch.uint8
    assert frames[:, 0, :1].all() and not frames[:, 1].any()
    for grp, tq in ((1, 1), (3, 9)):
        seq.write(tq)
        assert_attention_matches(torch.randn(2, H * grp, tq, D), seq.buffers, tol=2e-4)
    assert packed_state(PRESETS["k4v2-krot"]).k_plain is None
    assert packed_state(PRESETS["k4v2"]).k_plain is not None          # key_frame="auto" by default
