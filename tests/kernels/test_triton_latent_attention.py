"""The Triton kernel of ``kvarn::latent_attention`` (kernels/triton/latent_attention.py), on
CPU tensors through TRITON_INTERPRET=1 (tests/conftest.py sets it).

* :func:`latent_attention_cuda` (exact region in torch + the kernel's tile partials + the
  lse merge) against the pure-torch reference ``ops.attention.latent_attention`` and the
  float64 oracle ``testing.oracle_latent_attention`` (attention over the dequantized
  [latent | RoPE key] with the latent as the values): decode and 9-query steps, rows of
  different lengths, per-tile key frames (a mix of plain and rotated latent tiles), fp8
  scales, masks, windows, several splits and query blocks;
* :func:`latent_tile_partials` alone against the reference tile region
  (``ops.attention.latent_tile_region``), per frame and split;
* the fp16 operand path (the GPU default) within its rounding; the launcher's checks.

Shapes are tiny (D = 64 or 48, RoPE 16 or 48): the interpreter runs each program in numpy.
"""

# Triton is a dependency and conftest sets TRITON_INTERPRET=1: the kernel always runs here
# (CPU tensors through the interpreter) and fails, never skips, when triton cannot run it.
import pytest
import torch

from kvarn_compile import get_config
from kvarn_compile.config import LATENT_ROPE_BITS
from kvarn_compile.kernels import triton_available
from kvarn_compile.ops.dispatch import latent_attention_cuda, merge_latent_partials
from kvarn_compile.kernels.triton.latent_attention import (
    frame_tile_lists, latent_tile_partials,
)
from kvarn_compile.ops import attention as attention_ref, regions
from kvarn_compile.quant.rotation import rotation_matrix
from kvarn_compile.state import unpack
from kvarn_compile.testing import PackedSequence, latent_rows, oracle_latent_attention

assert triton_available(), "triton must run here (TRITON_INTERPRET=1 on CPU, or CUDA)"

pytestmark = pytest.mark.usefixtures("one_thread")

RANK, ROPE, HEADS, CAP, G = 64, 16, 6, 256, 32


def latent_state(preset: str = "k4v2", *, frames: bool = False, rank: int = RANK, rope: int = ROPE,
                 kv_heads: int = 1, tq: int = 1, **extra) -> PackedSequence:
    """:func:`kvarn_compile.testing.latent_rows` in this file's geometry."""
    return latent_rows(preset, tq=tq, frames=frames, rank=rank, rope=rope, heads=kv_heads,
                       group=G, max_len=CAP, **extra)


def queries(tq: int, rank: int = RANK, rope: int = ROPE, heads: int = HEADS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, heads, tq, rank, generator=gen), torch.randn(2, heads, tq, rope, generator=gen)


def assert_matches(got, q, q_pe, buffers, mask=None, *, tol=1e-5, oracle_tol=None, **kw):
    """``got`` against the reference (fp32, same math) and the float64 oracle."""
    want = attention_ref.latent_attention(q, q_pe, buffers, mask, kw.get("scale"),
                                          kw.get("causal", True), kw.get("window", 0))
    oracle = oracle_latent_attention(q, q_pe, buffers, mask, **kw)
    assert got.shape == q.shape and got.dtype == q.dtype and got.is_contiguous()
    assert torch.isfinite(got).all()
    top = oracle.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=tol * top)
    torch.testing.assert_close(got.double(), oracle, rtol=0, atol=(oracle_tol or tol) * top)


# ============================================================================ the whole op
@pytest.mark.parametrize("tq", [1, 9])
@pytest.mark.parametrize("case", ["rotated", "key-frames", "fp8-scales", "k2"])
def test_latent_attention_cuda_matches_the_reference_and_the_oracle(case, tq):
    """Decode (1 query) and multi-query (9: causal bounds inside the tiles) steps, two rows of
    different lengths, default scale, a window, another scale; 6 query heads of one kv head."""
    preset = "k2v2" if case == "k2" else "k4v2"
    extra = {"scale_dtype": "float8_e4m3fn"} if case == "fp8-scales" else {}
    seq = latent_state(preset, frames=case == "key-frames", tq=tq, **extra)
    q, q_pe = queries(tq)
    for kw in ({}, {"window": 17}, {"scale": 0.05}):
        got = latent_attention_cuda(q, q_pe, seq.buffers, None, kw.get("scale"),
                                    window=kw.get("window", 0))
        assert_matches(got, q, q_pe, seq.buffers, **kw)


@pytest.mark.parametrize("frames", [False, True], ids=["rotated", "key-frames"])
def test_latent_attention_cuda_with_masks(frames):
    """A bool mask per row and query (shared by the heads), an additive mask per head, and a
    mask that hides every packed token of row 1 (only its exact region is left)."""
    tq = 9
    seq = latent_state(frames=frames, tq=tq)
    q, q_pe = queries(tq, seed=1)
    gen = torch.Generator().manual_seed(2)
    bool_mask = torch.rand(2, 1, tq, CAP, generator=gen) > 0.3
    got = latent_attention_cuda(q, q_pe, seq.buffers, bool_mask, None, num_splits=2)
    assert_matches(got, q, q_pe, seq.buffers, bool_mask)
    add_mask = torch.randn(2, HEADS, tq, CAP, generator=gen)
    got = latent_attention_cuda(q, q_pe, seq.buffers, add_mask, None, window=40)
    assert_matches(got, q, q_pe, seq.buffers, add_mask, window=40)
    hide = torch.ones(2, 1, 1, CAP, dtype=torch.bool)
    hide[1, ..., 32:32 + 4 * G] = False                            # row 1's packed tokens
    got = latent_attention_cuda(q, q_pe, seq.buffers, hide, None)
    assert_matches(got, q, q_pe, seq.buffers, hide)


def test_latent_attention_cuda_small_and_padded_widths():
    """A latent and a RoPE key of 48 channels each (padded to 64 in the kernel; the latent
    also in 16-channel blocks, the last one all padding), two kv heads of 3 query heads
    each, key frames in kv head 0 only."""
    tq = 3
    seq = latent_state(frames=True, rank=48, rope=48, kv_heads=2, tq=tq)
    q, q_pe = queries(tq, 48, 48)
    for window, block_dc in ((0, None), (30, 16)):
        got = latent_attention_cuda(q, q_pe, seq.buffers, None, None, window=window, num_splits=2,
                                    block_dc=block_dc)
        assert_matches(got, q, q_pe, seq.buffers, window=window)


def test_latent_attention_cuda_empty_and_partly_empty_states():
    """No tile frozen yet in any row (only the exact region: the kernel sees 0 tiles), and a
    state whose rows are shorter than the sink."""
    cfg = get_config("k4v2", group_size=G, value_bits=LATENT_ROPE_BITS, key_frame="auto")
    seq = PackedSequence(cfg, heads=1, head_dim=RANK, value_head_dim=ROPE, max_len=CAP)
    seq.write(20)
    q, q_pe = queries(1)
    assert_matches(latent_attention_cuda(q, q_pe, seq.buffers, None, None), q, q_pe, seq.buffers)
    seq.write(40)
    assert unpack(seq.buffers).n_tiles.tolist() == [0, 0]
    assert_matches(latent_attention_cuda(q, q_pe, seq.buffers, None, None), q, q_pe, seq.buffers)


def test_latent_attention_cuda_keeps_the_query_dtype():
    seq = latent_state(tq=1)
    q, q_pe = queries(1)
    got = latent_attention_cuda(q.half(), q_pe.half(), seq.buffers, None, None)
    assert got.dtype == torch.float16
    want = attention_ref.latent_attention(q.half(), q_pe.half(), seq.buffers, None, None)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * want.abs().max().item())


def test_latent_attention_cuda_fp16_operands():
    """The GPU default (``input_precision="fp16"``: codes exact in fp16, q * rs, q_pe * cs and
    p * cs rounded to fp16, fp32 sums): within fp16 rounding of the fp32 reference, with key
    frames (an outlier channel of ~400 in the plain tiles) and fp8 scales."""
    tq = 9
    for extra in ({}, {"scale_dtype": "float8_e4m3fn"}):
        seq = latent_state(frames=True, tq=tq, **extra)
        q, q_pe = queries(tq, seed=3)
        got = latent_attention_cuda(q, q_pe, seq.buffers, None, None, window=50,
                                    input_precision="fp16")
        assert_matches(got, q, q_pe, seq.buffers, window=50, tol=2e-3)


# ============================================================================ tile partials
def tile_args(q, q_pe, buffers, mask, causal, window):
    """The launcher's arguments from a latent state, as latent_attention_cuda builds them
    (always with both visibility bounds and the mask as a [B, Hq, Tq, N * G] bias)."""
    f = unpack(buffers)
    d, r = q.shape[-1], q_pe.shape[-1]
    tq = q.shape[2]
    q32 = q.float().contiguous()
    q_rot = (q32 @ rotation_matrix(d)).contiguous()
    pe_rot = (q_pe.float() @ rotation_matrix(r)).contiguous()
    lo, hi = regions.tile_bounds(f, tq, causal, window)
    n, g, s = f.k.codes.shape[2], f.k.col_scale.shape[-1], f.sink_k.shape[2]
    cols = s + torch.arange(n * g)
    bias = regions.bias_at(mask, cols[None, :].expand(q.shape[0], -1), (q.shape[0], q.shape[1], tq))
    factors = None if not f.layout.fp8_factors else (
        f.k.row_factor, f.k.col_factor, f.v.row_factor, f.v.col_factor)
    return ((q_rot, q32 if f.k_plain is not None else None, pe_rot, *f.k.core, *f.v.core,
             f.k_plain, f.n_tiles, lo, hi, bias), factors)


@pytest.mark.parametrize("frames,extra", [(False, {}), (True, {}),
                                          (True, {"scale_dtype": "float8_e4m3fn"})],
                         ids=["rotated", "key-frames", "key-frames-fp8"])
def test_tile_partials_merge_to_the_reference_tile_region(frames, extra):
    """Three splits, 16-row query blocks over 54 query rows (4 blocks, the last partial), both
    bounds and a mask: the partials merged per frame, the rotated frame rotated back, equal
    the reference's tile region (out in the original frame, lse); splits with nothing to
    see are empty (lse = -inf), and each frame's partials hold only that frame's tiles."""
    tq, scale, window = 9, 0.1, 70
    seq = latent_state(frames=frames, tq=tq, **extra)
    q, q_pe = queries(tq, seed=4)
    mask = torch.rand(2, 1, tq, CAP, generator=torch.Generator().manual_seed(5)) > 0.2
    f = unpack(seq.buffers)
    args, factors = tile_args(q, q_pe, seq.buffers, mask, True, window)
    o_part, lse_part = latent_tile_partials(*args, scale, factors=factors, num_splits=3,
                                            block_m=16)
    nf = 2 if frames else 1
    assert o_part.shape == (2, HEADS, tq, nf, 3, RANK) and lse_part.shape == (2, HEADS, tq, nf, 3)
    want_o, want_lse = attention_ref.latent_tile_region(q, q_pe, f, mask, scale, True, window,
                                                        int(f.n_tiles.max()))
    got_o, got_lse = merge_latent_partials(o_part, lse_part)
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(got_lse), fin) and bool(fin.any())
    torch.testing.assert_close(got_lse[fin], want_lse[fin], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(got_o, want_o, rtol=0, atol=1e-5 * want_o.abs().max().item())
    assert bool((got_o[~fin] == 0).all())
    # row 0 holds one tile: of its three splits (per frame), at most one is not empty
    assert bool((torch.isfinite(lse_part[0]).sum(-1) <= 1).all())
    if frames:
        # frame f's partials equal the reference over only the tiles of that frame
        plain = f.k_plain.bool()
        for frame in (0, 1):
            hide = plain if frame == 0 else ~plain                            # [B, 1, N]
            tok_hidden = hide[:, 0].repeat_interleave(G, -1)                  # [B, N*G]
            m = mask.clone()
            m[..., 32:32 + tok_hidden.shape[-1]] &= ~tok_hidden[:, None, None, :]
            ref_o, ref_lse = attention_ref.latent_tile_region(q, q_pe, f, m, scale, True, window,
                                                              int(f.n_tiles.max()))
            o_f, lse_f = regions.combine_splits(o_part[:, :, :, frame], lse_part[:, :, :, frame])
            if frame == 0:
                o_f = o_f @ rotation_matrix(RANK).T
            fin_f = torch.isfinite(ref_lse)
            assert torch.equal(torch.isfinite(lse_f), fin_f) and bool(fin_f.any())
            torch.testing.assert_close(lse_f[fin_f], ref_lse[fin_f], rtol=1e-5, atol=2e-5)
            torch.testing.assert_close(o_f[fin_f], ref_o[fin_f], rtol=0,
                                       atol=1e-5 * ref_o.abs().max().item())


def test_tile_partials_loop_variants():
    """The loop's variants give the same partials as the default (one 64-channel block of
    the latent, 16-token steps, the next step's loads in flight): no register double
    buffering; one step per tile (BLOCK_N = G); the latent in 4 and 2 channel blocks (the
    batched matmuls of D = 512); 64-row query blocks."""
    tq = 9
    seq = latent_state(frames=True, tq=tq)
    q, q_pe = queries(tq, seed=6)
    args, _ = tile_args(q, q_pe, seq.buffers, None, True, 0)
    base = latent_tile_partials(*args, 0.1, num_splits=2, block_n=16, block_dc=64)
    for opts in ({"prefetch": False, "block_n": 16}, {"block_n": G, "block_m": 64},
                 {"block_dc": 16, "block_n": 16}, {"block_dc": 32, "block_n": G, "block_m": 32}):
        got = latent_tile_partials(*args, 0.1, num_splits=2, **opts)
        fin = torch.isfinite(base[1])
        assert torch.equal(torch.isfinite(got[1]), fin)
        torch.testing.assert_close(got[1][fin], base[1][fin], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[0][fin], base[0][fin], rtol=0,
                                   atol=2e-5 * base[0][fin].abs().max().item())


def test_frame_tile_lists():
    k_plain = torch.tensor([[[1, 0, 0, 1, 0, 1]], [[0, 0, 0, 0, 0, 0]]], dtype=torch.uint8)
    ids, count = frame_tile_lists(k_plain, torch.tensor([5, 4]), first=torch.tensor([1, 0]),
                                  last=torch.tensor([6, 2]))
    assert count.tolist() == [[[3, 1]], [[2, 0]]]
    assert ids[0, 0, 0, :3].tolist() == [1, 2, 4] and ids[0, 0, 1, :1].tolist() == [3]
    assert ids[1, 0, 0, :2].tolist() == [0, 1]
    assert ids.dtype == count.dtype == torch.int32


def test_tile_partials_check_their_inputs():
    seq = latent_state(frames=True)
    q, q_pe = queries(1)
    args, _ = tile_args(q, q_pe, seq.buffers, None, True, 0)
    args = list(args)
    with pytest.raises(ValueError, match=r"q_plain"):
        latent_tile_partials(*args[:1], None, *args[2:], 0.1)
    with pytest.raises(ValueError, match=r"q_pe_rot fp32 of shape \[2, 6, 1, 16\]"):
        latent_tile_partials(*args[:2], args[2][..., :8].contiguous(), *args[3:], 0.1)
    bad = list(args)
    bad[7] = args[7][..., :-1].contiguous()                        # v_codes: a short row
    with pytest.raises(ValueError, match=r"RoPE \(V\) code rows of 16 codes"):
        latent_tile_partials(*bad, 0.1)
    with pytest.raises(ValueError, match=r"block_n a power of two >= 16 dividing G=32"):
        latent_tile_partials(*args, 0.1, block_n=64)
    with pytest.raises(ValueError, match=r"block_dc a power of two >= 16 dividing 64"):
        latent_tile_partials(*args, 0.1, block_dc=8)
    fp8 = latent_state(tq=1, scale_dtype="float8_e4m3fn")
    args8, factors = tile_args(q, q_pe, fp8.buffers, None, True, 0)
    with pytest.raises(ValueError, match=r"per-vector factors"):
        latent_tile_partials(*args8, 0.1)


def test_tile_partials_without_tile_slots():
    """A state without tile slots (a growable state before its first tile): empty partials,
    no launch reading past the (empty) tile tensors."""
    seq = latent_state(frames=True)
    q, q_pe = queries(1)
    args, _ = tile_args(q, q_pe, seq.buffers, None, True, 0)
    none = [a[:, :, :0].contiguous() for a in args[3:12]]              # 8 tile tensors, k_plain
    o_part, lse_part = latent_tile_partials(*args[:3], *none, *args[12:15], None, 0.1)
    assert o_part.shape == (2, HEADS, 1, 2, 1, RANK)
    assert bool((lse_part == float("-inf")).all()) and bool((o_part == 0).all())


def test_default_config_takes_narrower_channel_blocks_before_triton_3_9(monkeypatch):
    """At D = 512 the latent kernel runs 256-channel blocks with triton >= 3.9 and 64-channel
    ones before (3.6 spills the wide blocks on sm_90: 608 B, against none); narrow latents
    keep their whole width either way."""
    from kvarn_compile.kernels.triton import latent_attention

    cpu = torch.device("cpu")
    monkeypatch.setattr(latent_attention, "_TRITON_VERSION", (3, 9))
    assert latent_attention.default_config(512, 16, cpu)["block_dc"] == 256
    monkeypatch.setattr(latent_attention, "_TRITON_VERSION", (3, 6))
    assert latent_attention.default_config(512, 16, cpu)["block_dc"] == 64
    assert latent_attention.default_config(48, 16, cpu)["block_dc"] == 64
    monkeypatch.setattr(latent_attention, "_TRITON_VERSION", (3, 10))
    assert latent_attention.default_config(512, 16, cpu)["block_dc"] == 256
