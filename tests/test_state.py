"""The packed layer state (:mod:`kvarn_compile.state`): its bytes equal a closed formula of
the layout, only the sink and the tail are high precision whatever the capacity, and a long
sequence costs far less than fp16. Growing states: ``tests/frontends/test_growth.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvarn_compile.ops  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile import get_config
from kvarn_compile.ops import append as append_ref
from kvarn_compile.state import BASE_FIELDS, StateLayout, fp16_cache_bytes
from kvarn_compile.testing import (
    SMALL_CAP, SMALL_D, SMALL_G, SMALL_H, packed_state, small_kv, small_presets,
)

pytestmark = pytest.mark.usefixtures("one_thread")

G, D, H, CAP = SMALL_G, SMALL_D, SMALL_H, SMALL_CAP     # the kit's small geometry
PRESETS = small_presets()
kv = small_kv


def _expected_nbytes(cfg, *, batch, heads, head_dim, max_len, exact_size, spec_tokens=0,
                     value_head_dim=None):
    dv = value_head_dim or head_dim
    g, kb, vb = cfg.group_size, cfg.key_bits, cfg.value_bits
    s = min(cfg.sink, max_len)
    n = (max_len - s) // g
    w = g + cfg.recent_window + g * math.ceil(spec_tokens / g)
    fp8 = cfg.scale_dtype == "float8_e4m3fn"
    ss = 1 if fp8 else torch.empty(0, dtype=cfg.torch_scale_dtype).element_size()
    zs = 2 if fp8 else ss
    k_tile = head_dim * g * kb // 8 + head_dim * (ss + zs) + g * ss
    v_tile = g * dv * vb // 8 + g * (ss + zs) + dv * ss
    factors = 4 * 2 if fp8 else 0
    factors += 1 if cfg.key_frame == "auto" else 0   # one key-frame flag byte per tile
    per_row_head = s * (head_dim + dv) * exact_size + n * (k_tile + v_tile + factors) \
        + w * (head_dim + dv) * exact_size
    return batch * heads * per_row_head + 4 * batch * 8


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_match_the_layout_formula(preset, dtype):
    cfg = PRESETS[preset]
    st = packed_state(cfg, batch=3, max_len=250, dtype=dtype, spec_tokens=5)
    assert st.nbytes == sum(t.numel() * t.element_size() for t in st.buffers)
    assert st.nbytes == _expected_nbytes(cfg, batch=3, heads=H, head_dim=D, max_len=250,
                                         exact_size=2, spec_tokens=5)
    # only the sink and the tail are high precision, whatever the capacity
    layout = StateLayout.of(st.buffers)
    hi = [layout.index(n) for n in ("sink_k", "sink_v", "tail_k", "tail_v")]
    big = packed_state(cfg, batch=3, max_len=4000, dtype=dtype, spec_tokens=5)
    assert [big.buffers[i].nbytes for i in hi] == [st.buffers[i].nbytes for i in hi]
    for i, t in enumerate(big.buffers):
        if i not in hi and i < len(BASE_FIELDS) and t.dim() > 1:
            assert t.dtype in (torch.uint8, cfg.torch_scale_dtype, torch.float16)
            assert t.shape[2] == (4000 - G) // G          # quantized storage: one slot per tile


@pytest.mark.parametrize("preset", ["k4v2", "k4v4", "k4v2-fp8", "k4v2-kauto"])
def test_values_of_another_head_dim_have_their_own_layout(preset):
    """value_head_dim (multi-head latent attention decompressed: K 192, V 128): every value
    member has Dv channels, the keys' keep D, and the bytes follow the layout formula."""
    cfg = PRESETS[preset]
    st = packed_state(cfg, batch=3, head_dim=48, value_head_dim=32, max_len=250, spec_tokens=5)
    assert st.nbytes == _expected_nbytes(cfg, batch=3, heads=H, head_dim=48, max_len=250,
                                         exact_size=2, spec_tokens=5, value_head_dim=32)
    assert (st.head_dim, st.value_head_dim) == (48, 32)
    assert st.sink_k.shape[-1] == st.tail_k.shape[-1] == st.k_row_scale.shape[-1] == 48
    assert st.sink_v.shape[-1] == st.tail_v.shape[-1] == st.v_col_scale.shape[-1] == 32
    assert st.v_codes.shape[-1] == 32 * cfg.value_bits // 8
    geo = st.geometry
    assert (geo.head_dim, geo.value_head_dim, geo.key_bits, geo.value_bits) == \
        (48, 32, cfg.key_bits, cfg.value_bits)
    assert "D=48/32" in st.describe()
    assert fp16_cache_bytes(batch=1, kv_heads=2, head_dim=48, value_head_dim=32, tokens=10) \
        == 2 * 10 * (48 + 32) * 2


def test_a_value_head_dim_that_is_not_a_multiple_of_16_is_refused():
    with pytest.raises(ValueError, match="Expected value_head_dim to be a multiple of 16, but got 40"):
        packed_state(head_dim=32, value_head_dim=40)


def test_state_is_far_smaller_than_fp16_for_long_sequences():
    cfg = get_config("k4v2")                              # G=128, the reference preset
    ratios = {}
    for tokens in (4096, 8192, 32768):
        st = packed_state(cfg, batch=1, heads=1, head_dim=128, max_len=tokens)
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
    st = packed_state(cfg, batch=1, heads=1, head_dim=128, max_len=4096)
    k, v = kv(1, 4096, heads=1, head_dim=128)
    append_ref.append_(st.buffers, k, v, torch.zeros(1, dtype=torch.long))
    used = st.used_bytes()
    assert st.n_tiles.tolist() == [31]
    assert used["tiles"] == 31 * (tile + 1)               # + one key-frame flag byte per tile
    assert used["sink"] == used["tail"] == 2 * 128 * 128 * 2
