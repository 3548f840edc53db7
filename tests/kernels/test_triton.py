"""The Triton kernels against the pure-torch reference (CPU: through TRITON_INTERPRET=1).

Quantize kernel: codes must equal ``kvarn_compile.quant.quantize_kv``'s except at rounding
ties, scales up to fp16 rounding. Decode attention kernel: against softmax attention in float64
(``kvarn_compile.testing.reference_attention``) over the quantizer's dequantized tiles. Grids
are kept to tens of programs: the interpreter runs each program instance in Python/numpy.
"""

import functools

# Triton is a dependency and conftest sets TRITON_INTERPRET=1: these kernels always run here
# (CPU tensors through the interpreter) and fail, never skip, when triton cannot run them.
import pytest
import torch
import triton
import triton.language as tl

from kvarn_compile.kernels import (
    combine_splits, kvarn_decode_attention, kvarn_decode_attention_tiles,
    quantize_tiles_into, quantize_tiles_triton,
)
from kvarn_compile import testing
from kvarn_compile.kernels.triton.quantize import _imbalance, _normalize_variance, _rne
from kvarn_compile.quant.quantize import (
    NonFiniteError, QuantizedTiles, dequantize_tiles, imbalance, normalize_variance, quantize_kv,
    unpack_codes,
)

METHOD_FLAGS = {"kvarn": (True, True), "hadamard": (True, False), "kivi": (False, False)}
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def kv_like(*lead: int, tokens: int, d: int) -> torch.Tensor:
    """``kvarn_compile.testing.kv_like`` on DEV."""
    return testing.kv_like(*lead, tokens=tokens, d=d, device=DEV)


def assert_codes_match(got: QuantizedTiles, ref: QuantizedTiles) -> None:
    """Codes equal except at rounding ties: at most ±1, on under 0.5% of the codes.

    A tie is a value (B - lo) / Δ within a few fp32 ulps of k + 0.5. The kernel computes the
    rotation matmul, the std reductions and exp/log in fp32 in a different summation order
    than torch, so such a value can land on the other side of the boundary. (Under the
    interpreter, numpy happens to reproduce torch bit for bit and the codes are identical.)
    """
    a = unpack_codes(got.codes, got.bits).int()
    b = unpack_codes(ref.codes, ref.bits).int()
    diff = (a - b).abs()
    assert diff.max().item() <= 1
    assert (diff > 0).float().mean().item() < 5e-3


def assert_scales_match(got: QuantizedTiles, ref: QuantizedTiles) -> None:
    """Folded scales equal up to fp16 rounding, modulo the normalization's gauge freedom.

    X / c* / r* is unchanged by c* -> k c*, r* -> r* / k, and once the normalization has
    converged its iterations drift along that direction with an imbalance equal to ~1 ulp.
    The "<=" best-so-far pick between such iterations then depends on fp32 rounding, and
    the kernel may keep another iteration than torch: same codes, row scales divided and
    column scales multiplied by a common k (seen up to k = 1.07). So compare what the
    dequant uses, the gauge-invariant products row_scale[r] * col_scale[c] and
    row_zero[r] * col_scale[c] (rtol 2e-3: two fp16 roundings), and the individual scales
    exactly where there is no gauge (no normalization: every column scale is 1).
    """
    for name in ("row_scale", "row_zero", "col_scale"):
        g, r = getattr(got, name), getattr(ref, name)
        assert g.dtype == r.dtype and g.shape == r.shape, name
    for row in ("row_scale", "row_zero"):
        g = getattr(got, row).float()[..., :, None] * got.col_scale.float()[..., None, :]
        r = getattr(ref, row).float()[..., :, None] * ref.col_scale.float()[..., None, :]
        torch.testing.assert_close(g, r, rtol=2e-3, atol=1e-3 * r.abs().max().item() + 1e-6,
                                   msg=f"{row} * col_scale")
    if bool((ref.col_scale == 1).all()):
        for name in ("row_scale", "row_zero", "col_scale"):
            r = getattr(ref, name).float()
            torch.testing.assert_close(getattr(got, name).float(), r, rtol=2e-3,
                                       atol=1e-3 * r.abs().max().item() + 1e-6, msg=name)


# ======================================================================= quantize kernel
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("method", ["kvarn", "hadamard", "kivi"])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_quantize_matches_reference(kind, bits, method, d):
    """K and V, 2/4 bits, all three methods, power-of-two and padded (96 -> 128) head dims."""
    x = kv_like(1, 2, tokens=128, d=d)  # 2 heads x 2 tiles of G=64: 4 programs
    rotate, normalize = METHOD_FLAGS[method]
    got = quantize_tiles_triton(x, kind, bits, rotate=rotate, normalize=normalize, group=64)
    ref = quantize_kv(x, kind, method=method, bits=bits, group=64)
    assert got.codes.shape == ref.codes.shape and got.bits == bits
    assert_codes_match(got, ref)
    assert_scales_match(got, ref)


@pytest.mark.parametrize("d,kind,bits", [(80, "k", 4), (80, "v", 2), (112, "v", 4),
                                         (64, "k", 8), (64, "v", 8), (192, "k", 4), (192, "v", 2),
                                         (176, "k", 4), (256, "k", 4), (320, "k", 2)])
def test_quantize_more_dims_and_8_bits(d, kind, bits):
    """Non-power-of-two head dims (Paley/Kronecker rotations, masked padding) and 8-bit codes;
    D = 192 rotates in chunks of 64 channels (``ROT_CHUNK``), its keys in two parts (128 +
    64), its values padded to 256; D = 176 keys padded to 256 rows (not two powers of two);
    D = 256 keys in two parts of 128, D = 320 in 256 + 64 (16 warps)."""
    x = kv_like(2, 1, tokens=32, d=d)
    got = quantize_tiles_triton(x, kind, bits, rotate=True, normalize=True, group=32)
    ref = quantize_kv(x, kind, method="kvarn", bits=bits, group=32)
    assert_codes_match(got, ref)
    assert_scales_match(got, ref)


def test_rne_rounds_half_to_even():
    @triton.jit
    def _round_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, _rne(tl.load(x_ptr + offs)))

    x = torch.tensor([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 0.49999997, 2.5000002, 1.0, 0.0,
                      14.5, 15.5, 7.25, -7.75, 1e6 + 0.5], device=DEV)
    y = torch.empty_like(x)
    _round_kernel[(1,)](x, y, BLOCK=16)
    torch.testing.assert_close(y, torch.round(x), rtol=0, atol=0)


@triton.jit
def _two_part_normalization_kernel(x_ptr, score_ptr, col_ptr, row_ptr, iters, RA: tl.constexpr,
                                   RB: tl.constexpr, C: tl.constexpr):
    offs_c = tl.arange(0, C)
    ra = tl.arange(0, RA)
    rb = RA + tl.arange(0, RB)
    x = tl.load(x_ptr + ra[:, None] * C + offs_c[None, :])
    x2 = tl.load(x_ptr + rb[:, None] * C + offs_c[None, :])
    row_valid = ra < RA + RB
    col_valid = offs_c < C
    mask = row_valid[:, None] & col_valid[None, :]
    tl.store(score_ptr, _imbalance(x, mask, row_valid, col_valid, RA + RB, C, False, x2, RB)[1])
    col, row, row2 = _normalize_variance(x, mask, row_valid, col_valid, iters, RA + RB, C, RA, C,
                                         False, None, False, x2, RB)
    tl.store(col_ptr + offs_c, col)
    tl.store(row_ptr + ra, row)
    tl.store(row_ptr + rb, row2)


@pytest.mark.parametrize("ra,rb,loud", [(64, 32, "second"), (32, 16, "first"), (16, 16, "none")])
def test_normalization_of_a_tile_in_two_parts(ra, rb, loud):
    """A key tile held as two row parts (D = 96 = 64 + 32: ``PART_A``): the imbalance and the
    normalization's scales are those of the whole tile (the reference's), with the largest
    and the smallest row stds in either part."""
    gen = torch.Generator().manual_seed(ra + rb)
    c = 32
    x = torch.randn(ra + rb, c, generator=gen) * (0.5 + 2 * torch.rand(c, generator=gen))
    if loud == "second":
        x[ra:] *= 20
    elif loud == "first":
        x[:ra] *= 20
    score = torch.empty((), device=DEV)
    col, row = torch.empty(c, device=DEV), torch.empty(ra + rb, device=DEV)
    _two_part_normalization_kernel[(1,)](x.to(DEV), score, col, row, 6, RA=ra, RB=rb, C=c)
    torch.testing.assert_close(score.cpu().double(), imbalance(x.double()), rtol=1e-5, atol=0)
    want_col, want_row = normalize_variance(x, 6)
    torch.testing.assert_close(col.cpu(), want_col, rtol=1e-4, atol=0)
    torch.testing.assert_close(row.cpu(), want_row, rtol=1e-4, atol=0)


def test_quantize_exact_ties_and_degenerate_tiles():
    """Exact ties round half to even; constant tiles and zero-variance rows reconstruct exactly."""
    g, d = 32, 64
    x = torch.zeros(1, 1, 3 * g, d)
    # tile 0 (kivi, V rows): each row is [0, 3, 0.5, 1.5, 2.5, ...] -> Δ = 1, ties at .5
    x[..., :g, :] = torch.tensor([0.0, 3.0, 0.5, 1.5, 2.5, 1.0, 2.0, 0.0]).repeat(d // 8)
    x[..., g:2 * g, :] = 1.25                   # tile 1: constant
    x[..., 2 * g:, :] = torch.randn(g, d)       # tile 2: random with one constant channel
    x[..., 2 * g:, 5] = -2.0
    x = x.to(DEV)
    got = quantize_tiles_triton(x, "v", 2, rotate=False, normalize=False, group=g)
    ref = quantize_kv(x, "v", method="kivi", bits=2, group=g)
    torch.testing.assert_close(got.codes, ref.codes, rtol=0, atol=0)
    assert unpack_codes(got.codes, 2)[0, 0, 0, 0, :8].tolist() == [0, 3, 0, 2, 2, 1, 2, 0]
    for method in ("kvarn", "hadamard", "kivi"):
        rotate, normalize = METHOD_FLAGS[method]
        for kind in ("k", "v"):
            got = quantize_tiles_triton(x, kind, 4, rotate=rotate, normalize=normalize, group=g)
            ref = quantize_kv(x, kind, method=method, bits=4, group=g)
            assert_codes_match(got, ref)
            assert_scales_match(got, ref)
            if not rotate:  # constant tile exact; constant channel exact for K (one row)
                deq = dequantize_tiles(got)
                assert torch.equal(deq[0, 0, 1], torch.full_like(deq[0, 0, 1], 1.25))


@pytest.mark.parametrize("iters", [0, 1, 16])
def test_quantize_iterations(iters):
    x = kv_like(1, 1, tokens=64, d=64)
    got = quantize_tiles_triton(x, "k", 4, rotate=True, normalize=True, iters=iters, group=64)
    ref = quantize_kv(x, "k", method="kvarn", bits=4, group=64, iters=iters)
    assert_codes_match(got, ref)
    assert_scales_match(got, ref)


def test_quantize_into_cache_slots():
    """The runtime path: strided fp16 token views written at per-row tile indices, in place."""
    b, h, cap, g, d = 2, 2, 4, 32, 64
    tokens = kv_like(b, h, tokens=3 * g, d=d).to(torch.float16)
    src = tokens[:, :, g:]                          # a strided view: 2 tiles per (b, h)
    k_dst = QuantizedTiles(
        codes=torch.full((b, h, cap, d, g // 2), 7, dtype=torch.uint8, device=DEV),
        row_scale=torch.full((b, h, cap, d), -1.0, dtype=torch.float32, device=DEV),
        row_zero=torch.full((b, h, cap, d), -1.0, dtype=torch.float32, device=DEV),
        col_scale=torch.full((b, h, cap, g), -1.0, dtype=torch.float32, device=DEV), bits=4)
    before = [t.clone() for t in k_dst.tensors()]
    dst_tile = torch.tensor([[3, 0], [-1, 1]], device=DEV)  # row 1 writes only its 2nd tile
    quantize_tiles_into(src, k_dst.codes, k_dst.row_scale, k_dst.row_zero, k_dst.col_scale,
                        kind="k", bits=4, rotate=True, normalize=True, dst_tile=dst_tile)
    ref = quantize_kv(src, "k", method="kvarn", bits=4, group=g, scale_dtype=torch.float32)
    written = {(0, 3): (0, 0), (0, 0): (0, 1), (1, 1): (1, 1)}  # (row, dst) -> (row, src)
    for row in range(b):
        for slot in range(cap):
            got = QuantizedTiles(*(t[row, :, slot] for t in k_dst.tensors()), bits=4)
            if (row, slot) in written:
                r, s = written[(row, slot)]
                want = QuantizedTiles(*(t[r, :, s] for t in ref.tensors()), bits=4)
                assert_codes_match(got, want)
                assert_scales_match(got, want)
            else:
                for t, old in zip(got.tensors(), before):
                    assert torch.equal(t, old[row, :, slot])

    # one tile per row, a [B] index, bf16 input, V layout
    v_src = tokens[:, :, :g].to(torch.bfloat16)
    v_dst = quantize_tiles_triton(kv_like(b, h, tokens=cap * g, d=d), "v", 2, rotate=True,
                                  normalize=True, group=g)
    quantize_tiles_into(v_src, v_dst.codes, v_dst.row_scale, v_dst.row_zero, v_dst.col_scale,
                        kind="v", bits=2, rotate=True, normalize=True,
                        dst_tile=torch.tensor([2, 0], dtype=torch.int32, device=DEV))
    ref = quantize_kv(v_src, "v", method="kvarn", bits=2, group=g)
    for row, slot in ((0, 2), (1, 0)):
        got = QuantizedTiles(*(t[row, :, slot] for t in v_dst.tensors()), bits=2)
        want = QuantizedTiles(*(t[row, :, 0] for t in ref.tensors()), bits=2)
        assert_codes_match(got, want)
        assert_scales_match(got, want)


def test_quantize_validation_and_nonfinite():
    x = kv_like(1, 1, tokens=64, d=64)
    with pytest.raises(NotImplementedError, match="3-bit"):
        quantize_tiles_triton(x, "k", 3, rotate=True, normalize=True, group=64)
    with pytest.raises(NotImplementedError, match="power-of-two tile length"):
        quantize_tiles_triton(x[..., :48, :], "k", 4, rotate=True, normalize=True, group=24)
    with pytest.raises(ValueError, match="Expected kind"):
        quantize_tiles_triton(x, "q", 4, rotate=True, normalize=True, group=64)
    q = quantize_tiles_triton(x, "k", 4, rotate=True, normalize=True, group=64)
    with pytest.raises(ValueError, match=r"Expected dst_codes of shape .* but got"):
        quantize_tiles_into(x, q.codes[..., :-1].contiguous(), q.row_scale, q.row_zero,
                            q.col_scale, kind="k", bits=4, rotate=True, normalize=True)
    with pytest.raises(ValueError, match="Expected a contiguous dst_row_scale"):
        strided = torch.empty(1, 1, 1, 128, dtype=torch.float16, device=DEV)[..., ::2]
        quantize_tiles_into(x, q.codes, strided, q.row_zero, q.col_scale, kind="k", bits=4,
                            rotate=True, normalize=True)
    fp8 = q.row_scale.to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="float8_e4m3fn"):
        quantize_tiles_into(x, q.codes, fp8, q.row_zero, q.col_scale, kind="k", bits=4,
                            rotate=True, normalize=True)
    with pytest.raises(TypeError, match="Expected dst_tile of dtype"):
        quantize_tiles_into(x, q.codes, q.row_scale, q.row_zero, q.col_scale, kind="k", bits=4,
                            rotate=True, normalize=True,
                            dst_tile=torch.zeros(1, 1, device=DEV))

    bad = x.clone()
    bad[0, 0, 5, 2] = float("nan")
    with pytest.raises(NonFiniteError):
        quantize_tiles_triton(bad, "k", 4, rotate=True, normalize=True, group=64)
    with pytest.raises(NonFiniteError):
        quantize_tiles_into(bad, q.codes, q.row_scale, q.row_zero, q.col_scale, kind="k",
                            bits=4, rotate=True, normalize=True, check_finite=True)
    got = quantize_tiles_triton(bad, "k", 4, rotate=True, normalize=True, group=64,
                                nonfinite="reference")
    ref = quantize_kv(bad, "k", method="kvarn", bits=4, group=64)
    assert torch.equal(got.codes, ref.codes)
    assert torch.isnan(got.col_scale[0, 0, 0, 5]) and torch.isfinite(got.col_scale[..., 6]).all()


# ============================================================= decode attention kernel
def oracle_attention(q, k: QuantizedTiles, v: QuantizedTiles, n_tiles, scale, kv_start=None):
    """Softmax attention in float64 over the dequantized valid tiles (rotated frame):
    ``kvarn_compile.testing.reference_attention`` over the first n_tiles[b] tiles of each row,
    every query sees every valid key (decode over tiles) from ``kv_start`` on; (out, lse)."""
    kd = dequantize_tiles(k).double().transpose(-1, -2).cpu()  # [B, H, N, G, D]
    vd = dequantize_tiles(v).double().cpu()                    # [B, H, N, G, Dv]
    b, h, n, g, d = kd.shape
    kd, vd = kd.reshape(b, h, n * g, d), vd.reshape(b, h, n * g, vd.shape[-1])
    return testing.reference_attention(q.cpu(), kd, vd, lengths=n_tiles.cpu() * g, scale=scale,
                                       causal=False, kv_start=None if kv_start is None else kv_start.cpu(),
                                       return_lse=True)


def assert_attention_close(out, lse, ref_out, ref_lse):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse))
    mag = ref_out.abs().max().item() + 1e-6
    torch.testing.assert_close(out.double().cpu(), ref_out, rtol=0, atol=1e-4 * mag)
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double().cpu()[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)
    assert (out.cpu()[~fin] == 0).all()


@functools.lru_cache(maxsize=None)
def make_cache(b, h, n, g, d, kb, vb):
    """Reference-quantized K/V tiles [b, h, n, ...], built once per shape (tests share them:
    the reference's many small torch ops are the slow part of these tests on a loaded CPU)."""
    gen = torch.Generator().manual_seed(hash((b, h, n, g, d, kb, vb)) % 2**31)

    def data():
        x = torch.randn(b, h, n * g, d, generator=gen) * (0.5 + 2 * torch.rand(d, generator=gen))
        x[..., 3] += 8.0
        return x.to(DEV)

    return (quantize_kv(data(), "k", bits=kb, group=g),
            quantize_kv(data(), "v", bits=vb, group=g))


@pytest.mark.parametrize("kb,vb", [(4, 2), (2, 2), (4, 4)])
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("tq", [1, 4])
@pytest.mark.parametrize("group_q", [1, 3, 7])
def test_decode_attention_matches_oracle(group_q, tq, split, kb, vb):
    """MHA and GQA (g = 3, 7: padded query blocks), Tq = 1/4, per-row n_tiles incl. 0."""
    b, h, n, d = 3, 2, 3, 64
    g = 64 if kb == 2 else 32
    k, v = make_cache(b, h, n, g, d, kb, vb)
    q = torch.randn(b, h * group_q, tq, d, device=DEV)
    n_tiles = torch.tensor([3, 0, 2], device=DEV)
    out, lse = kvarn_decode_attention_tiles(q, k, v, n_tiles, scale=d ** -0.5, num_splits=split)
    assert out.shape == (b, h * group_q, tq, d) and lse.shape == (b, h * group_q, tq)
    assert_attention_close(out, lse, *oracle_attention(q, k, v, n_tiles, d ** -0.5))


@pytest.mark.parametrize("precision", ["ieee", "fp16"])
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("block_n", [16, 32])
def test_decode_attention_steps_prefetch_and_fp16_codes(block_n, prefetch, precision):
    """Tiles walked in G // BLOCK_N steps (2 and 4 per 64-token tile), with and without the
    next step's loads issued early, exact fp32 dots and fp16 operands (codes as 1024 + code,
    the 1024 * rowsum taken off): the oracle, per-row tile counts incl. 0, a window bound
    inside a tile, more splits than some rows have tiles."""
    b, h, n, g, d, group_q = 3, 2, 3, 64, 64, 4
    k, v = make_cache(b, h, n, g, d, 4, 2)
    q = torch.randn(b, h * group_q, 1, d, device=DEV) * 2
    n_tiles = torch.tensor([3, 0, 2], device=DEV)
    kv_start = torch.tensor([[0], [0], [70]], device=DEV)
    out, lse = kvarn_decode_attention_tiles(q, k, v, n_tiles, scale=d ** -0.5, num_splits=2,
                                            kv_start=kv_start, block_n=block_n,
                                            prefetch=prefetch, input_precision=precision)
    ref_out, ref_lse = oracle_attention(q, k, v, n_tiles, d ** -0.5, kv_start)
    if precision == "ieee":
        assert_attention_close(out, lse, ref_out, ref_lse)
    else:   # operands rounded to 11 significant bits, fp32 sums
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isneginf(lse.cpu()), ~fin)
        mag = ref_out.abs().max().item()
        torch.testing.assert_close(out.double().cpu(), ref_out, rtol=0, atol=3e-3 * mag)
        torch.testing.assert_close(lse.double().cpu()[fin], ref_lse[fin], rtol=0, atol=3e-3)


#: The phased fp16 loop's cases: (G, D, Dv, K bits, V bits, BLOCK_N, key frames). Multi-chunk
#: tiles (BLOCK_N < G), a padded key head dim (D = 96 in a 128 block), keys and values of
#: different head dims, every code width on both sides, one 16-token phase (2-bit keys at
#: BLOCK_N 64, 2-bit values at Dv 64), per-tile key frames.
PHASED_CASES = [(64, 64, 64, 4, 2, 32, False), (64, 96, 64, 2, 4, 64, False),
                (32, 64, 128, 8, 8, 32, False), (64, 128, 64, 4, 2, 64, True),
                (32, 64, 64, 8, 4, 16, False)]


@pytest.mark.parametrize("g,d,dv,kb,vb,block_n,frames", PHASED_CASES)
def test_phased_fp16_loop_matches_the_exact_loop(g, d, dv, kb, vb, block_n, frames):
    """``_decode_range_phased`` (codes regrouped by their position in a 16-bit word, two per
    MMA register) against the exact fp32 byte loop on the same tiles, with every mask the
    loop takes: a window start and a causal end inside the quantized region, an additive
    bias, rows with no tile; with and without the next chunk's loads in flight. The
    difference is the fp16 rounding of the operands (11 significant bits). A bool mask gives
    what the additive 0 / -inf mask it stands for gives, bit for bit."""
    from kvarn_compile.kernels.triton.attention import phased_decode
    from kvarn_compile.quant.rotation import rotation_matrix

    assert phased_decode("fp16", block_n, kb, dv, vb), "the case must take the phased loop"
    b, h, n, group_q, tq = 2, 2, 3, 2, 3
    gen = torch.Generator().manual_seed(g + d + dv + kb + vb + block_n)
    x = torch.randn(b, h, n * g, d, generator=gen) * (0.5 + 2 * torch.rand(d, generator=gen))
    if frames:
        x[:, 0, :, 7] += 120 * torch.cos(0.4 * torch.arange(n * g, dtype=torch.float32))
    k = quantize_kv(x.to(DEV), "k", bits=kb, group=g, key_frame="auto" if frames else "rotated")
    v = quantize_kv(torch.randn(b, h, n * g, dv, generator=gen).to(DEV), "v", bits=vb, group=g)
    assert frames == (k.plain is not None and 0 < int(k.plain.sum()) < k.plain.numel())
    q = torch.randn(b, h * group_q, tq, d, generator=gen).to(DEV) * 2
    extra = {"q_plain": q @ rotation_matrix(d, q.device).T} if frames else {}
    n_tiles = torch.tensor([3, 0], device=DEV)
    kv_start = torch.tensor([[0, 5, g + 3], [0, 0, 0]], device=DEV)
    kv_end = torch.tensor([[n * g, 2 * g + 1, n * g - 7], [n * g, n * g, n * g]], device=DEV)
    bias = torch.randn(b, 1, tq, n * g, generator=gen).to(DEV)
    bias[0, 0, 1, g + 1] = float("-inf")
    args = dict(scale=d ** -0.5, num_splits=2, kv_start=kv_start, kv_end=kv_end, bias=bias,
                block_n=block_n, **extra)
    ref_out, ref_lse = kvarn_decode_attention_tiles(q, k, v, n_tiles, input_precision="ieee",
                                                    **args)
    fin = torch.isfinite(ref_lse)
    assert fin[0].all() and not fin[1].any()
    mag = ref_out.abs().max().item()
    # a bool mask (True attends; the loop holds it as one bit per token) scores exactly as
    # the additive 0 / -inf mask it stands for
    keep = (torch.rand(b, 1, tq, n * g, generator=gen) > 0.3).to(DEV)
    keep[..., g + 3:g + 5] = True
    as_float = torch.where(keep, 0.0, float("-inf"))
    for prefetch in (False, True):
        out, lse = kvarn_decode_attention_tiles(q, k, v, n_tiles, input_precision="fp16",
                                                prefetch=prefetch, **args)
        assert torch.equal(torch.isneginf(lse), ~fin) and (out[~fin] == 0).all()
        torch.testing.assert_close(out, ref_out, rtol=0, atol=3e-3 * mag)
        torch.testing.assert_close(lse[fin], ref_lse[fin], rtol=1e-3, atol=3e-3)
        got = kvarn_decode_attention_tiles(q, k, v, n_tiles, input_precision="fp16",
                                           prefetch=prefetch, **{**args, "bias": keep})
        want = kvarn_decode_attention_tiles(q, k, v, n_tiles, input_precision="fp16",
                                            prefetch=prefetch, **{**args, "bias": as_float})
        assert torch.isfinite(want[1][0]).any() and not torch.isfinite(want[1][1]).any()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_phased_decode_takes_phases_at_least_16_wide():
    """The phased loop needs 16 tokens per K phase and 16 channels per V phase (tl.dot's
    smallest operand) and fp16 operands; the byte loop takes everything else."""
    from kvarn_compile.kernels.triton.attention import phased_decode

    assert phased_decode("fp16", 128, 4, 128, 2)
    assert phased_decode("fp16", 32, 4, 64, 2) and phased_decode("fp16", 16, 8, 16, 8)
    assert not phased_decode("fp16", 16, 4, 128, 2)       # 8 tokens per K phase
    assert not phased_decode("fp16", 32, 2, 128, 2)       # 2-bit keys: 8 tokens per phase
    assert not phased_decode("fp16", 128, 4, 32, 2)       # 2-bit values, Dv 32: 8 channels
    assert not phased_decode("fp16", 128, 4, 68, 2)       # a V row of 17 bytes: no 16-bit words
    assert not phased_decode("tf32", 128, 4, 128, 2) and not phased_decode("ieee", 128, 4, 128, 2)


@pytest.mark.parametrize("split", [1, 4])
def test_decode_attention_window_and_empty_splits(split):
    """kv_start lower bounds (incl. a fully masked query row), more splits than tiles."""
    b, h, n, g, d, group_q, tq = 3, 1, 3, 32, 64, 2, 3
    k, v = make_cache(b, h, n, g, d, 4, 2)
    q = torch.randn(b, h * group_q, tq, d, device=DEV) * 3
    n_tiles = torch.tensor([3, 1, 2], dtype=torch.int32, device=DEV)
    kv_start = torch.tensor([[0, 31, 70], [5, 32, 100], [40, 41, 63]], device=DEV)
    out, lse, o_part, lse_part = kvarn_decode_attention_tiles(
        q, k, v, n_tiles, scale=0.2, num_splits=split, kv_start=kv_start, return_partials=True)
    assert o_part.shape == (b, h * group_q, tq, split, d)
    assert torch.isneginf(lse[1, :, 1:]).all()         # row 1 has 32 tokens, all masked
    assert_attention_close(out, lse, *oracle_attention(q, k, v, n_tiles, 0.2, kv_start))


def test_decode_attention_query_blocks_and_fp32_scales():
    """g * Tq = 28 rows over two BLOCK_M = 16 query blocks (grid axis 2), fp32 scale storage."""
    b, h, n, g, d, group_q, tq = 2, 1, 2, 32, 64, 7, 4
    k = quantize_kv(kv_like(b, h, tokens=n * g, d=d), "k", bits=4, group=g,
                    scale_dtype=torch.float32)
    v = quantize_kv(kv_like(b, h, tokens=n * g, d=d), "v", bits=4, group=g,
                    scale_dtype=torch.bfloat16)
    q = torch.randn(b, h * group_q, tq, d, device=DEV)
    n_tiles = torch.tensor([2, 1], device=DEV)
    kv_start = torch.tensor([[0, 10, 20, 40], [3, 3, 3, 3]], device=DEV)
    out, lse = kvarn_decode_attention_tiles(q, k, v, n_tiles, scale=d ** -0.5, num_splits=2,
                                            kv_start=kv_start, block_m=16)
    assert_attention_close(out, lse, *oracle_attention(q, k, v, n_tiles, d ** -0.5, kv_start))


def test_decode_attention_padded_head_dim_and_kernel_quantized_cache():
    """End to end on kernels: tiles written by the quantize kernel, D = 96 (padded to 128)."""
    b, h, n, g, d, group_q = 2, 2, 2, 32, 96, 2
    kq = quantize_tiles_triton(kv_like(b, h, tokens=n * g, d=d), "k", 4, rotate=True,
                               normalize=True, group=g)
    vq = quantize_tiles_triton(kv_like(b, h, tokens=n * g, d=d), "v", 2, rotate=True,
                               normalize=True, group=g)
    q = torch.randn(b, h * group_q, 2, d, device=DEV)
    n_tiles = torch.tensor([1, 2], device=DEV)
    out, lse = kvarn_decode_attention_tiles(q, kq, vq, n_tiles, scale=d ** -0.5, num_splits=2)
    assert_attention_close(out, lse, *oracle_attention(q, kq, vq, n_tiles, d ** -0.5))


@pytest.mark.parametrize("d,dv", [(192, 128), (64, 128)])
def test_decode_attention_keys_and_values_of_different_head_dims(d, dv):
    """MLA-style tiles written by the quantize kernel: keys D = 192 (padded to 256, chunked
    rotation), values Dv = 128; GQA, two splits, a window bound: the output is [.., Dv]."""
    b, h, n, g, group_q = 2, 2, 2, 32, 2
    kq = quantize_tiles_triton(kv_like(b, h, tokens=n * g, d=d), "k", 4, rotate=True,
                               normalize=True, group=g)
    vq = quantize_tiles_triton(kv_like(b, h, tokens=n * g, d=dv), "v", 2, rotate=True,
                               normalize=True, group=g)
    assert vq.col_scale.shape[-1] == dv
    q = torch.randn(b, h * group_q, 2, d, device=DEV)
    n_tiles = torch.tensor([1, 2], device=DEV)
    kv_start = torch.tensor([[0, 0], [10, 40]], device=DEV)
    out, lse = kvarn_decode_attention_tiles(q, kq, vq, n_tiles, scale=d ** -0.5, num_splits=2,
                                            kv_start=kv_start)
    assert out.shape == (b, h * group_q, 2, dv)
    assert_attention_close(out, lse, *oracle_attention(q, kq, vq, n_tiles, d ** -0.5, kv_start))


def test_decode_attention_merges_with_an_exact_region():
    """The caller's merge by lse reproduces attention over [quantized tiles ++ exact tail]."""
    b, h, n, g, d, group_q, tail = 2, 2, 2, 32, 64, 3, 5
    k, v = make_cache(b, h, n, g, d, 4, 2)
    q = torch.randn(b, h * group_q, 1, d, device=DEV)
    n_tiles = torch.tensor([2, 1], device=DEV)
    tk, tv = torch.randn(b, h, tail, d, device=DEV), torch.randn(b, h, tail, d, device=DEV)
    scale = d ** -0.5
    out_q, lse_q = kvarn_decode_attention_tiles(q, k, v, n_tiles, scale=scale, num_splits=2)
    s_t = q @ tk.repeat_interleave(group_q, 1).transpose(-1, -2) * scale
    lse_t = torch.logsumexp(s_t, -1)
    out_t = torch.softmax(s_t, -1) @ tv.repeat_interleave(group_q, 1)
    m = torch.maximum(lse_q, lse_t)
    wq, wt = torch.exp(lse_q - m)[..., None], torch.exp(lse_t - m)[..., None]
    merged = (wq * out_q + wt * out_t) / (wq + wt)

    kd = dequantize_tiles(k).transpose(-1, -2).reshape(b, h, n * g, d)
    vd = dequantize_tiles(v).reshape(b, h, n * g, d)
    for row in range(b):
        length = int(n_tiles[row]) * g
        keys = torch.cat([kd[row, :, :length], tk[row]], 1)[None]
        vals = torch.cat([vd[row, :, :length], tv[row]], 1)[None]
        want = testing.reference_attention(q[row:row + 1], keys, vals, scale=scale, causal=False)
        torch.testing.assert_close(merged[row].double(), want[0].to(merged.device), rtol=1e-4, atol=1e-4)


def test_decode_attention_empty_cache_and_validation():
    b, h, n, g, d = 2, 2, 1, 32, 64
    k, v = make_cache(b, h, n, g, d, 4, 2)
    q = torch.randn(b, 2 * h, 1, d, device=DEV)
    out, lse = kvarn_decode_attention_tiles(q, k, v, torch.zeros(b, dtype=torch.int64,
                                                                 device=DEV), scale=0.1,
                                            num_splits=2)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    n_tiles = torch.ones(b, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        kvarn_decode_attention_tiles(q[:, :3], k, v, n_tiles, scale=0.1)
    with pytest.raises(TypeError, match="Expected q_rot of dtype torch.float32"):
        kvarn_decode_attention_tiles(q.half(), k, v, n_tiles, scale=0.1)
    with pytest.raises(ValueError, match="Expected k_bits=2"):
        kvarn_decode_attention(q, k.codes, k.row_scale, k.row_zero, k.col_scale, v.codes,
                               v.row_scale, v.row_zero, v.col_scale, n_tiles, scale=0.1,
                               k_bits=2)
    with pytest.raises(ValueError, match="Expected n_tiles"):
        kvarn_decode_attention_tiles(q, k, v, n_tiles.float(), scale=0.1)
    with pytest.raises(ValueError, match="Expected a contiguous v_col_scale"):
        kvarn_decode_attention(q, k.codes, k.row_scale, k.row_zero, k.col_scale, v.codes,
                               v.row_scale, v.row_zero,
                               v.col_scale.transpose(0, 1).contiguous().transpose(0, 1),
                               n_tiles, scale=0.1)
    k8 = quantize_kv(kv_like(b, h, tokens=g, d=d), "k", bits=4, group=g,
                     scale_dtype=torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="fp8"):
        kvarn_decode_attention_tiles(q, k8, v, n_tiles, scale=0.1)


def test_combine_splits_by_lse():
    o = torch.randn(3, 4, 8, device=DEV)
    lse = torch.randn(3, 4, device=DEV)
    lse[1, :2] = float("-inf")
    lse[2] = float("-inf")
    out, total = combine_splits(o, lse)
    w = torch.softmax(lse[:2], -1)
    torch.testing.assert_close(out[:2], (w[..., None] * o[:2]).sum(1))
    torch.testing.assert_close(total[:2], torch.logsumexp(lse[:2], -1))
    assert torch.equal(out[2], torch.zeros(8, device=DEV)) and torch.isneginf(total[2])


def test_kernels_package_exports(monkeypatch):
    import kvarn_compile.kernels as kernels

    # the interpreter makes triton usable without a GPU; without it, only CUDA does
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.triton_available()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernels.triton_available() == torch.cuda.is_available()
    for name in kernels.__all__:
        if name.isupper():                     # a setting (CUDA_PRECISION), not a launcher
            assert getattr(kernels, name) in ("ieee", "tf32", "fp16")
        else:
            assert callable(getattr(kernels, name))
    with pytest.raises(AttributeError):
        kernels.not_a_kernel  # noqa: B018


def test_decode_attention_per_tile_key_frames():
    """key_frame="auto" tiles: plain K tiles are scored with the un-rotated query."""
    from kvarn_compile.quant.quantize import dequantize_kv
    from kvarn_compile.quant.rotation import rotation_matrix

    b, h, n, g, d, group_q, tq = 2, 2, 3, 32, 64, 3, 2
    x = torch.randn(b, h, n * g, d)
    pos = torch.arange(n * g, dtype=torch.float32)
    x[:, 0, :, 7] += 120 * torch.cos(0.4 * pos)          # a dominant, turning channel in head 0
    x[1, 1, g:2 * g, 40] += 150.0 * torch.sin(0.2 * pos[:g])   # one dominant tile in head 1
    k = quantize_kv(x.to(DEV), "k", bits=4, group=g, key_frame="auto")
    v = quantize_kv(torch.randn(b, h, n * g, d, device=DEV), "v", bits=2, group=g)
    assert k.plain is not None and 0 < int(k.plain.sum()) < k.plain.numel()
    q = torch.randn(b, h * group_q, tq, d, device=DEV)
    rot = rotation_matrix(d, q.device)
    n_tiles = torch.tensor([3, 2], device=DEV)
    out_rot, lse = kvarn_decode_attention_tiles(q @ rot, k, v, n_tiles, scale=0.125,
                                                q_plain=q.contiguous(), num_splits=2)
    kd = dequantize_kv(k, "k", rotated=True).double().cpu()      # original frame, every tile
    vd = dequantize_kv(v, "v", rotated=True).double().cpu()
    for row in range(b):
        length = int(n_tiles[row]) * g
        ref, ref_lse = testing.reference_attention(q[row:row + 1].cpu(), kd[row:row + 1, :, :length],
                                                   vd[row:row + 1, :, :length], scale=0.125,
                                                   causal=False, return_lse=True)
        ref, ref_lse = ref[0], ref_lse[0]
        got = out_rot[row].double().cpu() @ rot.double().cpu().T
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-4 * ref.abs().max().item())
        torch.testing.assert_close(lse[row].double().cpu(), ref_lse, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="q_plain and k_plain together"):
        kvarn_decode_attention(q @ rot, k.codes, k.row_scale, k.row_zero, k.col_scale, v.codes,
                               v.row_scale, v.row_zero, v.col_scale, n_tiles, scale=0.1,
                               k_plain=k.plain)


@pytest.mark.parametrize("kind,bits,d,g", [("k", 4, 64, 32), ("v", 2, 80, 16)])
def test_quantize_best_scales_in_scratch_or_registers(monkeypatch, kind, bits, d, g):
    """The normalization keeps its best column log-scales in the destination tile's code bytes
    (``SCRATCH``) where they fit 4-byte aligned, in registers otherwise: both give the same
    tiles, bit for bit, and a destination whose codes start at an odd address (a contiguous
    view at offset 1) takes the register path instead of faulting."""
    from kvarn_compile.kernels.triton import quantize as Q

    x = kv_like(1, 2, tokens=2 * g, d=d)
    rows, cols = (d, g) if kind == "k" else (g, d)
    block_c = g if kind == "k" else Q._block_d(d)
    tile_bytes = rows * cols * bits // 8
    fits = tile_bytes >= 4 * block_c

    def quantize(codes: torch.Tensor) -> QuantizedTiles:
        out = QuantizedTiles(
            codes=codes,
            row_scale=torch.empty(1, 2, 2, rows, dtype=torch.float16, device=DEV),
            row_zero=torch.empty(1, 2, 2, rows, dtype=torch.float16, device=DEV),
            col_scale=torch.empty(1, 2, 2, cols, dtype=torch.float16, device=DEV), bits=bits)
        quantize_tiles_into(x, *out.tensors(), kind=kind, bits=bits, rotate=True,
                            normalize=True)
        return out

    shape = (1, 2, 2, rows, cols * bits // 8)
    aligned = torch.empty(shape, dtype=torch.uint8, device=DEV)
    odd = torch.empty(aligned.numel() + 1, dtype=torch.uint8, device=DEV)[1:].view(shape)
    assert Q._scratch_fits(aligned, rows, cols, bits, block_c) == fits
    assert not Q._scratch_fits(odd, rows, cols, bits, block_c)
    got = quantize(aligned)
    via_registers = quantize(odd)
    monkeypatch.setattr(Q, "_scratch_fits", lambda *a: False)
    forced = quantize(torch.empty(shape, dtype=torch.uint8, device=DEV))
    for t, u, w in zip(got.tensors(), via_registers.tensors(), forced.tensors()):
        assert torch.equal(t, u) and torch.equal(t, w)
    ref = quantize_kv(x, kind, method="kvarn", bits=bits, group=g)
    assert_codes_match(got, ref)
    assert_scales_match(got, ref)
