"""Triton kernel: quantize whole KVarN tiles and write them, packed, into a tile cache.

Math (the oracle is :func:`kvarn_compile.quant.quantize.quantize_kv`, whose module doc states
the pipeline). For one tile of G consecutive tokens of one (batch row, kv head):

1. rotate: every token row x[t, :] becomes x[t, :] @ H (H = ``rotation_matrix(D)``, fp32);
2. lay out: a K tile is X = (x H)^T, [D, G] (rows = channels); a V tile is X = x H, [G, D]
   (rows = tokens);
3. normalize (kvarn only): log-domain Gauss-Seidel balancing of column and row stds, the
   best-so-far (c*, r*) kept with ``<=``, "no scaling" included (see ``_normalize_variance``);
4. RTN per row of B = X / c*[None, :] / r*[:, None], half to even, asymmetric;
5. fold: row_scale = r* * Δ, row_zero = r* * lo, col_scale = c*;
6. pack codes along each row, little end first, and store codes and scales in place.

So that::

    X̂[r, c] = (code[r, c] * row_scale[r] + row_zero[r]) * col_scale[c]

D is the head dim of the tokens given: the keys' for K tiles, the values' for V tiles. A
cache whose keys and values differ in width (MLA decompressed: D = 192, Dv = 128) quantizes
each side in the frame of its own rotation, ``rotation_matrix(D)`` and ``rotation_matrix(Dv)``.

Launchers:

* :func:`quantize_tiles_into` - the runtime entry: token-major x [B, H, n_src * G, D] is cut
  into n_src tiles per (b, h) and tile i of row b is written at tile index dst_tile[b, i] of
  preallocated destination tensors [B, H, N, ...]. Nothing is allocated except the index.
* :func:`quantize_tiles_triton` - convenience: token-major x [..., n * G, D] in, a fresh
  :class:`~kvarn_compile.quant.quantize.QuantizedTiles` out (same layout as the reference).

Limits (the launchers raise a clear error for each):

* bits in {2, 4, 8} (3-bit codes straddle bytes; use the reference);
* G a power of two >= 16 (``tl.arange`` and ``tl.dot``); any even D >= 2 (D is padded to a
  power of two >= 16 inside the kernel and masked, so 80, 96, 112 work);
* scale storage float16, bfloat16 or float32 (float8_e4m3fn needs a per-vector factor:
  NotImplementedError, use the reference);
* non-finite inputs are not handled in the kernel: one NaN/inf makes its whole tile
  garbage (NaN scales). The reference instead stores such tokens as NaN and quantizes the
  rest of the tile from the finite tokens. ``check_finite=True`` makes the launchers check
  with torch (one host sync) and raise :class:`~kvarn_compile.quant.quantize.NonFiniteError`;
  :func:`quantize_tiles_triton` can instead fall back to the reference.

Exactness: codes equal the reference's except where (B - lo) / Δ lies within a few ulps of a
rounding boundary (x.5): the rotation matmul, the std reductions and exp/log run in fp32
with a different summation order than torch's, so such ties can round the other way
(code ±1). Scales are equal up to their fp16 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvarn_compile.quant.quantize import (
    DELTA_MIN, IMBALANCE_EPS, LOG_SCALE_CLIP, STD_CLIP, NonFiniteError, QuantizedTiles,
    quantize_kv,
)
from kvarn_compile.quant.rotation import rotation_matrix

__all__ = ["quantize_tiles_into", "quantize_tiles_triton", "KERNEL_BITS", "KERNEL_SCALE_DTYPES"]

#: Code widths the packing kernels support: whole codes per byte.
KERNEL_BITS = (2, 4, 8)
#: Scale storage dtypes the kernels can store/load with a plain cast.
KERNEL_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# The reference's clip constants as constexprs (jit functions may only read constexpr globals).
_STD_LO = tl.constexpr(STD_CLIP[0])
_STD_HI = tl.constexpr(STD_CLIP[1])
_LOG_LO = tl.constexpr(LOG_SCALE_CLIP[0])
_LOG_HI = tl.constexpr(LOG_SCALE_CLIP[1])
_IMBALANCE_EPS = tl.constexpr(IMBALANCE_EPS)
_DELTA_MIN = tl.constexpr(DELTA_MIN)


# ------------------------------------------------------------------------------------------
# Per-tile helpers (reusable from an Inductor Triton template)
# ------------------------------------------------------------------------------------------
@triton.jit
def _rne(x):
    """Round half to even, elementwise, for fp32 |x| < 2^22 (torch.round semantics).

    The interpreter has no libdevice ``rint``, so: f = floor(x); round up when the
    fraction is above one half, or exactly one half and f is odd. x - floor(x) is exact
    in fp32 in this range, so the tie test is exact.
    """
    f = tl.floor(x)
    frac = x - f
    f_is_odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & f_is_odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _scaled(x, s, AXIS: tl.constexpr):
    """X * s, ``s`` a scale per entry along AXIS (broadcast over the other axis); X itself
    where ``s`` is None."""
    if s is None:
        return x
    else:
        return x * tl.expand_dims(s, 1 - AXIS)


@triton.jit
def _scaled_std(x, s, mask, n, AXIS: tl.constexpr, MASKED: tl.constexpr = True):
    """Unbiased (n - 1) std along AXIS of Z = X * s (:func:`_scaled`) over the entries where
    ``mask`` holds.

    Two passes (mean, then squared deviations), like torch's std up to summation order,
    each forming Z from X as it goes: the caller holds X and the scale, never a scaled
    copy of the tile beside X (the normalization loop's registers: at D = 192 a second
    tile spilled on sm_90). ``n``: the valid entries along AXIS (>= 2); ``MASKED`` False
    (no padding: every entry valid) skips the selects, so no [R, C] mask is held.
    """
    if MASKED:
        mean = tl.sum(tl.where(mask, _scaled(x, s, AXIS), 0.0), axis=AXIS) / n
        dev = tl.where(mask, _scaled(x, s, AXIS) - tl.expand_dims(mean, AXIS), 0.0)
    else:
        mean = tl.sum(_scaled(x, s, AXIS), axis=AXIS) / n
        dev = _scaled(x, s, AXIS) - tl.expand_dims(mean, AXIS)
    return tl.sqrt(tl.sum(dev * dev, axis=AXIS) / (n - 1))


@triton.jit
def _col_std(x, s, x2, s2, mask, n, MASKED: tl.constexpr, R2: tl.constexpr):
    """Std of each column of Z = X * s[:, None] (``s``: a scale per row, or None), the
    tile's rows in one part (``x``; R2 == 0) or two (``x`` above ``x2``, R2 rows scaled by
    ``s2``, neither padded): the two passes summed over both parts, the second part's
    first (sm_90, triton 3.6, D = 192: 46 local loads and stores per normalization
    iteration against 104 the other way round; 3.9 spills neither)."""
    if R2 == 0:
        return _scaled_std(x, s, mask, n, 0, MASKED)
    else:
        mean = (tl.sum(_scaled(x2, s2, 0), axis=0) + tl.sum(_scaled(x, s, 0), axis=0)) / n
        dev2 = _scaled(x2, s2, 0) - mean[None, :]
        ss2 = tl.sum(dev2 * dev2, axis=0)
        dev = _scaled(x, s, 0) - mean[None, :]
        return tl.sqrt((tl.sum(dev * dev, axis=0) + ss2) / (n - 1))


@triton.jit
def _score(col, row, row2, row_valid, col_valid, R2: tl.constexpr = 0):
    """The imbalance (a scalar) of a tile from its column stds [BLOCK_C] and row stds
    [BLOCK_R] (and ``row2`` [R2], those of a second row part):
    max(col)/max(min(col), eps) + max(row)/max(min(row), eps). Stds are >= 0, so 0 is a
    neutral pad for max and +inf for min."""
    col_max = tl.max(tl.where(col_valid, col, 0.0), axis=0)
    col_min = tl.min(tl.where(col_valid, col, float("inf")), axis=0)
    row_max = tl.max(tl.where(row_valid, row, 0.0), axis=0)
    row_min = tl.min(tl.where(row_valid, row, float("inf")), axis=0)
    if R2 > 0:
        row_max = tl.maximum(row_max, tl.max(row2, axis=0))
        row_min = tl.minimum(row_min, tl.min(row2, axis=0))
    return (col_max / tl.maximum(col_min, _IMBALANCE_EPS)
            + row_max / tl.maximum(row_min, _IMBALANCE_EPS))


@triton.jit
def _imbalance(y, mask, row_valid, col_valid, R: tl.constexpr, C: tl.constexpr,
               MASKED: tl.constexpr = True, y2=None, R2: tl.constexpr = 0):
    """The column stds [BLOCK_C] of one tile Y and its imbalance (:func:`_score`). R2 > 0:
    the tile's rows in two parts, ``y`` (R - R2 rows) above ``y2`` (R2 rows)."""
    col = _col_std(y, None, y2, None, mask, R, MASKED, R2)  # std of each column over R rows
    row = _scaled_std(y, None, mask, C, 1, MASKED)          # std of each row over C columns
    if R2 > 0:
        row2 = _scaled_std(y2, None, mask, C, 1, False)
    else:
        row2 = None
    return col, _score(col, row, row2, row_valid, col_valid, R2)


@triton.jit
def _normalize_variance(x, mask, row_valid, col_valid, iters,
                        R: tl.constexpr, C: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                        MASKED: tl.constexpr = True, best_a_ptr=None,
                        SCRATCH: tl.constexpr = False, x2=None, R2: tl.constexpr = 0):
    """Two-axis log-domain variance normalization of one fp32 tile X [BLOCK_R, BLOCK_C].

    Mirrors ``reference.normalize_variance``::

        a = 0 [C], b = 0 [R]; best = imbalance(X); (c*, r*) = (1, 1)
        repeat iters times:
            a = clip(a + log(clip(colstd(X / e^a / e^b), 1e-3, 1e3)), -0.3, 10)
            b = clip(b + log(clip(rowstd(X / e^a / e^b), 1e-3, 1e3)), -0.3, 10)
            if imbalance(X / e^a / e^b) <= best: best, c*, r* = that, e^a, e^b

    The original X is scaled at every step (no drift), in the reference's order (first
    the columns, then the rows), each division a multiplication by e^-a or e^-b. A scale
    common to a whole row comes out of that row's std, and one common to a column out of
    the column's: an iteration takes the row stds s of X e^-a once, for the row update
    (s e^-b) and for the imbalance (s e^-b', b' the updated b), and the column stds of Y
    as those of X e^-b' times e^-a (the same numbers in exact arithmetic; rounding apart
    from the reference's by a few ulps). So no pass holds a scaled copy of the tile beside
    X (at D = 192 that second tile spilled on sm_90), and an iteration takes two stds of
    the tile where it took three. The column stds an iteration's imbalance takes are those
    of the matrix the next iteration starts from: they are computed once (as the reference
    does), and the next column update is made at the end of the iteration. Returns
    (c* [BLOCK_C], r* [BLOCK_R], r2*).

    ``x2`` (R2 > 0): the tile's last R2 rows, below ``x`` (then R - R2 rows, unpadded):
    a key tile whose head dim lies between two powers of two (192 = 128 + 64) in two
    unpadded parts instead of one padded to the next power of two. r2* [R2] are its row
    scales; with one part (R2 == 0) r2* is r*.

    ``SCRATCH``: the best column log-scales so far are kept in memory at ``best_a_ptr``
    ([BLOCK_C] fp32, written by this program only) instead of in registers. In the MMA
    layout the rotation's dot leaves the tile in, every thread holds a quarter of each
    column vector (32 registers at 128 columns) and a 128 x 128 tile leaves no room for
    one more (it spilled 588 B at 8 warps on sm_90). The vector is written only when an
    iteration wins, read once at the end; barriers order those writes and the read.
    """
    b = tl.zeros([BLOCK_R], dtype=tl.float32)
    col0, best = _imbalance(x, mask, row_valid, col_valid, R, C, MASKED, x2, R2)
    if SCRATCH:
        tl.store(best_a_ptr, tl.zeros([BLOCK_C], dtype=tl.float32))  # "no scaling": c* = 1
    else:
        best_c = tl.full([BLOCK_C], 1.0, dtype=tl.float32)
    best_r = tl.full([BLOCK_R], 1.0, dtype=tl.float32)
    if R2 > 0:
        b2 = tl.zeros([R2], dtype=tl.float32)
        best_r2 = tl.full([R2], 1.0, dtype=tl.float32)
    # the first column update (from a = 0); each iteration ends with the next one
    a = tl.minimum(tl.maximum(tl.log(tl.minimum(tl.maximum(col0, _STD_LO), _STD_HI)), _LOG_LO),
                   _LOG_HI)
    for _ in range(iters):
        # the row stds of X / e^a; Y = X / e^a / e^b has them divided by e^b
        ia = tl.exp(-a)
        s = _scaled_std(x, ia, mask, C, 1, MASKED)
        row = tl.minimum(tl.maximum(s * tl.exp(-b), _STD_LO), _STD_HI)
        b = tl.minimum(tl.maximum(b + tl.log(row), _LOG_LO), _LOG_HI)
        ib = tl.exp(-b)
        if R2 > 0:
            s2 = _scaled_std(x2, ia, mask, C, 1, False)
            row2 = tl.minimum(tl.maximum(s2 * tl.exp(-b2), _STD_LO), _STD_HI)
            b2 = tl.minimum(tl.maximum(b2 + tl.log(row2), _LOG_LO), _LOG_HI)
            ib2 = tl.exp(-b2)
            y_row2 = s2 * ib2       # the second part's row stds of Y
        else:
            ib2 = None
            y_row2 = None
        # the column stds of Y: those of X / e^b divided by e^a
        col = ia * _col_std(x, ib, x2, ib2, mask, R, MASKED, R2)
        score = _score(col, s * ib, y_row2, row_valid, col_valid, R2)
        better = score <= best  # "<=": later iterations win ties, as in the reference
        best = tl.where(better, score, best)
        if SCRATCH:
            tl.debug_barrier()      # every thread's previous write is done before this one
            if better:
                tl.store(best_a_ptr, a)
        else:
            best_c = tl.where(better, tl.exp(a), best_c)
        best_r = tl.where(better, tl.exp(b), best_r)
        if R2 > 0:
            best_r2 = tl.where(better, tl.exp(b2), best_r2)
        # the next iteration's column update, from the column stds of this Y (a name of the
        # loop's own: a value defined before the loop would be carried through it)
        a = tl.minimum(tl.maximum(a + tl.log(tl.minimum(tl.maximum(col, _STD_LO), _STD_HI)),
                                  _LOG_LO), _LOG_HI)
    if SCRATCH:
        tl.debug_barrier()          # the last write is visible to every thread
        best_c = tl.exp(tl.load(best_a_ptr))
        tl.debug_barrier()          # and read by every thread before the codes overwrite it
    if R2 == 0:
        best_r2 = best_r
    return best_c, best_r, best_r2


@triton.jit
def _rtn_rows(b, mask, row_valid, BITS: tl.constexpr, MASKED: tl.constexpr = True):
    """Asymmetric per-row round-to-nearest of fp32 B [BLOCK_R, BLOCK_C].

    lo/hi = row min/max over the valid columns, Δ = max((hi - lo) / (2^BITS - 1), 1e-10),
    code = clamp(rne((B - lo) / Δ), 0, 2^BITS - 1). Returns (codes int32, Δ, lo).
    Padding rows get lo = hi = 0 (not ±inf) so no NaN is ever cast to an int.
    """
    QMAX: tl.constexpr = (1 << BITS) - 1
    if MASKED:
        lo = tl.where(row_valid, tl.min(tl.where(mask, b, float("inf")), axis=1), 0.0)
        hi = tl.where(row_valid, tl.max(tl.where(mask, b, float("-inf")), axis=1), 0.0)
    else:
        lo = tl.min(b, axis=1)
        hi = tl.max(b, axis=1)
    delta = tl.maximum((hi - lo) / QMAX, _DELTA_MIN)
    q = _rne((b - lo[:, None]) / delta[:, None])
    q = tl.minimum(tl.maximum(q, 0.0), QMAX)
    return q.to(tl.int32), delta, lo


@triton.jit
def _pack_rows(codes, BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Pack int32 codes [BLOCK_R, BLOCK_C] along each row, little end first.

    Code c of a row goes to byte c // PER at shift (c % PER) * BITS, PER = 8 // BITS.
    Returns uint8 [BLOCK_R, BLOCK_C // PER].
    """
    PER: tl.constexpr = 8 // BITS
    groups = tl.reshape(codes, [BLOCK_R, BLOCK_C // PER, PER])  # (r, j, k) = code (r, j*PER + k)
    shifts = tl.arange(0, PER) * BITS
    return tl.sum(groups << shifts[None, None, :], axis=2).to(tl.uint8)


@triton.jit
def _key_rows(x_base, stride_xt, rot_ptr, R0: tl.constexpr, RP: tl.constexpr, D: tl.constexpr,
              G: tl.constexpr, CHUNK: tl.constexpr, ROTATE: tl.constexpr):
    """Rows R0 .. R0 + RP (channels) of a key tile X = H^T X_tok^T, fp32 [RP, G]: the
    rotation summed over chunks of CHUNK input channels, each chunk of the tokens and of H
    read from memory (unrotated: the rows as they are). Rows at or past D (a padded tile)
    are 0."""
    offs_r = R0 + tl.arange(0, RP)
    offs_c = tl.arange(0, G)
    if R0 + RP > D:
        r_ok = offs_r < D
    else:
        r_ok = offs_r >= 0   # (every row is a channel: no mask to hold)
    if ROTATE:
        x = tl.zeros([RP, G], dtype=tl.float32)
        for e0 in tl.range(0, D, CHUNK, num_stages=2):   # a loop, not unrolled (see the kernel)
            offs_e = e0 + tl.arange(0, CHUNK)
            e_valid = offs_e < D
            if R0 + RP > D:
                rot_ok = r_ok[:, None] & e_valid[None, :]
            else:
                rot_ok = e_valid[None, :]
            rot = tl.load(rot_ptr + offs_e[None, :] * D + offs_r[:, None], mask=rot_ok,
                          other=0.0)
            part = tl.load(x_base + offs_c[None, :] * stride_xt + offs_e[:, None],
                           mask=e_valid[:, None], other=0.0)
            x += tl.dot(rot, part.to(tl.float32), input_precision="tf32x3")
    elif R0 + RP > D:
        x = tl.load(x_base + offs_c[None, :] * stride_xt + offs_r[:, None],
                    mask=r_ok[:, None], other=0.0).to(tl.float32)
    else:
        x = tl.load(x_base + offs_c[None, :] * stride_xt + offs_r[:, None]).to(tl.float32)
    return x


@triton.jit
def _store_rows(xb, row_s, offs_r, row_valid, mask, codes_ptr, row_scale_ptr, row_zero_ptr,
                ROW_BYTES: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_C: tl.constexpr, MASKED: tl.constexpr):
    """RTN, pack and store rows ``offs_r`` of a tile from B = X / c* / r* (``xb``) and their
    normalization scales ``row_s``: the codes at ``codes_ptr`` (the tile's first row), the
    folded row scale r* Δ and zero point r* lo at ``row_scale_ptr`` / ``row_zero_ptr``."""
    codes, delta, lo = _rtn_rows(xb, mask, row_valid, BITS, MASKED)
    packed = _pack_rows(codes, BITS, BLOCK_R, BLOCK_C)
    offs_byte = tl.arange(0, BLOCK_C * BITS // 8)
    tl.store(codes_ptr + offs_r[:, None] * ROW_BYTES + offs_byte[None, :],
             packed, mask=row_valid[:, None] & (offs_byte < ROW_BYTES)[None, :])
    tl.store(row_scale_ptr + offs_r, (row_s * delta).to(row_scale_ptr.dtype.element_ty),
             mask=row_valid)
    tl.store(row_zero_ptr + offs_r, (row_s * lo).to(row_zero_ptr.dtype.element_ty),
             mask=row_valid)


# ------------------------------------------------------------------------------------------
# The kernel
# ------------------------------------------------------------------------------------------
@triton.jit
def _kvarn_quantize_tiles_kernel(
    x_ptr,            # token-major input [B, H, n_src * G, D], any float dtype, last stride 1
    stride_xb,        # x.stride(0)
    stride_xh,        # x.stride(1)
    stride_xt,        # x.stride(2): between consecutive tokens
    rot_ptr,          # rotation H [D, D] fp32 contiguous (unused when ROTATE is False)
    codes_ptr,        # dst packed codes uint8 [B, H, N, R, C * BITS / 8], contiguous
    row_scale_ptr,    # dst row scales [B, H, N, R] (fp16/bf16/fp32), contiguous
    row_zero_ptr,     # dst row zero points [B, H, N, R], contiguous
    col_scale_ptr,    # dst column scales [B, H, N, C], contiguous
    dst_tile_ptr,     # int32/int64 [B, n_src]: destination tile of source tile i of row b;
                      #   an index outside [0, N) writes nothing (e.g. -1: "no tile here")
    iters,            # normalization iterations T (runtime: changing it does not recompile)
    H,                # kv heads
    N,                # tile capacity of the destination tensors
    n_src,            # source tiles per (b, h)
    D: tl.constexpr,          # head dim
    G: tl.constexpr,          # tokens per tile (power of two >= 16)
    BLOCK_D: tl.constexpr,    # D rounded up to a power of two >= 16 (tl.arange / tl.dot need it)
    IS_K: tl.constexpr,       # K tile [D, G] (rows = channels) or V tile [G, D] (rows = tokens)
    BITS: tl.constexpr,       # code width, 2, 4 or 8
    ROTATE: tl.constexpr,     # rotate by H first (kvarn, hadamard); a constexpr so kivi skips the matmul
    NORMALIZE: tl.constexpr,  # run the variance normalization (kvarn); else c* = r* = 1 exactly
    ROT_CHUNK: tl.constexpr = 0,  # rotate in chunks of this many input channels read from
                                  # memory (0: one dot over the whole tile; see below)
    SCRATCH: tl.constexpr = False,  # keep the normalization's best column log-scales in the
                                    # destination tile's code bytes until the codes are
                                    # written (the launcher checks they fit and are aligned)
    PART_A: tl.constexpr = 0,  # K tiles only: > 0 holds the rows in two unpadded parts,
                               # PART_A and D - PART_A rows (both powers of two); see below
):
    """Quantize one tile of one (batch row, kv head) and store it packed, in place.

    How is this kernel parallelized? Grid (B * H, n_src): program (pid0, i) loads the G
    tokens i*G .. i*G+G-1 of (b, h) = divmod(pid0, H), holds the whole tile in registers
    (rotation by one ``tl.dot`` with H, then every normalization iteration, RTN and
    packing), and writes tile dst_tile[b, i]. Tiles are independent: no atomics, no
    inter-program communication.

    Tile shape R x C: K -> R = D, C = G; V -> R = G, C = D. D is padded to BLOCK_D and the
    padding masked out of every statistic and store, except for a K tile whose D is the
    sum of two powers of two (``PART_A``, e.g. 192 = 128 + 64, 96 = 64 + 32): its rows are
    held in two parts, no padding, so a 192-channel tile takes 3/4 of the registers of a
    256-channel one (padded, the D = 192 tile spilled ~2.8 KB on sm_90).
    """
    pid_bh = tl.program_id(0)
    tile = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    # a program whose tile goes nowhere does nothing: a decode step launches the quantizer
    # every step (no host sync to ask whether a tile completes) and most programs stop here
    dst = tl.load(dst_tile_ptr + b.to(tl.int64) * n_src + tile).to(tl.int64)
    if (dst < 0) | (dst >= N):
        return

    TWO: tl.constexpr = PART_A > 0
    R2: tl.constexpr = D - PART_A if PART_A > 0 else 0   # rows of the second part
    if IS_K:
        R: tl.constexpr = D
        C: tl.constexpr = G
        BLOCK_R: tl.constexpr = BLOCK_D if PART_A == 0 else PART_A
        BLOCK_C: tl.constexpr = G
    else:
        R: tl.constexpr = G
        C: tl.constexpr = D
        BLOCK_R: tl.constexpr = G
        BLOCK_C: tl.constexpr = BLOCK_D
    offs_r = tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, BLOCK_C)
    row_valid = offs_r < R
    col_valid = offs_c < C
    mask = row_valid[:, None] & col_valid[None, :]
    PADDED: tl.constexpr = BLOCK_R * BLOCK_C != R * C   # else no statistic needs the mask

    # ---- load the tile straight into its R x C layout (transposed pointers for K)
    x_base = x_ptr + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh \
        + (tile * G).to(tl.int64) * stride_xt
    if IS_K:  # X[r = channel, c = token]
        x_offs = offs_c[None, :] * stride_xt + offs_r[:, None]
    else:     # X[r = token, c = channel]
        x_offs = offs_r[:, None] * stride_xt + offs_c[None, :]
    # ---- rotate: token rows times H. K: X = H^T X_tok^T; V: X = X_tok H. "tf32x3" (three
    # tf32 products, fp32-level accuracy on tensor cores), never plain tf32 (its 10-bit
    # mantissa would change many codes); "ieee" is an FMA dot that holds both 128 x 128
    # operands in registers and spills ~40 KB per thread on sm_90 at D = G = 128.
    # ROT_CHUNK > 0 (BLOCK_D > 128, e.g. MLA keys, D = 192 -> 256): the whole-tile dot would
    # stage a 256 x 256 fp32 rotation in shared memory (256 KiB, more than an sm_90 SM has),
    # so the product is summed over chunks of ROT_CHUNK input channels, each chunk of the
    # tile and of H read from memory (the same sum, in another order). The chunks are a
    # loop, not unrolled: Triton pipelines its loads through shared memory, where unrolled
    # ptxas hoisted the next chunks' loads into registers beside the accumulators (sm_90: a
    # D = 192 value tile spilled 14.5 KB with triton 3.9; 3.6 failed to allocate it). Two
    # stages: three staged a value tile's chunks in 288 KiB of shared memory (an SM has 228).
    if TWO:
        CHUNK: tl.constexpr = ROT_CHUNK if ROT_CHUNK > 0 else BLOCK_D
        x = _key_rows(x_base, stride_xt, rot_ptr, 0, PART_A, D, G, CHUNK, ROTATE)
        x2 = _key_rows(x_base, stride_xt, rot_ptr, PART_A, R2, D, G, CHUNK, ROTATE)
    elif ROTATE and ROT_CHUNK > 0 and IS_K:   # Ht[r, e] @ X_tok^T[e, c], padded rows 0
        x = _key_rows(x_base, stride_xt, rot_ptr, 0, BLOCK_D, D, G, ROT_CHUNK, ROTATE)
    elif ROTATE and ROT_CHUNK > 0:              # V: X_tok[r, e] @ H[e, c]
        x = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for e0 in tl.range(0, BLOCK_D, ROT_CHUNK, num_stages=2):   # a loop, as _key_rows
            offs_e = e0 + tl.arange(0, ROT_CHUNK)
            e_valid = offs_e < D
            part = tl.load(x_base + offs_r[:, None] * stride_xt + offs_e[None, :],
                           mask=row_valid[:, None] & e_valid[None, :], other=0.0)
            rot = tl.load(rot_ptr + offs_e[:, None] * D + offs_c[None, :],
                          mask=e_valid[:, None] & col_valid[None, :], other=0.0)
            x += tl.dot(part.to(tl.float32), rot, input_precision="tf32x3")
    else:
        x = tl.load(x_base + x_offs, mask=mask, other=0.0).to(tl.float32)
    if not TWO:
        x2 = None
    if ROTATE and ROT_CHUNK == 0 and not TWO:
        offs_e = tl.arange(0, BLOCK_D)
        e_valid = offs_e < D
        if IS_K:  # Ht[r, e] = H[e, r]
            rot = tl.load(rot_ptr + offs_e[None, :] * D + offs_r[:, None],
                          mask=row_valid[:, None] & e_valid[None, :], other=0.0)
            x = tl.dot(rot, x, input_precision="tf32x3")
        else:     # H[e, c]
            rot = tl.load(rot_ptr + offs_e[:, None] * D + offs_c[None, :],
                          mask=e_valid[:, None] & col_valid[None, :], other=0.0)
            x = tl.dot(x, rot, input_precision="tf32x3")

    # ---- normalize, then RTN on B = X / c* / r*
    ROW_BYTES: tl.constexpr = C * BITS // 8
    slot = (b.to(tl.int64) * H + h) * N + dst  # flat index of the destination tile
    tile_codes_ptr = codes_ptr + slot * (R * ROW_BYTES)
    if NORMALIZE:
        # SCRATCH: the tile's own code bytes, written by this program only and overwritten
        # by its codes at the end, hold the best column log-scales meanwhile (fp32 [BLOCK_C])
        col_s, row_s, row_s2 = _normalize_variance(
            x, mask, row_valid, col_valid, iters, R, C, BLOCK_R, BLOCK_C, PADDED,
            tile_codes_ptr.to(tl.pointer_type(tl.float32)) + offs_c, SCRATCH, x2, R2)
    else:
        col_s = tl.full([BLOCK_C], 1.0, dtype=tl.float32)
        row_s = tl.full([BLOCK_R], 1.0, dtype=tl.float32)
        if TWO:
            row_s2 = tl.full([R2], 1.0, dtype=tl.float32)
        else:
            row_s2 = row_s

    # ---- RTN on B = X / c* / r*, pack, store at the destination tile (in range: a program
    # whose tile goes nowhere returned)
    rs_ptr = row_scale_ptr + slot * R
    rz_ptr = row_zero_ptr + slot * R
    _store_rows(x / col_s[None, :] / row_s[:, None], row_s, offs_r, row_valid, mask,
                tile_codes_ptr, rs_ptr, rz_ptr, ROW_BYTES, BITS, BLOCK_R, BLOCK_C, PADDED)
    if TWO:
        offs_r2 = PART_A + tl.arange(0, R2)
        _store_rows(x2 / col_s[None, :] / row_s2[:, None], row_s2, offs_r2, offs_r2 < R, mask,
                    tile_codes_ptr, rs_ptr, rz_ptr, ROW_BYTES, BITS, R2, BLOCK_C, False)
    cs_ptr = col_scale_ptr + slot * C + offs_c
    tl.store(cs_ptr, col_s.to(cs_ptr.dtype.element_ty), mask=col_valid)


# ------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------
def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or bits not in KERNEL_BITS:
        if bits == 3:
            raise NotImplementedError(
                "Expected bits in (2, 4, 8) for the Triton packing kernels, but got 3: 3-bit "
                "codes straddle byte boundaries; use kvarn_compile.quant.quantize_kv.")
        raise ValueError(f"Expected bits in {KERNEL_BITS}, but got {bits!r}.")


def _check_scale_dtype(t: torch.Tensor, what: str) -> None:
    if t.dtype == torch.float8_e4m3fn:
        raise NotImplementedError(
            f"Expected {what} in one of {KERNEL_SCALE_DTYPES} for the Triton kernels, but got "
            "float8_e4m3fn: fp8 scales carry a per-vector fp16 factor the kernels do not "
            "apply yet; use the reference (kvarn_compile.quant) for fp8 scale storage.")
    if t.dtype not in KERNEL_SCALE_DTYPES:
        raise TypeError(f"Expected {what} dtype in {KERNEL_SCALE_DTYPES}, but got {t.dtype}.")


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _rot_chunk(d: int) -> int:
    """ROT_CHUNK of the kernel: 0 (one dot) up to BLOCK_D = 128, else chunks of 64 channels,
    so the rotation's operands fit an sm_90 SM's shared memory (228 KiB)."""
    return 0 if _block_d(d) <= 128 else 64


def _part_a(kind: str, d: int) -> int:
    """PART_A of the kernel: a K tile whose D is BLOCK_D / 2 plus a power of two >= 16
    (192 = 128 + 64, 96 = 64 + 32, 80 = 64 + 16) holds its rows in those two parts, and so
    does one of D = 256 (128 + 128: at 16 warps each part's column vectors take half the
    registers one 256-row part's do; sm_90: 2,433 instructions per iteration against 3,050,
    167 local loads and stores against 250), else 0 (one part, padded to BLOCK_D). V tiles:
    0 (their channels are the columns)."""
    half = _block_d(d) // 2
    rest = d - half
    two = kind == "k" and (d != 2 * half or half == 128) and rest >= 16 \
        and rest & (rest - 1) == 0
    return half if two else 0


def _num_warps(d: int, group: int, part_a: int = 0) -> int:
    """4 warps up to 64 x 64 tiles, 8 up to 128 x 128 (at 4 warps a 128 x 64 tile spilled
    ~0.4 KB on sm_90) and for a key tile in two parts of at most 192 rows (192 x 128: at 16
    warps it spills ~0.8 KB and runs a quarter more instructions per tile, at 8 none), 16
    past that, in parts or padded (a 256 x 128 tile alone is 128 fp32 registers per thread
    at 8 warps)."""
    if _block_d(d) > 128 and (not part_a or d > 192):
        return 16
    return 8 if group * _block_d(d) > 64 * 64 else 4


def tile_fits(kind: str, d: int, group: int) -> bool:
    """Whether the tile quantizer runs a tile of this shape (``kind`` "k" or "v", head dim d,
    G = group tokens) on the GPU it is built for (sm_90: 64K registers and 227 KiB of shared
    memory an SM). It holds the whole fp32 tile in registers and stages its rotation's
    operands in shared memory. Measured with the static report (triton 3.9): key tiles of
    up to 512 rows (D padded) by 128 tokens compile and fit (1,024 x 128 asks for 336 KiB of
    shared memory, 128 x 256 for 256 KiB); value tiles of up to 256 columns and 32K codes
    (128 x 256 and 256 x 128: ptxas cannot allocate 128 x 512 or 256 x 256, and 64 x 512
    asks for 392 KiB). Other tiles are quantized by the reference (``ops/dispatch``,
    ``kernels/triton/append``: the same codes, slower)."""
    block_d = _block_d(d)
    if kind == "k":
        return group <= 128 and block_d <= 512
    return block_d <= 256 and block_d * group <= 256 * 128


def _scratch_fits(dst_codes: torch.Tensor, rows: int, cols: int, bits: int, block_c: int
                  ) -> bool:
    """Whether a destination tile's code bytes can hold the normalization's best column
    log-scales (SCRATCH): BLOCK_C fp32 values, 4-byte aligned in every tile."""
    tile_bytes = rows * cols * bits // 8
    return tile_bytes >= 4 * block_c and tile_bytes % 4 == 0 and dst_codes.data_ptr() % 4 == 0


def quantize_tiles_into(
    x: torch.Tensor,
    dst_codes: torch.Tensor,
    dst_row_scale: torch.Tensor,
    dst_row_zero: torch.Tensor,
    dst_col_scale: torch.Tensor,
    *,
    kind: str,
    bits: int,
    rotate: bool,
    normalize: bool,
    iters: int = 8,
    dst_tile: torch.Tensor | None = None,
    rotation: torch.Tensor | None = None,
    check_finite: bool = False,
) -> None:
    """Quantize token-major ``x`` [B, H, n_src * G, D] into preallocated packed tiles, in place.

    Destinations (contiguous, capacity N tiles, shapes of ``reference.quantize_kv``):

    * K (``kind="k"``): codes uint8 [B, H, N, D, G*bits/8], row_scale/row_zero [B, H, N, D],
      col_scale [B, H, N, G];
    * V (``kind="v"``): codes uint8 [B, H, N, G, D*bits/8], row_scale/row_zero [B, H, N, G],
      col_scale [B, H, N, D].

    G is read from the destination shapes. Source tile i of batch row b goes to tile
    ``dst_tile[b, i]`` (int32/int64 [B, n_src], or [B] when n_src == 1; default: tile i);
    an index outside [0, N) writes nothing, so -1 marks "no complete tile in this row".
    ``rotate``/``normalize``: (True, True) kvarn, (True, False) hadamard, (False, False) kivi.
    ``rotation`` overrides H (fp32 [D, D]); default ``rotation_matrix(D)``. D is x's last
    size: for values of another width than the keys (Dv), pass Dv-wide tokens and
    destinations and the Dv rotation (or none: the default is then the right one).
    ``x`` may be any float dtype and any strides with a unit last stride. Non-finite input
    is not handled (see the module docstring); ``check_finite`` raises instead (host sync).
    """
    if kind not in ("k", "v"):
        raise ValueError(f"Expected kind 'k' (keys) or 'v' (values), but got {kind!r}.")
    _check_bits(bits)
    if not isinstance(iters, int) or isinstance(iters, bool) or iters < 0:
        raise ValueError(f"Expected iters to be a non-negative int, but got {iters!r}.")
    if not x.is_floating_point():
        raise TypeError(f"Expected a floating-point x, but got {x.dtype}.")
    if x.dim() != 4:
        raise ValueError(f"Expected x of shape [B, H, n_src * G, D], but got {tuple(x.shape)}.")
    if x.stride(-1) != 1:
        raise ValueError(f"Expected x with a unit last stride, but got strides {x.stride()}.")
    bsz, heads, tokens, d = x.shape
    if d < 2 or d % 2:
        raise ValueError(f"Expected an even head_dim >= 2, but got {d}.")
    for name, t, nd in (("dst_codes", dst_codes, 5), ("dst_row_scale", dst_row_scale, 4),
                        ("dst_row_zero", dst_row_zero, 4), ("dst_col_scale", dst_col_scale, 4)):
        if t.dim() != nd:
            raise ValueError(f"Expected {name} with {nd} dims, but got shape {tuple(t.shape)}.")
        if t.device != x.device:
            raise ValueError(f"Expected {name} on {x.device}, but got {t.device}.")
        if not t.is_contiguous():
            raise ValueError(f"Expected a contiguous {name}, but got strides {t.stride()}.")
        if tuple(t.shape[:2]) != (bsz, heads):
            raise ValueError(f"Expected {name} to start with [B, H] = {[bsz, heads]}, "
                             f"but got shape {tuple(t.shape)}.")
    if dst_codes.dtype != torch.uint8:
        raise TypeError(f"Expected dst_codes of dtype torch.uint8, but got {dst_codes.dtype}.")
    for name, t in (("dst_row_scale", dst_row_scale), ("dst_row_zero", dst_row_zero),
                    ("dst_col_scale", dst_col_scale)):
        _check_scale_dtype(t, name)
    cap = dst_codes.shape[2]
    group = dst_col_scale.shape[-1] if kind == "k" else dst_row_scale.shape[-1]
    rows, cols = (d, group) if kind == "k" else (group, d)
    expected = {
        "dst_codes": (bsz, heads, cap, rows, cols * bits // 8),
        "dst_row_scale": (bsz, heads, cap, rows),
        "dst_row_zero": (bsz, heads, cap, rows),
        "dst_col_scale": (bsz, heads, cap, cols),
    }
    for name, t in (("dst_codes", dst_codes), ("dst_row_scale", dst_row_scale),
                    ("dst_row_zero", dst_row_zero), ("dst_col_scale", dst_col_scale)):
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"Expected {name} of shape {list(expected[name])} (kind={kind!r}, "
                             f"bits={bits}, G={group}, D={d}), but got {list(t.shape)}.")
    if group < 16 or group & (group - 1):
        raise NotImplementedError(
            f"Expected a power-of-two tile length G >= 16 for the Triton kernel, but got {group}.")
    if not tile_fits(kind, d, group):
        raise NotImplementedError(
            f"Expected a tile the Triton quantizer fits on a GPU (keys up to 512 channels x 128 "
            f"tokens, values up to 256 channels and 32K codes), but got a {kind!r} tile of "
            f"D={d} x G={group}; quantize it with kvarn_compile.quant.quantize_kv.")
    if cols % (8 // bits):
        raise ValueError(f"Expected a row length divisible by {8 // bits} to pack {bits}-bit "
                         f"codes, but got {cols}.")
    if tokens % group:
        raise ValueError(f"Expected x to hold whole tiles of G={group} tokens, but got "
                         f"{tokens} tokens.")
    n_src = tokens // group

    if dst_tile is None:
        if n_src > cap:
            raise ValueError(f"Expected at most N={cap} source tiles without dst_tile, but got "
                             f"{n_src}.")
        dst_tile = torch.arange(n_src, device=x.device, dtype=torch.int32).expand(bsz, n_src)
    else:
        if dst_tile.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"Expected dst_tile of dtype int32 or int64, but got {dst_tile.dtype}.")
        if dst_tile.device != x.device:
            raise ValueError(f"Expected dst_tile on {x.device}, but got {dst_tile.device}.")
        if dst_tile.dim() == 1 and n_src == 1:
            dst_tile = dst_tile[:, None]
        if tuple(dst_tile.shape) != (bsz, n_src):
            raise ValueError(f"Expected dst_tile of shape [B, n_src] = {[bsz, n_src]}, but got "
                             f"{list(dst_tile.shape)}.")
    dst_tile = dst_tile.contiguous()

    if rotate:
        if rotation is None:
            rotation = rotation_matrix(d, x.device)
        if rotation.shape != (d, d) or rotation.dtype != torch.float32:
            raise ValueError(f"Expected a float32 rotation of shape [{d}, {d}], but got "
                             f"{rotation.dtype} {list(rotation.shape)}.")
        if rotation.device != x.device:
            raise ValueError(f"Expected the rotation on {x.device}, but got {rotation.device}.")
        rotation = rotation.contiguous()
    else:
        rotation = x  # never read: ROTATE is a constexpr False

    if check_finite and not bool(torch.isfinite(x).all()):
        raise NonFiniteError(
            f"quantize_tiles_into(kind={kind!r}): found a NaN/inf in x. Expected finite "
            "keys/values; the Triton kernel does not isolate bad tokens like the reference.")
    if n_src == 0 or bsz * heads == 0:
        return

    block_d = _block_d(d)
    part_a = _part_a(kind, d)
    grid = (bsz * heads, n_src)
    _kvarn_quantize_tiles_kernel[grid](
        x, x.stride(0), x.stride(1), x.stride(2),
        rotation,
        dst_codes, dst_row_scale, dst_row_zero, dst_col_scale,
        dst_tile,
        iters if normalize else 0,
        heads, cap, n_src,
        D=d, G=group, BLOCK_D=block_d, IS_K=kind == "k", BITS=bits,
        ROTATE=bool(rotate), NORMALIZE=bool(normalize) and iters > 0, ROT_CHUNK=_rot_chunk(d),
        SCRATCH=_scratch_fits(dst_codes, rows, cols, bits, group if kind == "k" else block_d),
        PART_A=part_a, num_warps=_num_warps(d, group, part_a),
    )


def quantize_tiles_triton(
    x: torch.Tensor,
    kind: str,
    bits: int,
    *,
    rotate: bool,
    normalize: bool,
    iters: int = 8,
    group: int = 128,
    scale_dtype: torch.dtype = torch.float16,
    out: QuantizedTiles | None = None,
    nonfinite: str = "raise",
) -> QuantizedTiles:
    """Quantize token-major ``x`` [..., n * G, D] into tiles, like ``reference.quantize_kv``.

    Returns a :class:`QuantizedTiles` with tiles [..., n, D, G] (K) or [..., n, G, D] (V),
    or fills ``out`` (contiguous tensors of those shapes) and returns it.
    ``nonfinite``: what to do when x holds a NaN/inf (checked with torch, one host sync):
    "raise" (NonFiniteError), "reference" (quantize with the reference, which stores bad
    tokens as NaN) or "ignore" (skip the check; such tiles come out garbage).
    """
    if kind not in ("k", "v"):
        raise ValueError(f"Expected kind 'k' (keys) or 'v' (values), but got {kind!r}.")
    if nonfinite not in ("raise", "reference", "ignore"):
        raise ValueError(f"Expected nonfinite in ('raise', 'reference', 'ignore'), but got "
                         f"{nonfinite!r}.")
    _check_bits(bits)
    if x.dim() < 2:
        raise ValueError(f"Expected x of shape [..., tokens, D], but got {tuple(x.shape)}.")
    *lead, tokens, d = x.shape
    if tokens % group:
        raise ValueError(f"Expected the token count to be a multiple of group={group}, but got "
                         f"{tokens}. Quantize whole tiles only.")
    if nonfinite != "ignore" and not bool(torch.isfinite(x).all()):
        if nonfinite == "raise":
            raise NonFiniteError(
                f"quantize_tiles_triton(kind={kind!r}): found a NaN/inf in x. Expected finite "
                "keys/values, or pass nonfinite='reference' to store such tokens as NaN.")
        if normalize and not rotate:
            raise NotImplementedError("Expected rotate=True with normalize=True for the "
                                      "reference fallback (no reference method normalizes "
                                      "without rotating), but got rotate=False.")
        method = "kvarn" if normalize else ("hadamard" if rotate else "kivi")
        ref = quantize_kv(x, kind, method=method, bits=bits, group=group, iters=iters,
                          scale_dtype=scale_dtype)
        if out is None:
            return ref
        for dst, src in zip((out.codes, out.row_scale, out.row_zero, out.col_scale),
                            (ref.codes, ref.row_scale, ref.row_zero, ref.col_scale)):
            dst.copy_(src)
        return out

    n = tokens // group
    rows, cols = (d, group) if kind == "k" else (group, d)
    flat = 1
    for s in lead:
        flat *= s
    if out is None:
        dev = x.device
        out = QuantizedTiles(
            codes=torch.empty(*lead, n, rows, cols * bits // 8, dtype=torch.uint8, device=dev),
            row_scale=torch.empty(*lead, n, rows, dtype=scale_dtype, device=dev),
            row_zero=torch.empty(*lead, n, rows, dtype=scale_dtype, device=dev),
            col_scale=torch.empty(*lead, n, cols, dtype=scale_dtype, device=dev),
            bits=bits)
    elif out.bits != bits:
        raise ValueError(f"Expected out.bits == {bits}, but got {out.bits}.")
    if any(not t.is_contiguous() for t in (out.codes, out.row_scale, out.row_zero,
                                           out.col_scale)):
        raise ValueError("Expected contiguous tensors in out, but got a non-contiguous one.")
    x4 = x.reshape(flat, 1, tokens, d)
    if x4.stride(-1) != 1:
        x4 = x4.contiguous()

    def view(t: torch.Tensor) -> torch.Tensor:
        return t.view(flat, 1, *t.shape[len(lead):])

    quantize_tiles_into(x4, view(out.codes), view(out.row_scale), view(out.row_zero),
                        view(out.col_scale), kind=kind, bits=bits, rotate=rotate,
                        normalize=normalize, iters=iters)
    return out
