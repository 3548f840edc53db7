"""The pure-torch quantizer (``kvarn_compile.quant``: rotation, quantize, cache) against
independent re-derivations and its stated properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvarn_compile.config import get_config
from kvarn_compile.quant import (
    dequantize_kv, dequantize_tiles, fake_quantize, imbalance, is_hadamard_dim,
    normalize_variance, pack_codes, quantize_cache, quantize_kv, quantize_tiles,
    rotation_matrix, split_lengths, unpack_codes,
)
from kvarn_compile.quant.quantize import NonFiniteError
from kvarn_compile.testing import kv_like

HEAD_DIMS = [64, 80, 96, 112, 128, 256]
BITS = [2, 3, 4, 8]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ------------------------------------------------------------------------- rotation
@pytest.mark.parametrize("d", HEAD_DIMS + [48, 160, 100])
def test_rotation_is_orthonormal_and_preserves_dot_products(d):
    h = rotation_matrix(d, dtype=torch.float64)
    torch.testing.assert_close(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    q, k = torch.randn(5, d, dtype=torch.float64), torch.randn(7, d, dtype=torch.float64)
    torch.testing.assert_close((q @ h) @ (k @ h).T, q @ k.T, atol=1e-10, rtol=0)
    if is_hadamard_dim(d):  # a true Hadamard matrix spreads every channel evenly
        torch.testing.assert_close(h.abs(), torch.full_like(h, d ** -0.5), atol=1e-12, rtol=0)


def test_power_of_two_rotation_is_the_sylvester_matrix():
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    expected = torch.kron(torch.kron(h2, h2), h2) / 8 ** 0.5
    torch.testing.assert_close(rotation_matrix(8, dtype=torch.float64), expected)
    assert all(is_hadamard_dim(d) for d in HEAD_DIMS)


def test_rotation_rejects_odd_dims():
    with pytest.raises(ValueError, match="even head_dim"):
        rotation_matrix(63)


# ------------------------------------------------------------------------- packing
def _pack_by_hand(codes: list[int], bits: int) -> list[int]:
    stream = 0
    for i, c in enumerate(codes):
        stream |= c << (i * bits)
    return [(stream >> (8 * j)) & 0xFF for j in range(len(codes) * bits // 8)]


@pytest.mark.parametrize("bits", BITS)
def test_packing_is_little_end_first_and_round_trips(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 64), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 64 * bits // 8)
    assert packed[1, 2].tolist() == _pack_by_hand(codes[1, 2].tolist(), bits)
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_two_bit_layout_matches_the_byte_formula():
    codes = torch.tensor([[1, 2, 3, 0, 3, 3, 0, 1]], dtype=torch.uint8)
    # code i -> byte i // 4, shift (i % 4) * 2
    assert pack_codes(codes, 2).tolist() == [[1 | 2 << 2 | 3 << 4, 3 | 3 << 2 | 1 << 6]]


def test_packing_rejects_ragged_rows():
    with pytest.raises(ValueError, match="divisible by 8"):
        pack_codes(torch.zeros(2, 12, dtype=torch.uint8), 3)


# ------------------------------------------------------------------------- normalization
def _std(v: torch.Tensor, dim: int) -> torch.Tensor:
    mean = v.sum(dim, keepdim=True) / v.shape[dim]
    return ((v - mean) ** 2).sum(dim).div(v.shape[dim] - 1).sqrt()


def _rederive_tile(x: torch.Tensor, bits: int, iters: int) -> tuple[torch.Tensor, ...]:
    """One [R, C] tile, written from the method description without the library code."""
    x = x.double()
    rows, cols = x.shape
    a, b = torch.zeros(cols, dtype=torch.float64), torch.zeros(rows, dtype=torch.float64)

    def imb(y):
        cs, rs = _std(y, 0), _std(y, 1)
        return cs.max() / max(cs.min(), 1e-8) + rs.max() / max(rs.min(), 1e-8)

    best, c_best, r_best = imb(x), torch.ones(cols, dtype=torch.float64), torch.ones(rows, dtype=torch.float64)
    for _ in range(iters):
        y = x / a.exp()[None, :] / b.exp()[:, None]
        a = torch.clamp(a + torch.log(torch.clamp(_std(y, 0), 1e-3, 1e3)), -0.3, 10)
        y = x / a.exp()[None, :] / b.exp()[:, None]
        b = torch.clamp(b + torch.log(torch.clamp(_std(y, 1), 1e-3, 1e3)), -0.3, 10)
        y = x / a.exp()[None, :] / b.exp()[:, None]
        if imb(y) <= best:
            best, c_best, r_best = imb(y), a.exp(), b.exp()
    bmat = x / c_best[None, :] / r_best[:, None]
    lo, hi = bmat.min(1).values, bmat.max(1).values
    delta = torch.clamp((hi - lo) / (2 ** bits - 1), min=1e-10)
    unrounded = (bmat - lo[:, None]) / delta[:, None]
    codes = torch.clamp(torch.round(unrounded), 0, 2 ** bits - 1)
    return codes, unrounded, r_best * delta, r_best * lo, c_best


@pytest.mark.parametrize("bits", [2, 4])
def test_codes_and_scales_match_an_independent_rederivation(bits):
    tiles = torch.randn(3, 64, 128) * torch.exp(torch.randn(3, 64, 1)) * 3
    q = quantize_tiles(tiles, bits, normalize=True, iters=8, scale_dtype=torch.float32)
    codes = unpack_codes(q.codes, bits)
    for i in range(3):
        ref_codes, unrounded, rs, rz, cs = _rederive_tile(tiles[i], bits, 8)
        # fp32 vs fp64 arithmetic may only disagree where the value sits on a rounding tie
        near_tie = ((unrounded - unrounded.floor()) - 0.5).abs() < 1e-3
        diff = (codes[i].double() - ref_codes).abs()
        assert (diff[~near_tie] == 0).all(), f"tile {i}: codes differ from the re-derivation"
        assert (diff[near_tie] <= 1).all() and near_tie.float().mean() < 0.01
        torch.testing.assert_close(q.row_scale[i].double(), rs, rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(q.row_zero[i].double(), rz, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(q.col_scale[i].double(), cs, rtol=1e-4, atol=0)


def test_normalization_balances_and_never_increases_imbalance():
    rows = torch.exp(torch.randn(16, 64, 1)) * 4
    cols = torch.exp(torch.randn(16, 1, 128)) * 4
    x = rows * cols * torch.randn(16, 64, 128)          # stds spread over ~2 orders of magnitude
    c, r = normalize_variance(x, 8)
    after = imbalance(x / c.unsqueeze(-2) / r.unsqueeze(-1))
    before = imbalance(x)
    assert (after <= before).all()
    assert (after < 0.05 * before).all(), (before, after)
    assert after.mean() < 10            # 2 is perfect balance
    # scales never go below e^-0.3 (the reference clip floor)
    assert c.min() >= math.exp(-0.3) - 1e-6 and r.min() >= math.exp(-0.3) - 1e-6


@given(seed=st.integers(0, 2 ** 16), spread=st.floats(0.0, 3.0), scale=st.floats(1e-3, 1e3))
@settings(max_examples=40, deadline=None)
def test_normalization_never_increases_imbalance_property(seed, spread, scale):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, 32, generator=g) * scale * torch.exp(torch.randn(2, 16, 1, generator=g) * spread)
    c, r = normalize_variance(x, 4)
    assert (imbalance(x / c.unsqueeze(-2) / r.unsqueeze(-1)) <= imbalance(x) * (1 + 1e-6)).all()


def test_statistics_are_float64_sequential_sums():
    """The canonical form every kernel reproduces: stds and clip errors are float64 sums taken
    left to right (bit-equal to a Python loop), on both axes of a non-contiguous K-like view."""
    from kvarn_compile.quant.quantize import _sq_err, _std

    y = (torch.randn(96, 64) * torch.exp(torch.randn(64) * 2)).t()       # [64, 96], strided
    for dim in (-2, -1):
        got = _std(y, dim)
        assert got.dtype == torch.float64
        lines = y.double().unbind(1 if dim == -2 else 0)
        for i in (0, 17, len(lines) - 1):
            vals = lines[i].tolist()
            s = 0.0
            for v in vals:
                s += v
            mean, ss = s / len(vals), 0.0
            for v in vals:
                ss += (v - mean) * (v - mean)
            assert got[i].item() == math.sqrt(ss / (len(vals) - 1))
    b = torch.randn(4, 128)
    codes, delta, lo = torch.randint(0, 4, (4, 128)).float(), torch.rand(4) + 0.1, b.amin(-1)
    err = _sq_err(codes, delta, lo, b)
    e = ((codes * delta[:, None] + lo[:, None]) - b).double().tolist()
    s = 0.0
    for v in e[2]:
        s += v * v
    assert err[2].item() == s


def test_linear_domain_update_equals_the_log_domain_one():
    """c = clip(c * clip(std), e^-0.3, e^10) is the method's a = clip(a + log clip(std),
    -0.3, 10), c = e^a: the log-domain loop (written here from the method description)
    reaches the same balance, with products r*[i] c*[j] equal up to float rounding."""
    x = torch.exp(torch.randn(8, 64, 1)) * torch.exp(torch.randn(8, 1, 128)) * torch.randn(8, 64, 128)
    a, b = torch.zeros(8, 128), torch.zeros(8, 64)
    best = imbalance(x)
    best_a, best_b = a, b
    for _ in range(8):
        y = lambda: x / a.exp()[..., None, :] / b.exp()[..., :, None]  # noqa: E731
        a = (a + y().std(-2).clamp(1e-3, 1e3).log()).clamp(-0.3, 10)
        b = (b + y().std(-1).clamp(1e-3, 1e3).log()).clamp(-0.3, 10)
        score = imbalance(y())
        better = score <= best
        best = torch.where(better, score, best)
        best_a = torch.where(better[..., None], a, best_a)
        best_b = torch.where(better[..., None], b, best_b)
    c, r = normalize_variance(x, 8)
    torch.testing.assert_close(imbalance(x / c[..., None, :] / r[..., :, None]), best,
                               rtol=1e-4, atol=0)
    torch.testing.assert_close(r[..., :, None] * c[..., None, :],
                               (best_b[..., :, None] + best_a[..., None, :]).exp(), rtol=1e-4, atol=0)


# ------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("normalize", [False, True])
def test_every_element_is_within_half_a_step(bits, normalize):
    tiles = torch.randn(4, 64, 128) * torch.exp(torch.randn(4, 64, 1))
    q = quantize_tiles(tiles, bits, normalize=normalize, scale_dtype=torch.float32)
    err = (dequantize_tiles(q) - tiles).abs()
    bound = 0.5 * q.row_scale.abs().unsqueeze(-1) * q.col_scale.abs().unsqueeze(-2)
    assert (err <= bound * (1 + 1e-4) + 1e-5).all(), (err - bound).max()


@pytest.mark.parametrize("bits, k_bound, v_bound", [(2, 0.5, 0.75), (3, 0.22, 0.33), (4, 0.1, 0.16), (8, 0.006, 0.01)])
@pytest.mark.parametrize("method", ["kvarn", "hadamard", "kivi"])
def test_round_trip_error_bounds_per_bit_width(bits, k_bound, v_bound, method):
    x = kv_like(2, 3)
    for kind, bound in (("k", k_bound), ("v", v_bound)):
        err = rel_err(fake_quantize(x, kind=kind, method=method, bits=bits), x)
        assert err < bound, f"{method} {kind} {bits}-bit relative error {err:.3f} >= {bound}"


@pytest.mark.parametrize("bits", BITS)
def test_kvarn_beats_kivi_on_outlier_channels(bits):
    x = kv_like(2, 3)
    for kind in "kv":
        kvarn = rel_err(fake_quantize(x, kind=kind, method="kvarn", bits=bits), x)
        kivi = rel_err(fake_quantize(x, kind=kind, method="kivi", bits=bits), x)
        assert kvarn < kivi, (kind, bits, kvarn, kivi)


def test_more_bits_means_less_error():
    x = kv_like(2)
    for method in ("kvarn", "hadamard", "kivi"):
        errs = [rel_err(fake_quantize(x, kind="k", method=method, bits=b), x) for b in BITS]
        assert errs == sorted(errs, reverse=True), (method, errs)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_head_dim_and_dtype(d, dtype):
    x = kv_like(2, tokens=128, d=d).to(dtype)
    for kind in "kv":
        y = fake_quantize(x, kind=kind, bits=4)
        assert y.dtype == dtype and y.shape == x.shape
        assert rel_err(y, x) < 0.15


@pytest.mark.parametrize("scale_dtype", ["float16", "float32", "bfloat16", "float8_e4m3fn"])
def test_scale_dtypes_round_trip(scale_dtype):
    x = kv_like(2)
    for kind in "kv":
        err = rel_err(fake_quantize(x, kind=kind, bits=4, scale_dtype=scale_dtype), x)
        assert err < 0.15, (scale_dtype, kind, err)


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("method", ["kvarn", "hadamard", "kivi"])
@pytest.mark.parametrize("value", [0.0, 3.25, -1e-3])
def test_constant_tiles_reconstruct_exactly_up_to_scale_dtype(kind, method, value):
    x = torch.full((2, 128, 64), value)
    y32 = fake_quantize(x, kind=kind, method=method, bits=2, scale_dtype="float32")
    torch.testing.assert_close(y32, x, atol=1e-5 * max(abs(value), 1e-3), rtol=1e-5)
    # fp16 scales: each stored scale is off by up to 2^-11; a rotation spreads the
    # residuals of all D channels of a row into each output channel
    y16 = fake_quantize(x, kind=kind, method=method, bits=2)
    spread = 1 if method == "kivi" else x.shape[-1]
    torch.testing.assert_close(y16, x, atol=abs(value) * spread * 2 ** -10 + 1e-12, rtol=2 ** -10)


def test_zero_variance_rows_reconstruct_exactly():
    x = torch.randn(1, 128, 64)
    x[..., 10] = 2.5          # a constant key channel (a zero-variance K row)
    x[:, 5, :] = -0.75        # a constant token (a zero-variance V row)
    y = fake_quantize(x, kind="k", method="kivi", bits=2, scale_dtype="float32")
    torch.testing.assert_close(y[..., 10], x[..., 10], atol=1e-6, rtol=0)
    y = fake_quantize(x, kind="v", method="kivi", bits=2, scale_dtype="float32")
    torch.testing.assert_close(y[:, 5, :], x[:, 5, :], atol=1e-6, rtol=0)


@given(lead=st.integers(1, 3), tiles=st.integers(1, 3), d=st.sampled_from([16, 32, 48, 64, 80]),
       group=st.sampled_from([32, 64]), bits=st.sampled_from(BITS), kind=st.sampled_from("kv"),
       method=st.sampled_from(["kvarn", "hadamard", "kivi"]), log_scale=st.floats(-6, 6),
       seed=st.integers(0, 2 ** 16))
@settings(max_examples=60, deadline=None)
def test_round_trip_property(lead, tiles, d, group, bits, kind, method, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(lead, tiles * group, d, generator=g) * 10 ** log_scale
    q = quantize_kv(x, kind, method=method, bits=bits, group=group, scale_dtype=torch.float32)
    rows, cols = (d, group) if kind == "k" else (group, d)
    assert q.shape == (lead, tiles, rows, cols)
    assert q.codes.shape == (lead, tiles, rows, cols * bits // 8)
    y = dequantize_kv(q, kind, rotated=method != "kivi")
    assert torch.isfinite(y).all()
    # error bounded by half a step on every element, in the rotated frame
    ref = x if method == "kivi" else x @ rotation_matrix(d)
    tiles_ref = ref.reshape(lead, tiles, group, d)
    if kind == "k":
        tiles_ref = tiles_ref.transpose(-1, -2)
    bound = 0.5 * q.row_scale.abs().unsqueeze(-1) * q.col_scale.abs().unsqueeze(-2)
    assert ((dequantize_tiles(q) - tiles_ref).abs() <= bound * 1.001 + 1e-6 * 10 ** log_scale).all()


def test_fake_quantize_checks_its_input():
    with pytest.raises(ValueError, match="multiple of group=128"):
        fake_quantize(torch.randn(100, 64), kind="k")
    with pytest.raises(ValueError, match="kind 'k'"):
        fake_quantize(torch.randn(128, 64), kind="q")
    with pytest.raises(ValueError, match="method in"):
        fake_quantize(torch.randn(128, 64), kind="k", method="quarot")
    with pytest.raises(TypeError, match="floating-point"):
        fake_quantize(torch.ones(128, 64, dtype=torch.int32), kind="k")


# ------------------------------------------------------------------------- non-finite
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_token_stays_contained_to_that_token(kind, bad):
    x = kv_like(1, tokens=128)
    clean = fake_quantize(x, kind=kind, bits=4)
    x_bad = x.clone()
    x_bad[0, 17, 5] = bad
    y = fake_quantize(x_bad, kind=kind, bits=4)
    assert torch.isnan(y[0, 17]).all()            # the token reads back as NaN ...
    others = torch.ones(128, dtype=torch.bool)
    others[17] = False
    assert torch.isfinite(y[0, others]).all()     # ... and nothing else does
    assert rel_err(y[0, others], x[0, others]) < 1.2 * rel_err(clean[0, others], x[0, others])


def test_a_whole_non_finite_tile_does_not_touch_other_tiles():
    x = kv_like(1, tokens=256)
    x[0, :128, :] = float("nan")
    y = fake_quantize(x, kind="k", bits=4)
    assert torch.isnan(y[0, :128]).all() and torch.isfinite(y[0, 128:]).all()
    torch.testing.assert_close(y[0, 128:], fake_quantize(x[:, 128:], kind="k", bits=4)[0])


def test_check_mode_raises_and_names_the_position():
    x = kv_like(1, tokens=128)
    x[0, 40, 2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"index \(0, 40\)"):
        quantize_kv(x, "v", bits=2, check_finite=True)


# ------------------------------------------------------------------------- cache layout
@pytest.mark.parametrize("preset, d, k_bpe, v_bpe", [
    ("k4v2", 128, 4.375, 2.375), ("k4v4", 128, 4.375, 4.375), ("k2v2", 128, 2.375, 2.375),
    ("k4v2_g64", 128, 4.625, 2.5), ("k4v4_g64", 128, 4.625, 4.5),
    ("k4v2", 64, 4 + (2 * 64 + 128) * 16 / (64 * 128), 2 + (64 + 2 * 128) * 16 / (64 * 128)),
])
def test_bits_per_element_from_live_tensors(preset, d, k_bpe, v_bpe):
    cfg = get_config(preset)
    k_bpe += 8 / (d * cfg.group_size)      # key_frame="auto": one flag byte per K tile and head
    k, v = kv_like(1, 2, tokens=4 * 128, d=d), kv_like(1, 2, tokens=4 * 128, d=d)
    cache = quantize_cache(k.half(), v.half(), cfg)
    assert cache.quantized_bpe() == pytest.approx({"k": k_bpe, "v": v_bpe})
    sink, n_q, tail = split_lengths(4 * 128, cfg)
    expected_bytes = (sink + tail) * d * 2 * 2 * 2 + (k_bpe + v_bpe) * n_q * d * 2 / 8
    assert cache.nbytes == pytest.approx(expected_bytes)
    assert cache.bpe() == pytest.approx(8 * expected_bytes / (2 * 2 * 4 * 128 * d))


def test_fp8_scales_cost_fewer_bits():
    k = kv_like(1, tokens=4 * 128, d=128)
    fp16 = quantize_cache(k, k, get_config("k2v2")).quantized_bpe()
    fp8 = quantize_cache(k, k, get_config("k2v2", scale_dtype="float8_e4m3fn")).quantized_bpe()
    assert fp8["k"] < fp16["k"] and fp8["v"] < fp16["v"]
    # codes, fp8 row scale/zero and column scale, two fp16 factors, the key-frame flag byte
    assert fp8["k"] == pytest.approx(2 + ((2 * 128 + 128) * 8 + 128 * 8 + 2 * 16 + 8) / (128 * 128))


@pytest.mark.parametrize("tokens", [1, 127, 128, 129, 255, 256, 300, 1000])
@pytest.mark.parametrize("recent", [0, 128])
def test_cache_split_keeps_sink_and_tail_exact(tokens, recent):
    cfg = get_config("k4v2", recent_window=recent)
    k, v = kv_like(2, tokens=tokens), kv_like(2, tokens=tokens)
    cache = quantize_cache(k, v, cfg)
    sink, n_q, tail = split_lengths(tokens, cfg)
    assert (sink, n_q % 128, sink + n_q + tail) == (min(tokens, 128), 0, tokens)
    assert tail >= min(recent, tokens - sink)
    k_hat, v_hat = cache.dequantize()
    assert cache.tokens == tokens and k_hat.shape == k.shape
    assert torch.equal(k_hat[..., :sink, :], k[..., :sink, :])
    assert torch.equal(v_hat[..., sink + n_q:, :], v[..., sink + n_q:, :])
    if n_q:
        torch.testing.assert_close(k_hat[..., sink:sink + n_q, :],
                                   fake_quantize(k[..., sink:sink + n_q, :], kind="k", bits=4))


# ------------------------------------------------------------------------- key frames
def _bias_outlier_keys(tokens=256, d=64):
    """Post-RoPE keys whose k_proj bias left two huge channels turning with position."""
    x = kv_like(1, 2, tokens=tokens, d=d)
    pos = torch.arange(tokens, dtype=torch.float32)
    x[:, 0, :, 10] += 200 * torch.cos(0.05 * pos)
    x[:, 0, :, 42] += 200 * torch.sin(0.05 * pos)
    return x


def test_key_frame_auto_keeps_natural_tiles_rotated_and_bit_identical():
    x = kv_like(2, 3, tokens=512)
    ref = quantize_kv(x, "k", bits=4, group=128)
    auto = quantize_kv(x, "k", bits=4, group=128, key_frame="auto")
    assert auto.plain is not None and not auto.plain.any()
    for name in ("codes", "row_scale", "row_zero", "col_scale"):
        assert torch.equal(getattr(ref, name), getattr(auto, name)), name
    assert auto.nbytes == ref.nbytes + auto.plain.numel()      # one flag byte per tile


def test_key_frame_auto_stores_bias_outlier_tiles_plain():
    from kvarn_compile.quant.quantize import DOMINANCE_THRESHOLD, key_dominance

    x = _bias_outlier_keys()
    q = quantize_kv(x, "k", bits=4, group=128, key_frame="auto")
    assert q.plain[:, 0].all() and not q.plain[:, 1].any()
    tiles = x.reshape(1, 2, 2, 128, 64)
    assert (key_dominance(tiles[:, 0]) >= DOMINANCE_THRESHOLD).all()
    assert (key_dominance(tiles[:, 1]) < DOMINANCE_THRESHOLD).all()
    kivi = quantize_kv(x, "k", method="kivi", bits=4, group=128)
    plain = dequantize_kv(q, "k", rotated=True)
    # plain tiles are exactly KIVI's, rotated ones exactly the method's
    torch.testing.assert_close(plain[:, 0], dequantize_kv(kivi, "k", rotated=False)[:, 0])
    rot = dequantize_kv(quantize_kv(x, "k", bits=4, group=128), "k", rotated=True)
    torch.testing.assert_close(plain[:, 1], rot[:, 1])
    rest = [c for c in range(64) if c not in (10, 42)]
    err = lambda y: rel_err(y[:, 0][..., rest], x[:, 0][..., rest])  # noqa: E731
    assert err(plain) < 0.25 * err(rot)        # rotation spreads the outlier's rounding noise
    y = fake_quantize(x, kind="k", bits=4, group=128, key_frame="auto")
    torch.testing.assert_close(y, plain)
    # values never change frame
    torch.testing.assert_close(fake_quantize(x, kind="v", bits=2, key_frame="auto"),
                               fake_quantize(x, kind="v", bits=2))


def test_key_frame_is_validated():
    with pytest.raises(ValueError, match="key_frame"):
        get_config("k4v2", key_frame="sometimes")
    with pytest.raises(ValueError, match="key_frame"):
        quantize_kv(torch.randn(1, 128, 64), "k", key_frame="plain")
    assert get_config("k4v2", key_frame="rotated").short().endswith("-krot")
    assert get_config("k4v2").key_frame == "auto" and get_config("k4v2").short() == "kvarn-k4v2-g128"


# ------------------------------------------------------------------------- clip="mse"
@pytest.mark.parametrize("kind", ["k", "v"])
def test_clip_mse_lowers_2bit_key_error_and_leaves_the_rest_alone(kind):
    from kvarn_compile.quant.quantize import CLIP_RATIOS, rtn_rows

    x = kv_like(2, 3, tokens=256)
    for bits in (2, 3, 4):
        ref = quantize_kv(x, kind, bits=bits, group=128)
        clip = quantize_kv(x, kind, bits=bits, group=128, clip="mse")
        if bits > 2 or kind == "v":
            assert torch.equal(ref.codes, clip.codes) and torch.equal(ref.row_scale, clip.row_scale)
        else:
            e_ref = rel_err(dequantize_kv(ref, kind, rotated=True), x)
            e_clip = rel_err(dequantize_kv(clip, kind, rotated=True), x)
            assert e_clip < 0.9 * e_ref
    # per row the search never does worse than min-max (ratio 1.0 is a candidate)
    b = torch.randn(64, 128) ** 3
    codes, delta, lo = rtn_rows(b, 2, clip=True)
    codes0, delta0, lo0 = rtn_rows(b, 2)
    err = lambda c, d, l: ((c.float() * d[:, None] + l[:, None]) - b).square().sum(-1)  # noqa: E731
    assert (err(codes, delta, lo) <= err(codes0, delta0, lo0)).all()
    assert CLIP_RATIOS[0] == 1.0
    with pytest.raises(ValueError, match="clip"):
        get_config("k2v2", clip="always")
