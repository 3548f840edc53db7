"""Keys and values of different head dims (multi-head latent attention decompressed: keys
D = 192, values Dv = 128) in the Triton kernels, on CPU through TRITON_INTERPRET=1.

* the split-K decode kernel (``kvarn_decode_attention``) scores over D and accumulates over
  Dv: against the reference tile partials (``ops.attention.tile_partials``) on packed states
  with sink, tiles and tail populated, GQA, presets k4v2 / k4v4, one and several query
  tokens (causal bounds inside the quantized region), per-tile key frames; and merged with
  the exact region and rotated back with the values' rotation, against the reference
  attention itself;
* the decode step's append (``kernels.triton.append``: the one-program-per-row kernel and
  the tile quantizer, V tiles in the Dv rotation's frame), one token at a time, against the
  reference append: the same buffers after every step.

The (64, 64) and (16, 16) cases are the same code with Dv == D. Shapes are tiny: the
interpreter runs each program in numpy.
"""

import pytest
import torch
import triton
import triton.language as tl

from kvarn_compile.config import get_config
from kvarn_compile.kernels import kvarn_decode_attention, quantize_tiles_into
from kvarn_compile.kernels.triton import append as triton_append
from kvarn_compile.ops import append as append_ref, attention as attention_ref, regions
from kvarn_compile.quant.rotation import rotation_matrix
from kvarn_compile.state import allocate_layer, unpack

G = 32
#: (D, Dv): MLA-like, values wider than keys, and the Dv == D code path
DIMS = [(192, 128), (64, 128), (64, 64), (16, 16)]


def packed(preset: str, d: int, dv: int, lengths: list[int], tq: int = 1, *, frames: bool = False,
           heads: int = 2, seed: int = 0, extra: int = 8, full: bool = True):
    """A state with rows of different lengths (``full``: sink, frozen tiles and a partial tail
    filled in every row), the newest ``tq`` tokens of each row written by a second append."""
    gen = torch.Generator().manual_seed(seed)
    cfg = get_config(preset, group_size=G, key_frame="auto" if frames else "rotated")
    st = allocate_layer(cfg, batch=len(lengths), kv_heads=heads, head_dim=d, value_head_dim=dv,
                        max_len=max(lengths) + extra, dtype=torch.float32)
    for row, n in enumerate(lengths):
        k = torch.randn(1, heads, n, d, generator=gen) * (0.5 + 2 * torch.rand(d, generator=gen))
        v = torch.randn(1, heads, n, dv, generator=gen)
        if frames:               # a bias-like huge key channel in head 0: its tiles go plain
            k[:, 0, :, 3] += 300.0
        sub = [t[row:row + 1] for t in st.buffers]
        for start, stop in ((0, n - tq), (n - tq, n)):
            if stop > start:
                append_ref.append_(sub, k[:, :, start:stop], v[:, :, start:stop],
                                   torch.tensor([start]))
    f = unpack(st.buffers)
    assert f.sink_v.shape[-1] == dv and f.v.col_scale.shape[-1] == dv
    if full:
        assert bool((f.n_tiles > 0).all())
        assert bool((f.lengths > f.sink_k.shape[2] + f.n_tiles * G).all())
    if frames:
        assert bool(f.k_plain.any()) and not bool(f.k_plain.all()), "expected a mix of key frames"
    return st


def kernel_tiles(q, st, *, causal: bool = True, window: int = 0, num_splits: int = 2):
    """The kernel's (out_rot [B, Hq, Tq, Dv], lse) and the reference tile partials."""
    ins = attention_ref.tile_inputs(q, st.buffers, None, causal, window)
    q_rot, q_plain, kc, krs, krz, kcs, vc, vrs, vrz, vcs, kp, nt, lo, hi, _ = ins
    out, lse = kvarn_decode_attention(
        q_rot.contiguous(), kc, krs, krz, kcs, vc, vrs, vrz, vcs, nt, scale=0.3,
        num_splits=num_splits, kv_start=lo if window else None,
        kv_end=hi if q.shape[2] > 1 else None,
        q_plain=None if kp is None else q_plain.contiguous(), k_plain=kp)
    ref_o, ref_lse = attention_ref.tile_partials(*ins, 0.3, 1)
    return out, lse, ref_o[:, :, :, 0], ref_lse[..., 0]


@pytest.mark.parametrize("preset", ["k4v2", "k4v4"])
@pytest.mark.parametrize("d,dv", DIMS)
def test_decode_kernel_matches_the_reference_tiles(d, dv, preset):
    """One query token, GQA (4 query heads over 2 kv heads), two splits, rows of different
    lengths: the output has the values' head dim and equals the reference partials."""
    st = packed(preset, d, dv, [150, 97])
    q = torch.randn(2, 4, 1, d, generator=torch.Generator().manual_seed(1))
    out, lse, ref_o, ref_lse = kernel_tiles(q, st)
    assert out.shape == (2, 4, 1, dv) and lse.shape == (2, 4, 1)
    scale = ref_o.abs().max().item()
    torch.testing.assert_close(out, ref_o, rtol=0, atol=2e-5 * scale)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("d,dv,preset,frames", [(192, 128, "k4v2", True), (64, 128, "k4v4", False),
                                                (16, 16, "k4v2", True)])
def test_decode_kernel_several_queries_window_and_key_frames(d, dv, preset, frames):
    """Three query tokens (causal bounds inside the quantized region: a prefill chunk that
    froze tiles itself), a sliding window, per-tile key frames (plain tiles scored with the
    un-rotated queries)."""
    st = packed(preset, d, dv, [150, 100], tq=3, frames=frames)
    q = torch.randn(2, 4, 3, d, generator=torch.Generator().manual_seed(2))
    out, lse, ref_o, ref_lse = kernel_tiles(q, st, window=70)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and bool(fin.any())
    scale = ref_o.abs().max().item()
    torch.testing.assert_close(out, ref_o, rtol=0, atol=2e-5 * scale)
    torch.testing.assert_close(lse[fin], ref_lse[fin], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("d,dv", [(192, 128), (64, 128)])
def test_decode_kernel_merged_with_the_exact_region_is_the_attention(d, dv):
    """What the CUDA attention does (ops/dispatch.py): exact sink + tail in torch, the tiles
    by the kernel rotated back with the *values'* rotation, merged by lse: the reference
    attention over the whole cache, [B, Hq, 1, Dv]."""
    st = packed("k4v2", d, dv, [150, 97])
    q = torch.randn(2, 4, 1, d, generator=torch.Generator().manual_seed(3))
    f = unpack(st.buffers)
    out_e, lse_e = regions.exact_region(q, f, None, 0.3, True, 0)
    out_t, lse_t, _, _ = kernel_tiles(q, st)
    got, _ = regions.merge_regions(out_e, lse_e, out_t @ rotation_matrix(dv).T, lse_t)
    want = attention_ref.attention(q, st.buffers, None, 0.3, True, 0)
    assert got.shape == want.shape == (2, 4, 1, dv)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * want.abs().max().item())


def test_decode_kernel_checks_the_value_tiles_against_their_own_head_dim():
    st = packed("k4v2", 64, 128, [97])
    f = unpack(st.buffers)
    q = torch.randn(1, 2, 1, 64)
    with pytest.raises(ValueError, match=r"V code rows of 128 codes"):
        kvarn_decode_attention(q, *f.k.core, f.v.codes[..., :-2].contiguous(), *f.v.core[1:],
                               f.n_tiles, scale=0.1)
    with pytest.raises(ValueError, match=r"Expected v_row_scale of shape .*D=64, Dv=128"):
        kvarn_decode_attention(q, *f.k.core, f.v.codes, f.v.row_scale[..., :-1].contiguous(),
                               *f.v.core[2:], f.n_tiles, scale=0.1)


# ================================================================== the decode step's append
def _assert_states_match(got, want, step):
    fg, fw = unpack(got), unpack(want)
    for name in ("lengths", "committed", "n_tiles", "sink_k", "sink_v", "tail_k", "tail_v"):
        assert torch.equal(getattr(fg, name), getattr(fw, name)), f"step {step}: {name}"
    if fw.k_plain is not None:
        assert torch.equal(fg.k_plain, fw.k_plain), f"step {step}: k_plain"
    for kind in "kv":
        a, b = fg.tiles(kind), fw.tiles(kind)
        # codes equal but for rounding ties (the rotation and the stds in another order)
        assert (a.codes != b.codes).float().mean() < 5e-3, f"step {step}: {kind} codes"
        # the scales as the dequant uses them: row x column products (the normalization may
        # keep another of its converged iterations: rows / k, columns * k, same codes)
        for row in ("row_scale", "row_zero"):
            ga = getattr(a, row).float()[..., :, None] * a.col_scale.float()[..., None, :]
            gb = getattr(b, row).float()[..., :, None] * b.col_scale.float()[..., None, :]
            torch.testing.assert_close(ga, gb, rtol=2e-3, atol=1e-3 * gb.abs().max().item() + 1e-6,
                                       msg=f"step {step}: {kind} {row} * col_scale")


@pytest.mark.parametrize("d,dv,preset,frames", [(192, 128, "k4v2", False), (64, 128, "k4v4", False),
                                                (192, 128, "k4v4", True), (16, 16, "k4v2", False)])
def test_append_kernel_one_token_at_a_time_matches_the_reference(d, dv, preset, frames):
    """Decode steps through tile freezes in both rows (the V tiles quantized in the Dv
    rotation's frame, the K tiles in D's, per-tile key frames chosen on the device), then
    row 1 restarts at position 0 (its tokens go into the sink): the reference append's
    buffers after every step, and the attention over them."""
    heads = 2
    st = packed(preset, d, dv, [2 * G + 20, 2 * G - 6], frames=frames, extra=40, full=False)
    ref = [t.clone() for t in st.buffers]
    triton_append.error_flags("cpu").zero_()
    gen = torch.Generator().manual_seed(4)
    froze = 0
    for step in range(14):
        k = torch.randn(2, heads, 1, d, generator=gen) * 2
        if frames:
            k[:, 0, :, 3] += 300.0
        v = torch.randn(2, heads, 1, dv, generator=gen)
        pos = unpack(ref).lengths.clone()
        if step == 9:
            pos[1] = 0                                      # row 1 starts a new sequence
        f = unpack(st.buffers)
        assert triton_append.applies(f, k, "kvarn", 0, False, v=v)
        before = f.n_tiles.clone()
        triton_append.append_decode(st.buffers, k, v, pos.clone(), method="kvarn", iters=8,
                                    recent=0)
        froze += int((unpack(st.buffers).n_tiles - before).clamp(min=0).sum())
        append_ref.append_(ref, k, v, pos.clone(), "kvarn", 8, 0)
        _assert_states_match(st.buffers, ref, step)
    assert froze >= 2, "the steps must freeze tiles in both rows"
    assert int(triton_append.error_flags("cpu")) == 0
    q = torch.randn(2, 2 * heads, 1, d, generator=gen)
    got = attention_ref.attention(q, st.buffers, None, 0.3, True, 0)
    want = attention_ref.attention(q, ref, None, 0.3, True, 0)
    assert got.shape == (2, 2 * heads, 1, dv)
    torch.testing.assert_close(got, want, rtol=0, atol=5e-3 * want.abs().max().item())


def test_append_applies_checks_the_values_head_dim():
    st = packed("k4v2", 64, 128, [40, 40], full=False)
    f = unpack(st.buffers)
    k = torch.randn(2, 2, 1, 64)
    assert triton_append.applies(f, k, "kvarn", 0, False)
    assert triton_append.applies(f, k, "kvarn", 0, False, v=torch.randn(2, 2, 1, 128))
    assert not triton_append.applies(f, k, "kvarn", 0, False, v=torch.randn(2, 2, 1, 64))


def test_quantizer_takes_the_values_rotation_for_value_tiles():
    """V tiles of Dv-wide values: the default rotation is Dv's; the keys' (D x D) is refused
    with a clear error instead of rotating in the wrong frame."""
    st = packed("k4v2", 192, 128, [40], full=False)
    f = unpack(st.buffers)
    x = torch.randn(1, 2, G, 128)
    with pytest.raises(ValueError, match=r"rotation of shape \[128, 128\]"):
        quantize_tiles_into(x, *f.v.core, kind="v", bits=2, rotate=True, normalize=True,
                            dst_tile=torch.tensor([0]), rotation=rotation_matrix(192))


@triton.jit
def _dominant_kernel(x_ptr, out_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr, G: tl.constexpr,
                     DOMINANCE: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, G)
    d_ok = offs_d < D
    x = tl.load(x_ptr + offs_t[:, None] * D + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    hi = tl.max(x, axis=0)
    lo = tl.min(x, axis=0)
    peak = tl.max(tl.abs(x), axis=0)
    tl.store(out_ptr, triton_append._dominant(hi, lo, peak, d_ok, D, BLOCK_D, DOMINANCE)
             .to(tl.int32))


@pytest.mark.parametrize("d", [192, 128, 96, 16])
def test_device_key_frame_choice_takes_the_references_median(d):
    """The append kernel's key-frame choice (``_dominant``) against the reference's dominance
    (``quant.key_dominance``: max |k| / the sorted channel range at D // 2) with the
    threshold just below and just above it: the median is that very range, ties (copied
    channels) and the padding's channels included."""
    from kvarn_compile.quant.quantize import key_dominance

    gen = torch.Generator().manual_seed(d)
    x = torch.randn(G, d, generator=gen) * (0.5 + 2 * torch.rand(d, generator=gen))
    x[:, 1::4] = x[:, 0::4]                    # equal ranges around the median
    x[:, 3] += 40.0
    dominance = float(key_dominance(x))
    out = torch.empty((), dtype=torch.int32)
    for factor, want in ((1 - 1e-4, 1), (1 + 1e-4, 0)):
        _dominant_kernel[(1,)](x, out, D=d, BLOCK_D=triton.next_power_of_2(d), G=G,
                               DOMINANCE=dominance * factor)
        assert int(out) == want, (d, factor, dominance)
