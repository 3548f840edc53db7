"""The KVarN tile quantizer in plain PyTorch: the readable oracle for every kernel.

One *tile* is a matrix X with R rows and C columns:

* a K tile is [head_dim, G]: rows are channels, columns are tokens;
* a V tile is [G, head_dim]: rows are tokens, columns are channels.

With that convention both kinds share one format and one dequant formula::

    X̂[r, c] = (code[r, c] * row_scale[r] + row_zero[r]) * col_scale[c]

For K, row_scale/row_zero are the per-channel s_ch/z_ch and col_scale the per-token s_tok;
for V, row_scale/row_zero are the per-token s_tok/z_tok and col_scale the per-channel s_ch
(the paper's storage step). Codes are packed along the row, little end first.

Pipeline for one tile (``quantize_tiles``), the tile in float32:

1. (kvarn) two-axis variance normalization -> column scales c*, row scales r* (statistics
   in float64 with one defined summation order, see ``normalize_variance``);
2. round-to-nearest, asymmetric, per row of B = X / c* / r*, half to even;
3. fold Δ and lo into the row scale and zero point; keep c* as the column scale;
4. pack the codes; store the scales in the configured dtype.

Methods differ only in steps before RTN: ``kvarn`` rotates and normalizes, ``hadamard``
rotates (c* = r* = 1), ``kivi`` does neither. Every function is batched over any leading
dims (batch, kv-head, tile index).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from kvarn_compile.config import CLIPS, KEY_FRAMES, METHODS, SCALE_DTYPES
from kvarn_compile.quant.rotation import rotate, unrotate

__all__ = [
    "normalize_variance", "imbalance", "rtn_rows", "pack_codes", "unpack_codes",
    "store_scales", "load_scales", "QuantizedTiles", "quantize_tiles", "dequantize_tiles",
    "quantize_kv", "dequantize_kv", "fake_quantize", "NonFiniteError", "KEY_FRAMES",
    "choose_key_frame", "key_dominance", "DOMINANCE_THRESHOLD",
]

# Clip constants of the reference normalization (step 1 below: the variance normalization).
STD_CLIP = (1e-3, 1e3)        # clip of each std before its log is taken
LOG_SCALE_CLIP = (-0.3, 10.0)  # clip of the accumulated log scales: scales >= e^-0.3 = 0.741
#: The same clip in the linear domain (float64): clip(a, lo, hi) with c = e^a is
#: clip(c, e^lo, e^hi), since exp is increasing.
SCALE_CLIP = (math.exp(LOG_SCALE_CLIP[0]), math.exp(LOG_SCALE_CLIP[1]))
IMBALANCE_EPS = 1e-8          # floor of min(std) in the imbalance metric
DELTA_MIN = 1e-10             # floor of the RTN step
FP8_MAX = 448.0               # largest finite float8_e4m3fn


class NonFiniteError(ValueError):
    """Raised in check mode when a NaN or inf reaches the quantizer."""


# ------------------------------------------------------------------------------------------
# Step 1: variance normalization
# ------------------------------------------------------------------------------------------
# Every statistic is computed in one exactly defined way, so that a kernel in another
# language can reproduce it bit for bit (``kernels/cpu/quantize.py``): float64, summed left
# to right (``cumsum``'s last element is the sequential sum; ``sum`` is blocked and
# vectorized, its order is an implementation detail), IEEE division and sqrt (correctly
# rounded everywhere), no exp/log (their last bit differs between libraries).
def _seq_sum(y: torch.Tensor, dim: int) -> torch.Tensor:
    """Left-to-right sum of float64 ``y`` along ``dim`` (that dim removed)."""
    return y.cumsum(dim).select(dim, -1)


def _std(y: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased (N-1) std of fp32 ``y`` along ``dim``, float64, sequential sums:
    sqrt(sum((y - mean)^2) / (n - 1)) with mean = sum(y) / n."""
    y = y.double()
    n = y.shape[dim]
    dev = y - (_seq_sum(y, dim) / n).unsqueeze(dim)
    return (_seq_sum(dev * dev, dim) / (n - 1)).sqrt()


def _stds(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unbiased (N-1) column and row standard deviations of [..., R, C] (float64)."""
    return _std(y, -2), _std(y, -1)


def _imbalance(col: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return (col.amax(-1) / col.amin(-1).clamp_min(IMBALANCE_EPS)
            + row.amax(-1) / row.amin(-1).clamp_min(IMBALANCE_EPS))


def imbalance(y: torch.Tensor) -> torch.Tensor:
    """max/min ratio of column stds plus that of row stds, per tile: [..., R, C] -> [...]
    (float64)."""
    return _imbalance(*_stds(y))


def normalize_variance(x: torch.Tensor, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gauss-Seidel balancing of column and row stds of fp32 tiles [..., R, C].

    Returns (c*, r*): fp32 column scales [..., C] and row scales [..., R] such that
    X / c*[None, :] / r*[:, None] has the most balanced stds seen, "no scaling" included.
    The original X is divided at every step (no drift); the best-so-far pair is kept
    per tile with ``<=`` so later iterations win ties, as in the reference.

    The method's log-domain update a = clip(a + log(clip(std, 1e-3, 1e3)), -0.3, 10),
    scale = e^a, is carried out in the linear domain: c = clip(c * clip(std, 1e-3, 1e3),
    e^-0.3, e^10) (the same numbers in exact arithmetic), with c and r in float64 and the
    tile scaled in fp32 as Y = (X / fp32(c)[None, :]) / fp32(r)[:, None]. Stds, the
    imbalance and the ``<=`` pick are float64 with left-to-right sums (see :func:`_std`).
    The column stds of the Y an iteration ends with are those the next one starts from
    (the same matrix), so they are computed once.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"Expected float32 tiles for normalize_variance, but got {x.dtype}.")
    lead, (rows, cols) = x.shape[:-2], x.shape[-2:]
    c = torch.ones(*lead, cols, dtype=torch.float64, device=x.device)
    r = torch.ones(*lead, rows, dtype=torch.float64, device=x.device)
    col, row = _stds(x)
    best = _imbalance(col, row)
    best_c, best_r = c, r

    def scaled() -> torch.Tensor:
        return x / c.float().unsqueeze(-2) / r.float().unsqueeze(-1)

    for _ in range(iters):
        c = (c * col.clamp(*STD_CLIP)).clamp(*SCALE_CLIP)
        r = (r * _std(scaled(), -1).clamp(*STD_CLIP)).clamp(*SCALE_CLIP)
        col, row = _stds(scaled())
        score = _imbalance(col, row)
        better = score <= best
        best = torch.where(better, score, best)
        best_c = torch.where(better.unsqueeze(-1), c, best_c)
        best_r = torch.where(better.unsqueeze(-1), r, best_r)
    return best_c.float(), best_r.float()


# ------------------------------------------------------------------------------------------
# Step 2: round to nearest
# ------------------------------------------------------------------------------------------
#: Range shrink factors tried by the MSE clip search (``clip="mse"``), widest first.
CLIP_RATIOS: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)
#: The clip search applies to key rows (one channel over a tile's tokens) of at most this
#: many bits. Measured on SmolLM2-135M (pseudo-decode KL, news windows, 1k-2k tokens, k2v2):
#: clipping 2-bit keys lowers KL 55-66%, on held-out news and Wikipedia text too; clipping
#: 2-bit values raised KL (k4v2: +32%), their extremes matter more than their MSE.
CLIP_MAX_BITS = 2


def _rtn(b: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, qmax: int
         ) -> tuple[torch.Tensor, torch.Tensor]:
    delta = ((hi - lo) / qmax).clamp_min(DELTA_MIN)
    return torch.round((b - lo.unsqueeze(-1)) / delta.unsqueeze(-1)).clamp_(0, qmax), delta


def _sq_err(codes: torch.Tensor, delta: torch.Tensor, lo: torch.Tensor, b: torch.Tensor
            ) -> torch.Tensor:
    """Squared rounding error per row, float64, summed left to right: the fp32 residual
    (code * Δ + lo) - B, widened, squared and summed (one defined order, see :func:`_std`)."""
    e = ((codes * delta.unsqueeze(-1) + lo.unsqueeze(-1)) - b).double()
    return _seq_sum(e * e, -1)


def rtn_rows(b: torch.Tensor, bits: int, clip: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per-row RTN of fp32 [..., R, C]: (codes uint8, delta [..., R], lo [..., R]).

    code = clamp(round_half_to_even((B - lo) / Δ), 0, 2^bits - 1), Δ = max((hi - lo) / (2^bits - 1), 1e-10).
    lo/hi are the row's min/max; with ``clip`` (and bits <= ``CLIP_MAX_BITS``) each row
    instead takes the range [mid - a * half, mid + a * half] (mid, half: centre and half
    width of its min-max range) for the a in ``CLIP_RATIOS`` with the smallest squared
    rounding error (float64, summed left to right: :func:`_sq_err`; the first of equal
    errors wins). The format is unchanged: Δ and lo fold into the same scales.
    """
    qmax = (1 << bits) - 1
    lo = b.amin(dim=-1)
    hi = b.amax(dim=-1)
    codes, delta = _rtn(b, lo, hi, qmax)
    if not clip or bits > CLIP_MAX_BITS:
        return codes.to(torch.uint8), delta, lo
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    best = _sq_err(codes, delta, lo, b)
    for a in CLIP_RATIOS[1:]:
        lo_a = mid - a * half
        codes_a, delta_a = _rtn(b, lo_a, mid + a * half, qmax)
        err = _sq_err(codes_a, delta_a, lo_a, b)
        better = err < best
        best = torch.where(better, err, best)
        codes = torch.where(better.unsqueeze(-1), codes_a, codes)
        delta = torch.where(better, delta_a, delta)
        lo = torch.where(better, lo_a, lo)
    return codes.to(torch.uint8), delta, lo


# ------------------------------------------------------------------------------------------
# Step 4: packing and scale storage
# ------------------------------------------------------------------------------------------
def _pack_group(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte group: 2->(4,1), 3->(8,3), 4->(2,1), 8->(1,1)."""
    n_bits = bits * 8 // math.gcd(bits, 8)
    return n_bits // bits, n_bits // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes [..., n] into bytes [..., n * bits / 8], little end first.

    Code i occupies bits [i*bits, (i+1)*bits) of the row's little-endian bit stream; for
    2, 4 and 8 bits that is byte i // (8 / bits) at shift (i % (8 / bits)) * bits.
    """
    n = codes.shape[-1]
    per, nbytes = _pack_group(bits)
    if n % per:
        raise ValueError(f"Expected a row length divisible by {per} to pack {bits}-bit codes, "
                         f"but got {n}.")
    groups = codes.reshape(*codes.shape[:-1], n // per, per).to(torch.int64)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int64) * bits
    word = (groups << shifts).sum(-1, keepdim=True)
    byte_shifts = torch.arange(nbytes, device=codes.device, dtype=torch.int64) * 8
    out = (word >> byte_shifts) & 0xFF
    return out.reshape(*codes.shape[:-1], n * bits // 8).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: bytes [..., m] -> uint8 codes [..., m * 8 / bits]."""
    m = packed.shape[-1]
    per, nbytes = _pack_group(bits)
    if nbytes == 1:  # 2, 4, 8 bits: byte-local shifts, no widening (the hot path of attention)
        mask = (1 << bits) - 1
        parts = [(packed >> (i * bits)) & mask for i in range(per)]
        return torch.stack(parts, -1).reshape(*packed.shape[:-1], m * per)
    groups = packed.reshape(*packed.shape[:-1], m // nbytes, nbytes).to(torch.int64)
    byte_shifts = torch.arange(nbytes, device=packed.device, dtype=torch.int64) * 8
    word = (groups << byte_shifts).sum(-1, keepdim=True)
    shifts = torch.arange(per, device=packed.device, dtype=torch.int64) * bits
    out = (word >> shifts) & ((1 << bits) - 1)
    return out.reshape(*packed.shape[:-1], m * 8 // bits).to(torch.uint8)


def store_scales(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cast fp32 scale vectors [..., n] to their storage dtype.

    float8_e4m3fn keeps one fp16 factor per vector ([..., 1], the vector's amax / 448) so
    that small scales do not underflow fp8; other dtypes are a plain cast (factor None).
    Non-finite entries (NaN-marked tokens) are kept as they are.
    """
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype), None
    finite = torch.isfinite(x)
    amax = torch.where(finite, x.abs(), torch.zeros_like(x)).amax(-1, keepdim=True)
    factor = (amax / FP8_MAX).clamp_min(1e-30).to(torch.float16)
    factor = torch.where(factor > 0, factor, torch.ones_like(factor))  # fp16 underflow
    return (x / factor.float()).to(dtype), factor


def load_scales(stored: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """fp32 view of stored scales (inverse of :func:`store_scales`)."""
    out = stored.float()
    return out if factor is None else out * factor.float()


# ------------------------------------------------------------------------------------------
# One tile, end to end
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class QuantizedTiles:
    """Packed tiles [..., R, C] and their folded scales (see the module docstring).

    ``row_scale_factor``/``col_scale_factor`` are only set for fp8 scale storage.
    """

    codes: torch.Tensor            # uint8 [..., R, C * bits / 8]
    row_scale: torch.Tensor        # [..., R]
    row_zero: torch.Tensor         # [..., R]
    col_scale: torch.Tensor        # [..., C]
    bits: int
    row_scale_factor: torch.Tensor | None = None  # fp16 [..., 1]
    col_scale_factor: torch.Tensor | None = None  # fp16 [..., 1]
    plain: torch.Tensor | None = None             # uint8 [...]: 1 = tile stored un-rotated

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.row_scale, self.row_zero, self.col_scale,
                            self.row_scale_factor, self.col_scale_factor, self.plain)
                if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the packed tiles hold (codes, scales, zeros, factors)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (unpacked) tile shape [..., R, C]."""
        return (*self.codes.shape[:-1], self.codes.shape[-1] * 8 // self.bits)


def quantize_tiles(x: torch.Tensor, bits: int, *, normalize: bool, iters: int = 8,
                   scale_dtype: torch.dtype = torch.float16, clip: bool = False) -> QuantizedTiles:
    """Quantize fp32 tiles [..., R, C] (already rotated if the method rotates)."""
    x = x.float()
    if normalize and iters > 0:
        col, row = normalize_variance(x, iters)
    else:
        col = x.new_ones(x.shape[:-2] + x.shape[-1:])
        row = x.new_ones(x.shape[:-1])
    b = x / col.unsqueeze(-2) / row.unsqueeze(-1)
    codes, delta, lo = rtn_rows(b, bits, clip)
    zero_dtype = torch.float16 if scale_dtype == torch.float8_e4m3fn else scale_dtype
    row_scale, row_factor = store_scales(row * delta, scale_dtype)
    col_scale, col_factor = store_scales(col, scale_dtype)
    return QuantizedTiles(codes=pack_codes(codes, bits), row_scale=row_scale,
                          row_zero=(row * lo).to(zero_dtype), col_scale=col_scale, bits=bits,
                          row_scale_factor=row_factor, col_scale_factor=col_factor)


def dequantize_tiles(q: QuantizedTiles) -> torch.Tensor:
    """fp32 tiles [..., R, C]: (code * row_scale + row_zero) * col_scale."""
    codes = unpack_codes(q.codes, q.bits).float()
    row_scale = load_scales(q.row_scale, q.row_scale_factor).unsqueeze(-1)
    col_scale = load_scales(q.col_scale, q.col_scale_factor).unsqueeze(-2)
    return (codes * row_scale + q.row_zero.float().unsqueeze(-1)) * col_scale


# ------------------------------------------------------------------------------------------
# Token-major K/V <-> tiles
# ------------------------------------------------------------------------------------------
def _method_flags(method: str) -> tuple[bool, bool]:
    if method not in METHODS:
        raise ValueError(f"Expected method in {METHODS}, but got {method!r}.")
    return method != "kivi", method == "kvarn"  # (rotate, normalize)


def _check_kind(kind: str) -> None:
    if kind not in ("k", "v"):
        raise ValueError(f"Expected kind 'k' (keys) or 'v' (values), but got {kind!r}.")


def _sanitize(x: torch.Tensor, group: int, check: bool, what: str
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Replace non-finite tokens [..., T, D] by their tile's finite-token mean.

    Returns the cleaned fp32 tensor and a bool mask [..., T] of the bad tokens (None when
    every value is finite). Statistics of the other tokens are then unaffected by the bad
    ones; the caller marks the bad tokens NaN in the packed tiles.
    """
    bad = ~torch.isfinite(x).all(dim=-1)
    if not bool(bad.any()):
        return x, None
    if check:
        idx = bad.nonzero()[0].tolist()
        raise NonFiniteError(
            f"{what}: found a NaN/inf in the KV cache input at (leading..., token) index "
            f"{tuple(idx)} ({int(bad.sum())} token(s) in all). Expected finite keys/values; "
            "fix the model input or disable KVarNConfig.check_finite to store such tokens as NaN.")
    lead, (t, d) = x.shape[:-2], x.shape[-2:]
    tiles = x.reshape(*lead, t // group, group, d)
    bad_t = bad.reshape(*lead, t // group, group, 1)
    good = torch.where(bad_t, torch.zeros_like(tiles), tiles)
    count = (~bad_t).sum(-2, keepdim=True).clamp_min(1)
    mean = good.sum(-2, keepdim=True) / count
    return torch.where(bad_t, mean, tiles).reshape(x.shape), bad


def quantize_kv(x: torch.Tensor, kind: str, *, method: str = "kvarn", bits: int = 4,
                group: int = 128, iters: int = 8, scale_dtype: torch.dtype = torch.float16,
                check_finite: bool = False, key_frame: str = "rotated",
                clip: str = "none") -> QuantizedTiles:
    """Quantize token-major K or V [..., tokens, head_dim] into tiles of ``group`` tokens.

    Returns tiles shaped [..., n_tiles, D, G] for K and [..., n_tiles, G, D] for V, in the
    rotated frame for the rotating methods. A token holding any NaN/inf is stored as NaN
    (its token scale is NaN, so every channel of it reads back NaN) while the rest of its
    tile is quantized from the finite tokens only; with ``check_finite`` it raises instead.

    ``key_frame="auto"`` (keys of a rotating method only): a K tile whose largest channels
    dominate (:func:`choose_key_frame`) is stored plain (KIVI: no rotation, no
    normalization), every other tile with the method's transform; ``plain`` marks the
    tiles stored un-rotated. Values are always rotated.
    """
    _check_kind(kind)
    _check_key_frame(key_frame)
    rotate_, normalize = _method_flags(method)
    if kind == "k" and key_frame == "auto" and rotate_:
        return _quantize_keys_auto(x, method=method, bits=bits, group=group, iters=iters,
                                   scale_dtype=scale_dtype, check_finite=check_finite, clip=clip)
    t, d = x.shape[-2:]
    if t % group:
        raise ValueError(f"Expected the token count to be a multiple of group={group}, but got "
                         f"{t}. Quantize whole tiles only; keep the remainder in high precision.")
    xf, bad = _sanitize(x.float(), group, check_finite, f"quantize_kv(kind={kind!r})")
    if rotate_:
        xf = rotate(xf)
    tiles = xf.reshape(*x.shape[:-2], t // group, group, d)
    if kind == "k":
        tiles = tiles.transpose(-1, -2)
    q = quantize_tiles(tiles, bits, normalize=normalize, iters=iters, scale_dtype=scale_dtype,
                       clip=clip == "mse" and kind == "k")
    if bad is not None:
        bad = bad.reshape(*x.shape[:-2], t // group, group)
        nan = torch.tensor(float("nan"), device=x.device)
        if kind == "k":    # tokens are columns
            q.col_scale = torch.where(bad, nan, q.col_scale.float()).to(q.col_scale.dtype)
        else:              # tokens are rows
            q.row_scale = torch.where(bad, nan, q.row_scale.float()).to(q.row_scale.dtype)
            q.row_zero = torch.where(bad, nan, q.row_zero.float()).to(q.row_zero.dtype)
    return q


def dequantize_kv(q: QuantizedTiles, kind: str, *, rotated: bool) -> torch.Tensor:
    """fp32 token-major [..., n_tiles * G, D] from tiles; ``rotated`` undoes the rotation."""
    _check_kind(kind)
    tiles = dequantize_tiles(q)
    if kind == "k":
        tiles = tiles.transpose(-1, -2)
    if rotated:
        back = unrotate(tiles)
        tiles = back if q.plain is None else torch.where(q.plain.bool()[..., None, None], tiles, back)
    return tiles.reshape(*tiles.shape[:-3], tiles.shape[-3] * tiles.shape[-2], tiles.shape[-1])


def fake_quantize(x: torch.Tensor, *, kind: str, method: str = "kvarn", bits: int = 4,
                  group: int = 128, iters: int = 8,
                  scale_dtype: torch.dtype | str = torch.float16,
                  key_frame: str = "rotated", clip: str = "none") -> torch.Tensor:
    """Quantize then dequantize K or V ``x`` [..., tokens, head_dim]; same frame and dtype.

    ``tokens`` must be a multiple of ``group``. For evaluation and tests only: the runtime
    cache stores the packed codes and never this dequantized tensor.
    """
    if isinstance(scale_dtype, str):
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"Expected scale_dtype in {tuple(SCALE_DTYPES)}, but got {scale_dtype!r}.")
        scale_dtype = SCALE_DTYPES[scale_dtype]
    if not x.is_floating_point():
        raise TypeError(f"Expected a floating-point K/V tensor, but got {x.dtype}.")
    q = quantize_kv(x, kind, method=method, bits=bits, group=group, iters=iters,
                    scale_dtype=scale_dtype, key_frame=key_frame, clip=clip)
    return dequantize_kv(q, kind, rotated=method != "kivi").to(x.dtype)


# ------------------------------------------------------------------------------------------
# Per-tile key frame (key_frame="auto")
# ------------------------------------------------------------------------------------------
def _check_clip(clip: str) -> None:
    if clip not in CLIPS:
        raise ValueError(f"Expected clip in {CLIPS}, but got {clip!r}.")


def _check_key_frame(key_frame: str) -> None:
    if key_frame not in KEY_FRAMES:
        raise ValueError(f"Expected key_frame in {KEY_FRAMES}, but got {key_frame!r}.")


#: A K tile is stored plain when its largest |k| is at least this many times the median
#: channel range (over the tile's tokens). Measured on SmolLM2-135M keys (news text, all 30
#: layers): natural tiles reach 1.0-9.6; k_proj-bias-like offsets of 100-150 in two channels
#: give 17.7-52.6, whether the offset turns with RoPE or stays constant.
DOMINANCE_THRESHOLD = 16.0


def key_dominance(tiles: torch.Tensor) -> torch.Tensor:
    """max |k| / median per-channel range of token-major K tiles [..., G, D] -> [...]."""
    rng = (tiles.amax(-2) - tiles.amin(-2)).sort(-1).values
    median = rng[..., rng.shape[-1] // 2]
    peak = tiles.abs().amax((-1, -2))
    return peak / median.clamp_min(torch.finfo(torch.float32).tiny)


def choose_key_frame(tiles: torch.Tensor) -> torch.Tensor:
    """Per K tile [..., G, D] (token-major, un-rotated, finite): True = store it plain.

    A tile with a few channels far larger than the rest (a learned k_proj bias: |k| > 100
    against ~1, constant or turning with RoPE) is what rotation handles badly: it spreads
    those channels over every channel, so every channel's range (or, after the variance
    normalization, every token's scale) is set by the outlier and the informative part
    gets its rounding noise. Per-channel RTN in the plain frame (KIVI's K) gives the outlier
    channels their own range and zero point: a constant offset then costs only the
    rounding of its zero point. Every other tile keeps the method's rotation, where
    rotation is what makes KVarN better than KIVI.
    """
    return key_dominance(tiles) >= DOMINANCE_THRESHOLD


def _quantize_keys_auto(x: torch.Tensor, *, method: str, bits: int, group: int, iters: int,
                        scale_dtype: torch.dtype, check_finite: bool, clip: str) -> QuantizedTiles:
    opts = dict(bits=bits, group=group, iters=iters, scale_dtype=scale_dtype,
                check_finite=check_finite, clip=clip)
    rot = quantize_kv(x, "k", method=method, **opts)
    plain = quantize_kv(x, "k", method="kivi", **opts)
    ref, _ = _sanitize(x.float(), group, False, "")
    use_plain = choose_key_frame(ref.reshape(*x.shape[:-2], x.shape[-2] // group, group, x.shape[-1]))
    pick = lambda a, b: None if a is None else torch.where(  # noqa: E731
        use_plain.reshape(use_plain.shape + (1,) * (a.dim() - use_plain.dim())), b, a)
    return QuantizedTiles(
        codes=pick(rot.codes, plain.codes), row_scale=pick(rot.row_scale, plain.row_scale),
        row_zero=pick(rot.row_zero, plain.row_zero), col_scale=pick(rot.col_scale, plain.col_scale),
        bits=bits, row_scale_factor=pick(rot.row_scale_factor, plain.row_scale_factor),
        col_scale_factor=pick(rot.col_scale_factor, plain.col_scale_factor),
        plain=use_plain.to(torch.uint8))
