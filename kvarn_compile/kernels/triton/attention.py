"""Triton kernel: split-K (flash-decoding) attention over packed KVarN tiles.

Covers the *quantized region only*: the caller attends over the exact sink and tail itself
(in torch) and merges the regions with their log-sum-exps::

    M = max(lse_a, lse_b)
    out = (exp(lse_a - M) * out_a + exp(lse_b - M) * out_b) / (exp(lse_a - M) + exp(lse_b - M))

Math, in the rotated frames (q_rot = q @ H_D; the output is rotated back by the caller with
out @ H_Dv^T, where H_Dv is the values' own rotation: ``rotation_matrix(Dv)``). Keys and
values may have different head dims (multi-head latent attention decompressed: D = 192,
Dv = 128): the scores run over D, the values and the output over Dv. For one query row
q [D] and one tile (the dual-scale fold of :mod:`kvarn_compile.ops.attention`)::

    K̂[c, t] = (code_k[c, t] * rs_k[c] + rz_k[c]) * cs_k[t]          K tile [D, G]
    V̂[t, c] = (code_v[t, c] * rs_v[t] + rz_v[t]) * cs_v[c]          V tile [G, Dv]

    s[t]    = scale * cs_k[t] * ( sum_c (q[c] * rs_k[c]) * code_k[c, t] + sum_c q[c] * rz_k[c] )
    acc[c] += cs_v[c] * ( sum_t (p[t] * rs_v[t]) * code_v[t, c] + sum_t p[t] * rz_v[t] )

with p = exp(s - m) under an online softmax (running max m, denominator l). The per-channel
factors fold into q (K) and the output (V), the per-token factors into the scores and p, so
K̂/V̂ are never materialized: the only O(D*G) work is the two code matmuls.

Launchers:

* :func:`kvarn_decode_attention` - stacked tensors in, ``(out_rot, lse)`` out;
* :func:`kvarn_decode_attention_tiles` - the same from two ``QuantizedTiles``.

Masking: no causal mask. In decode every quantized token is older than every query, so
none is needed. An optional ``kv_start`` [B, Tq] gives, per batch row and query position,
the first quantized-region token (index j * G + t) the query may see (a sliding-window
lower bound); earlier tokens are masked and whole tiles below every query's bound are
skipped. Rows with nothing to attend (0 tiles, or everything masked) give lse = -inf and
out = 0.

``lse`` is the natural-log log-sum-exp of the *scaled* scores (scale * q·k), the quantity
the merge formula above expects.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvarn_compile.kernels import CUDA_PRECISION, use_inline_ptx
from kvarn_compile.kernels.triton.quantize import KERNEL_BITS, KERNEL_SCALE_DTYPES
from kvarn_compile.quant.quantize import QuantizedTiles

__all__ = ["kvarn_attention", "kvarn_decode_attention", "kvarn_decode_attention_tiles",
           "combine_splits"]

_LN2 = tl.constexpr(0.6931471805599453)


# ------------------------------------------------------------------------------------------
# Per-tile helpers (reusable from an Inductor Triton template)
# ------------------------------------------------------------------------------------------
@triton.jit
def _unpack_bytes(byte, R: tl.constexpr, NC: tl.constexpr, BITS: tl.constexpr):
    """int32 bytes [R, NC * BITS / 8] -> int32 codes [R, NC] in code order: the PER shifted
    copies of a byte are interleaved back with ``tl.join`` + ``tl.reshape``."""
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    if PER == 1:
        codes = byte
    elif PER == 2:     # (byte j, k) -> code 2j + k
        codes = tl.reshape(tl.join(byte & MASK, byte >> 4), [R, NC])
    else:              # PER == 4: join(join(s0, s2), join(s1, s3))[j, a, b] = code 4j + 2a + b
        codes = tl.reshape(tl.join(tl.join(byte & MASK, (byte >> 4) & MASK),
                                   tl.join((byte >> 2) & MASK, byte >> 6)), [R, NC])
    return codes


@triton.jit
def _additive_log2(bias):
    """Mask values as they were loaded, as an additive bias in log2 units: bool (True
    attends) as 0 / -inf, a float one (natural-log units) scaled by log2(e)."""
    if bias.dtype == tl.int1:
        return tl.where(bias, 0.0, float("-inf"))
    return bias.to(tl.float32) * 1.4426950408889634


@triton.jit
def _mask_block(bias_rows, tok, s_bias, m_valid, kv_hi, HAS_HI: tl.constexpr):
    """The mask values of tokens tok [N] for the block's rows (row pointers bias_rows, token
    stride s_bias), as loaded: [BLOCK_M, N]; nothing is read at or past a row's kv_hi
    (HAS_HI: a mask may end there) nor for an invalid row (0 there)."""
    ok = m_valid[:, None]
    if HAS_HI:
        ok = ok & (tok[None, :] < kv_hi[:, None])
    return tl.load(bias_rows[:, None] + tok[None, :].to(tl.int64) * s_bias, mask=ok, other=0)


@triton.jit
def _mask_scores(s, tok, m_valid, kv_lo, kv_hi, bias_rows, s_bias, HAS_BIAS: tl.constexpr,
                 HAS_LO: tl.constexpr, HAS_HI: tl.constexpr):
    """Scores s [BLOCK_M, N] (log2 units) of the tokens tok [N] under the loop's masks: the
    mask (row pointers bias_rows, token stride s_bias; HAS_BIAS): additive in natural-log
    units in any float dtype, or bool (True attends); -inf before kv_lo (HAS_LO) and from
    kv_hi on (HAS_HI), per row. HAS_BIAS == 2: every row reads one mask row (bias_rows: a
    scalar pointer; the caller reads only tokens the mask covers), loaded once."""
    if HAS_BIAS == 2:   # one mask row for every row of the block: bias_rows is its pointer
        s = s + _additive_log2(tl.load(bias_rows + tok.to(tl.int64) * s_bias))[None, :]
    elif HAS_BIAS:
        s = s + _additive_log2(_mask_block(bias_rows, tok, s_bias, m_valid, kv_hi, HAS_HI))
    if HAS_LO:
        s = tl.where(tok[None, :] >= kv_lo[:, None], s, float("-inf"))
    if HAS_HI:
        s = tl.where(tok[None, :] < kv_hi[:, None], s, float("-inf"))
    return s


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc):
    """One online-softmax update with scores s [BLOCK_M, G] in log2 units.

    Returns (p, m_new, l_new, acc rescaled). Safe when a whole row is -inf (masked): the
    reference point falls back to 0, so p = 0 and alpha = exp2(-inf) = 0, never NaN.
    """
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    return p, m_new, l_new, acc * alpha[:, None]


# ------------------------------------------------------------------------------------------
# The decode loop, shared by the standalone kernel and the decode template
# ------------------------------------------------------------------------------------------
@triton.jit
def _unpack_bytes_f16(byte, R: tl.constexpr, NC: tl.constexpr, BITS: tl.constexpr):
    """uint8 bytes [R, NC * BITS / 8] -> fp16 [R, NC] holding 1024 + code, exactly.

    The exponent-bias conversion: a 16-bit word 0x6400 | c is the fp16 number 1024 + c for
    any c < 1024 (0x6400 is 1024; c fills the low significand bits), so a code becomes an
    fp16 operand by two integer ops (mask, or) and a bitcast, without an int -> float
    conversion instruction. The 1024 * sum(a) it adds to a dot is removed by the caller
    (:func:`_packed_dot`)."""
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    x = byte.to(tl.int16)
    if PER == 1:
        w = x | 0x6400
    elif PER == 2:
        w = tl.reshape(tl.join((x & MASK) | 0x6400, (x >> 4) | 0x6400), [R, NC])
    else:
        w = tl.reshape(tl.join(tl.join((x & MASK) | 0x6400, ((x >> 4) & MASK) | 0x6400),
                               tl.join(((x >> 2) & MASK) | 0x6400, (x >> 6) | 0x6400)), [R, NC])
    return w.to(tl.float16, bitcast=True)


@triton.jit
def _packed_dot(a, byte, zero_terms, R: tl.constexpr, NC: tl.constexpr, BITS: tl.constexpr,
                INPUT_PRECISION: tl.constexpr):
    """a [M, R] @ codes [R, NC] + rowsum(zero_terms) [M, 1], codes unpacked from uint8 byte.

    "fp16": a rounded to fp16 (tf32's significand, fp16's range), codes as 1024 + code
    (:func:`_unpack_bytes_f16`), fp32 sums; the 1024 * rowsum(fp16(a)) this adds is taken
    off with the zero terms in the same reduction. "ieee" / "tf32": int -> fp32 codes (exact)
    and a dot at that precision.
    """
    if INPUT_PRECISION == "fp16":
        a_h = a.to(tl.float16)
        out = tl.dot(a_h, _unpack_bytes_f16(byte, R, NC, BITS), out_dtype=tl.float32)
        z = tl.sum(zero_terms - 1024.0 * a_h.to(tl.float32), axis=1)
    else:
        codes = _unpack_bytes(byte.to(tl.int32), R, NC, BITS).to(tl.float32)
        out = tl.dot(a, codes, input_precision=INPUT_PRECISION)
        z = tl.sum(zero_terms, axis=1)
    return out + z[:, None]


@triton.jit
def _frame_q(qr_rows, s_qrd, qp_rows, s_qpd, m_valid, plain, D: tl.constexpr,
             BLOCK_D: tl.constexpr, D0: tl.constexpr = 0):
    """The queries a K tile is scored with, with key frames (HAS_K_PLAIN), read for each
    tile: the rotated ones (fp32 rows ``qr_rows``, column stride ``s_qrd``) for a rotated
    tile, the un-rotated ones (``qp_rows``, ``s_qpd``) for a key frame (``plain`` != 0);
    fp32 [BLOCK_M, BLOCK_D]. One of the two, read where it is needed (an L1 hit after the
    first tile), instead of the rotated block held across the loop and the other loaded
    beside it: two fp32 blocks of registers (sm_90, the 16-row prompt block with a bool
    mask spilled 32 B with triton 3.9 and 200 B with 3.6, with 11 and 41 local loads per
    tile in the loop; docs/performance.md has what it does now). D0: the block's first
    channel (the phased loop takes the keys in parts)."""
    offs_d = D0 + tl.arange(0, BLOCK_D)
    ok = m_valid[:, None] & (offs_d < D)[None, :]
    if plain != 0:
        q_t = tl.load(qp_rows[:, None] + offs_d[None, :] * s_qpd, mask=ok, other=0.0)
        q_t = q_t.to(tl.float32)
    else:
        q_t = tl.load(qr_rows[:, None] + offs_d[None, :] * s_qrd, mask=ok, other=0.0)
        q_t = q_t.to(tl.float32)
    return q_t


@triton.jit
def _load_chunk(kc, krs, krz, kcs, vc, vrs, vrz, vcs, kp,
                s_kc, s_krs, s_krz, s_kcs, s_vc, s_vrs, s_vrz, s_vcs, s_kp, it, ok,
                D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                G: tl.constexpr, BLOCK_N: tl.constexpr,
                K_BITS: tl.constexpr, V_BITS: tl.constexpr, HAS_K_PLAIN: tl.constexpr):
    """Issue every load of chunk ``it``: tokens (it % CH) * BLOCK_N + [0, BLOCK_N) of tile
    it // CH (CH = G // BLOCK_N), K and V sides. ``ok`` (0/1 int) = 0 reads nothing (zeros).

    Returns (K bytes [BLOCK_D, BLOCK_N * K_BITS / 8], K rs [BLOCK_D], K rz [BLOCK_D], K cs
    [BLOCK_N], V bytes [BLOCK_N, BLOCK_DV * V_BITS / 8], V rs [BLOCK_N], V rz [BLOCK_N],
    V cs [BLOCK_DV], key frame flag), as stored (uint8 codes, scales in their dtype). Each
    row of codes is one contiguous run of bytes (16-byte vector loads). D / BLOCK_D: the
    keys' head dim; DV / BLOCK_DV: the values' (equal to D / BLOCK_D unless they differ)."""
    CH: tl.constexpr = G // BLOCK_N
    j = (it // CH).to(tl.int64)
    kbyte, k_rs, k_rz, k_cs, vbyte, v_rs, v_rz, v_cs = _load_tile_part(
        kc, krs, krz, kcs, vc, vrs, vrz, vcs, s_kc, s_krs, s_krz, s_kcs, s_vc, s_vrs, s_vrz,
        s_vcs, j, (it % CH) * BLOCK_N, ok, D, BLOCK_D, DV, BLOCK_DV, G, BLOCK_N, K_BITS, V_BITS)
    if HAS_K_PLAIN:
        plain = tl.load(kp + j * s_kp * ok).to(tl.int32) * ok
    else:
        plain = ok * 0
    return kbyte, k_rs, k_rz, k_cs, vbyte, v_rs, v_rz, v_cs, plain


@triton.jit
def _load_tile_part(kc, krs, krz, kcs, vc, vrs, vrz, vcs,
                    s_kc, s_krs, s_krz, s_kcs, s_vc, s_vrs, s_vrz, s_vcs, j, c0, ok,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr,
                    BLOCK_DV: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
                    K_BITS: tl.constexpr, V_BITS: tl.constexpr):
    """The loads of tokens c0 + [0, BLOCK_N) of tile j (int64), K and V sides, as stored
    (``_load_chunk``'s first eight results); ``ok`` = 0 reads nothing (zeros). Shared by the
    chunk loaders of ``kvarn::attention`` and ``kvarn::latent_attention``."""
    KPER: tl.constexpr = 8 // K_BITS
    K_ROW: tl.constexpr = G * K_BITS // 8
    V_ROW: tl.constexpr = DV * V_BITS // 8
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    offs_kb = tl.arange(0, BLOCK_N // KPER)
    offs_vb = tl.arange(0, BLOCK_DV * V_BITS // 8)
    d_ok = offs_d < D * ok
    dv_ok = offs_dv < DV * ok
    n_ok = offs_n < BLOCK_N * ok
    kbyte = tl.load(kc + j * s_kc + offs_d[:, None] * K_ROW + (c0 // KPER + offs_kb)[None, :],
                    mask=d_ok[:, None], other=0)
    k_rs = tl.load(krs + j * s_krs + offs_d, mask=d_ok, other=0.0)
    k_rz = tl.load(krz + j * s_krz + offs_d, mask=d_ok, other=0.0)
    k_cs = tl.load(kcs + j * s_kcs + c0 + offs_n, mask=n_ok, other=0.0)
    v_ptrs = vc + j * s_vc + (c0 + offs_n)[:, None] * V_ROW + offs_vb[None, :]
    if BLOCK_DV == DV:
        vbyte = tl.load(v_ptrs, mask=n_ok[:, None], other=0)
    else:
        vbyte = tl.load(v_ptrs, mask=n_ok[:, None] & (offs_vb < V_ROW)[None, :], other=0)
    v_rs = tl.load(vrs + j * s_vrs + c0 + offs_n, mask=n_ok, other=0.0)
    v_rz = tl.load(vrz + j * s_vrz + c0 + offs_n, mask=n_ok, other=0.0)
    v_cs = tl.load(vcs + j * s_vcs + offs_dv, mask=dv_ok, other=0.0)
    return kbyte, k_rs, k_rz, k_cs, vbyte, v_rs, v_rz, v_cs


# ------------------------------------------------------------------------------------------
# The phased fp16 decode loop: codes unpacked two at a time, straight into MMA registers
# ------------------------------------------------------------------------------------------
@triton.jit
def _rows_f16(pair, R2: tl.constexpr, NW: tl.constexpr):
    """int32 [R2, NW], each word two fp16 bit patterns (low half: row 2i, high half: row
    2i + 1) -> fp16 [2 * R2, NW] in row order. The join / permute / reshape only relabels
    registers: an MMA operand register holds two consecutive rows of its reduction dim, which
    is what each word already is (no instruction per code)."""
    x = tl.join(pair.to(tl.int16), (pair >> 16).to(tl.int16))     # [R2, NW, 2]
    x = tl.reshape(tl.permute(x, (0, 2, 1)), [2 * R2, NW])
    return x.to(tl.float16, bitcast=True)


#: Inline PTX where the kernels compile for an NVIDIA GPU (``kernels.use_inline_ptx``).
_PTX = tl.constexpr(use_inline_ptx())


@triton.jit
def _lop3_or_6400(x, M2: tl.constexpr):
    """(x & M2) | 0x64006400 on int32 words: one ``lop3`` (LUT 0xEA: (a & b) | c) with
    ``_PTX``. Written as two operations, ptxas kept them two (triton 3.6: 592 LOP3 per warp
    and tile of the decode kernel, against 336) or added register moves around them (3.9:
    ~250 MOV / IMAD.MOV). The mask goes in as an immediate ("n": a constant block)."""
    if _PTX:
        y = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, 0x64006400, 0xEA;", "=r,r,n",
                                      [x, tl.full(x.shape, M2, tl.int32)], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        y = (x & M2) | 0x64006400
    return y


@triton.jit
def _f16_in_loop(x):
    """x.to(fp16) (round to nearest even) where it is used: with ``_PTX`` one
    ``cvt.rn.f16x2.f32`` per two values that the compiler keeps in the loop (not pure). Of
    loop-invariant queries the plain conversion was hoisted out of the loop: their fp16
    copy then lived in registers across it (sm_90, triton 3.6: the k2v2 and k4v2 decode
    kernels spilled 16 and 32 B, the template 48 and 84 B), where in fp32 they stay in
    shared memory."""
    if _PTX:
        y = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x],
                                      dtype=tl.float16, is_pure=False, pack=2)
    else:
        y = x.to(tl.float16)
    return y


@triton.jit
def _phase_f16(t0, t1, k: tl.constexpr, BITS: tl.constexpr, R2: tl.constexpr, NW: tl.constexpr):
    """Phase k (0 <= k < PER = 8 // BITS) of paired 16-bit code words (t0 = even | odd << 16,
    t1 = t0 >> 8: the words' low and high bytes in the low byte of each half): the codes at
    position k of every byte, as fp16 [2 * R2, 2 * NW] holding 1024 + code * 2^(BITS * k)
    exactly; column b * NW + w is byte b of word w, i.e. code (16 // BITS) * w + b * PER + k
    of its row. One AND-OR per two codes: a code stays where it is in its byte (scaled by a
    power of two the caller takes off) and 0x6400 makes each half the fp16 number 1024 +
    its low bits."""
    MASK: tl.constexpr = ((1 << BITS) - 1) << (BITS * k)
    lo = _rows_f16(_lop3_or_6400(t0, MASK | (MASK << 16)), R2, NW)
    hi = _rows_f16(_lop3_or_6400(t1, MASK | (MASK << 16)), R2, NW)
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [2 * R2, 2 * NW])


@triton.jit
def _paired_words(ptr, row_e, row_o, row_words, w0, offs_w, ok_e, ok_o, ok_w):
    """Words w0 + offs_w of rows row_e / row_o (int16 pointer, rows of row_words words)
    loaded and paired: (t0 = even | odd << 16, t1 = t0 >> 8), int32 [len(row_e), len(offs_w)].
    Masked words read 0."""
    w = w0 + offs_w
    e = tl.load(ptr + row_e[:, None].to(tl.int64) * row_words + w[None, :],
                mask=ok_e[:, None] & ok_w[None, :], other=0).to(tl.int32)
    o = tl.load(ptr + row_o[:, None].to(tl.int64) * row_words + w[None, :],
                mask=ok_o[:, None] & ok_w[None, :], other=0).to(tl.int32)
    t0 = (e & 0xFFFF) | (o << 16)
    return t0, t0 >> 8


@triton.jit
def _tuple_max(xs, P: tl.constexpr):
    m = xs[0]
    for k in tl.static_range(1, P):
        m = tl.maximum(m, xs[k])
    return m


@triton.jit
def _tuple_sum(xs, P: tl.constexpr):
    m = xs[0]
    for k in tl.static_range(1, P):
        m = m + xs[k]
    return m


@triton.jit
def _interleave(xs, P: tl.constexpr, M: tl.constexpr, NW: tl.constexpr):
    """P tensors [M, NW] -> [M, NW * P] with column w * P + v = xs[v][:, w] (P in 1, 2, 4).
    join(a, b) appends a dim (0: a, 1: b), so the innermost join picks v's high bit."""
    if P == 1:
        out = xs[0]
    elif P == 2:
        out = tl.reshape(tl.join(xs[0], xs[1]), [M, NW * 2])
    else:
        tl.static_assert(P == 4, "phases per byte: 1, 2 or 4")
        out = tl.reshape(tl.join(tl.join(xs[0], xs[2]), tl.join(xs[1], xs[3])), [M, NW * 4])
    return out


@triton.jit
def _phase_columns(n, k: tl.constexpr, BITS: tl.constexpr, NW: tl.constexpr):
    """The code index (within its row) of column n of phase k (``_phase_f16``): byte
    n // NW of word n % NW, position k."""
    return (16 // BITS) * (n % NW) + (n // NW) * (8 // BITS) + k


@triton.jit
def _phase_split(x, M: tl.constexpr, BITS: tl.constexpr, NW: tl.constexpr):
    """x [M, NW * 16 // BITS] in token order -> the K phases' columns (``_phase_columns``):
    a tuple of PER = 8 // BITS tensors [M, 2 * NW], phase k's column b * NW + w being token
    (16 // BITS) * w + b * PER + k. Only relabels and regroups registers (a layout change at
    most): a chunk's mask row is loaded once in token order, contiguous, and split here."""
    PER: tl.constexpr = 8 // BITS
    x = tl.reshape(tl.permute(tl.reshape(x, [M, NW, 2, PER]), (0, 2, 1, 3)), [M, 2 * NW, PER])
    if PER == 1:
        out = (tl.reshape(x, [M, 2 * NW]),)
    elif PER == 2:
        a, b = tl.split(x)
        out = (a, b)
    else:
        tl.static_assert(PER == 4, "phases per byte: 1, 2 or 4")
        lo, hi = tl.split(tl.reshape(x, [M, 2 * NW, 2, 2]))   # k = 2 * k1 + k0: k0 0 / 1
        a, c = tl.split(lo)
        b, d = tl.split(hi)
        out = (a, b, c, d)
    return out


@triton.jit
def _scale_phases(ptr, ok, BLOCK_N: tl.constexpr, BITS: tl.constexpr, NW: tl.constexpr,
                  N: tl.constexpr = 0):
    """BLOCK_N consecutive scales at ptr (the first N, or all; 0 where ok = 0) split into
    the phases of BITS-bit codes (``_phase_split``): a tuple of 8 // BITS tensors [2 * NW].
    One contiguous load, where a phase's own columns are a gather: with 2-bit codes a
    phase's 32 tokens lie 4 apart, and each thread loaded 16 scales a chunk one 2-byte load
    at a time (sm_90, triton 3.9: 64 such loads per tile of the k2v2 decode kernel)."""
    offs = tl.arange(0, BLOCK_N)
    row = tl.load(ptr + offs, mask=offs < (N if N > 0 else BLOCK_N) * ok, other=0.0)
    parts = _phase_split(tl.reshape(row, [1, BLOCK_N]), 1, BITS, NW)
    out = ()
    for k in tl.static_range(8 // BITS):
        out = out + (tl.reshape(parts[k], [2 * NW]),)
    return out


@triton.jit
def _token_bits(vals, M: tl.constexpr, BITS: tl.constexpr, NW: tl.constexpr):
    """bool [M, NW * 16 // BITS] in token order -> int32 [M, NW]: bit i of word w is token
    (16 // BITS) * w + i."""
    WB: tl.constexpr = 16 // BITS
    x = tl.reshape(vals.to(tl.int32), [M, NW, WB])
    return tl.sum(x << tl.arange(0, WB)[None, None, :], axis=2)


@triton.jit
def _phase_bits(bits, k: tl.constexpr, BITS: tl.constexpr, NW: tl.constexpr):
    """Phase k's columns (``_phase_columns``) of token bits (``_token_bits``): int32
    [M, 2 * NW], 0 / 1."""
    PER: tl.constexpr = 8 // BITS
    x = tl.join((bits >> k) & 1, (bits >> (PER + k)) & 1)
    return tl.reshape(tl.permute(x, (0, 2, 1)), [bits.shape[0], 2 * NW])


@triton.jit
def _load_k_phased(kc, krs, krz, kcs, kp, s_kc, s_krs, s_krz, s_kcs, s_kp, it, ok,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, G: tl.constexpr,
                   BLOCK_N: tl.constexpr, K_BITS: tl.constexpr, HAS_K_PLAIN: tl.constexpr,
                   NPARTS: tl.constexpr, PW: tl.constexpr, PL: tl.constexpr,
                   WORD_PARTS: tl.constexpr = 0):
    """The K loads of chunk ``it`` for the phased loop (``ok`` = 0 reads zeros): the code
    words of channel pairs (``_paired_words``), the channel scales and zeros (a tuple of
    NPARTS each: the channels in one block, or in the parts ``_decode_range_phased``
    takes: PW channels each, the last PL), per K phase its tokens' scales, the key-frame
    flag. WORD_PARTS > 0: the words of the first WORD_PARTS parts only (the caller loads the
    others where it uses them)."""
    CH: tl.constexpr = G // BLOCK_N
    KPER: tl.constexpr = 8 // K_BITS
    NKW: tl.constexpr = BLOCK_N * K_BITS // 16    # words per K row in a chunk
    j = (it // CH).to(tl.int64)
    c0 = (it % CH) * BLOCK_N
    offs_n = tl.arange(0, 2 * NKW)
    offs_w = tl.arange(0, NKW)
    k_t0 = ()
    k_t1 = ()
    k_rs = ()
    k_rz = ()
    NP: tl.constexpr = NPARTS
    for p in tl.static_range(NP):
        offs_h = p * (PW // 2) + tl.arange(0, (PW if p < NP - 1 else PL) // 2)
        offs_d = p * PW + tl.arange(0, PW if p < NP - 1 else PL)
        if WORD_PARTS == 0 or p < WORD_PARTS:
            t0, t1 = _paired_words((kc + j * s_kc).to(tl.pointer_type(tl.int16)), 2 * offs_h,
                                   2 * offs_h + 1, G * K_BITS // 16, c0 // (16 // K_BITS),
                                   offs_w, 2 * offs_h < D * ok, 2 * offs_h + 1 < D * ok,
                                   offs_w < NKW)
            k_t0 = k_t0 + (t0,)
            k_t1 = k_t1 + (t1,)
        d_ok = offs_d < D * ok
        k_rs = k_rs + (tl.load(krs + j * s_krs + offs_d, mask=d_ok, other=0.0),)
        k_rz = k_rz + (tl.load(krz + j * s_krz + offs_d, mask=d_ok, other=0.0),)
    n_ok = offs_n < 2 * NKW * ok
    k_cs = ()
    if K_BITS == 2:
        # the chunk's scales in one load, split per phase (with 4-bit keys, 2 phases, the
        # gathers issue fewer instructions: sm_90, triton 3.6, the template 1,681 a tile
        # against 1,715 and 8 B of spills)
        k_cs = _scale_phases(kcs + j * s_kcs + c0, ok, BLOCK_N, K_BITS, NKW)
    else:
        for k in tl.static_range(KPER):
            tok = c0 + _phase_columns(offs_n, k, K_BITS, NKW)
            k_cs = k_cs + (tl.load(kcs + j * s_kcs + tok, mask=n_ok, other=0.0),)
    if HAS_K_PLAIN:
        plain = tl.load(kp + j * s_kp * ok).to(tl.int32) * ok
    else:
        plain = ok * 0
    return k_t0, k_t1, k_rs, k_rz, k_cs, plain


@triton.jit
def _load_v_phased(vc, vrs, vrz, vcs, s_vc, s_vrs, s_vrz, s_vcs, it, ok,
                   DV: tl.constexpr, BLOCK_DV: tl.constexpr, G: tl.constexpr,
                   BLOCK_N: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr):
    """The V loads of chunk ``it`` for the phased loop (``ok`` = 0 reads zeros): per K phase
    the paired code words of its tokens (rows) and their scales and zeros; per V phase its
    channels' scales."""
    CH: tl.constexpr = G // BLOCK_N
    KPER: tl.constexpr = 8 // K_BITS
    VPER: tl.constexpr = 8 // V_BITS
    NKW: tl.constexpr = BLOCK_N * K_BITS // 16
    NVW: tl.constexpr = BLOCK_DV * V_BITS // 16   # words per V row, padded
    NK: tl.constexpr = 2 * NKW
    j = (it // CH).to(tl.int64)
    c0 = (it % CH) * BLOCK_N
    offs_n = tl.arange(0, NK)
    offs_i = tl.arange(0, NK // 2)
    offs_c = tl.arange(0, 2 * NVW)
    offs_w = tl.arange(0, NVW)
    vw = (vc + j * s_vc).to(tl.pointer_type(tl.int16))
    n_ok = offs_n < NK * ok
    i_ok = offs_i < (NK // 2) * ok
    v_rs = ()
    v_rz = ()
    v_t0 = ()
    v_t1 = ()
    if K_BITS == 2:     # (as the keys' column scales)
        v_rs = _scale_phases(vrs + j * s_vrs + c0, ok, BLOCK_N, K_BITS, NKW)
        v_rz = _scale_phases(vrz + j * s_vrz + c0, ok, BLOCK_N, K_BITS, NKW)
    else:
        for k in tl.static_range(KPER):
            tok = c0 + _phase_columns(offs_n, k, K_BITS, NKW)
            v_rs = v_rs + (tl.load(vrs + j * s_vrs + tok, mask=n_ok, other=0.0),)
            v_rz = v_rz + (tl.load(vrz + j * s_vrz + tok, mask=n_ok, other=0.0),)
    for k in tl.static_range(KPER):
        t0, t1 = _paired_words(vw, c0 + _phase_columns(2 * offs_i, k, K_BITS, NKW),
                               c0 + _phase_columns(2 * offs_i + 1, k, K_BITS, NKW),
                               DV * V_BITS // 16, 0, offs_w, i_ok, i_ok,
                               offs_w < DV * V_BITS // 16)
        v_t0 = v_t0 + (t0,)
        v_t1 = v_t1 + (t1,)
    v_cs = ()
    if V_BITS == 2:     # (4 phases: as the keys' 2-bit column scales)
        v_cs = _scale_phases(vcs + j * s_vcs, ok, BLOCK_DV, V_BITS, NVW, DV)
    else:
        for v in tl.static_range(VPER):
            ch = _phase_columns(offs_c, v, V_BITS, NVW)
            v_cs = v_cs + (tl.load(vcs + j * s_vcs + ch, mask=ch < DV * ok, other=0.0),)
    return v_t0, v_t1, v_rs, v_rz, v_cs


@triton.jit
def _chunk_at(i, gap_at, gap, GAP: tl.constexpr):
    """The chunk step i reads: i, or i + gap from step gap_at on (GAP: a range with a gap)."""
    if GAP:
        i = i + tl.where(i >= gap_at, gap, 0)
    return i


@triton.jit
def _steps_phased(qs, m_i, l_i, accs, qr_rows, s_qrd, qp_rows, s_qpd,
                  kc, krs, krz, kcs, vc, vrs, vrz, vcs, kp,
                  s_kc, s_krs, s_krz, s_kcs, s_vc, s_vrs, s_vrz, s_vcs, s_kp,
                  it0, it1, gap_at, gap, m_valid, kv_lo, kv_hi, bias_rows, s_bias, qk_rows,
                  q_div, BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  G: tl.constexpr, BLOCK_N: tl.constexpr, K_BITS: tl.constexpr,
                  V_BITS: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
                  GAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_K_PLAIN: tl.constexpr,
                  PREFETCH: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                  MASK_BITS: tl.constexpr, NP: tl.constexpr, PW: tl.constexpr,
                  PL: tl.constexpr, Q_ROWS: tl.constexpr, F16_Q: tl.constexpr):
    """Steps [it0, it1) of ``_decode_range_phased`` (a step: the BLOCK_N tokens of a tile's
    chunk, chunk c = tile * G // BLOCK_N + its index in the tile) from the online-softmax
    state (m_i, l_i, accs), the queries in their parts (qs; Q_ROWS or key frames: read per
    step from their rows); returns that state. qk_rows: the rows' softmax scale (log2
    units); F16_Q: fp16 score operands, the rows read per step times q_div first
    (``_decode_range_phased``). The keys come in NP parts of PW channels,
    the last of PL. GAP: step i >= gap_at reads chunk i + gap (the edge tiles around a
    range run apart). LATE (keys in parts, no prefetch): a step loads each later part's
    code words after the matmuls of the parts before it, so it holds one part's at a time
    (sm_90, D = 256 at 2 warps: 88 -> 40 B of spills in the kernel with triton 3.9, 656 ->
    128 B with 3.6)."""
    CH: tl.constexpr = G // BLOCK_N
    KPER: tl.constexpr = 8 // K_BITS
    VPER: tl.constexpr = 8 // V_BITS
    NKW: tl.constexpr = BLOCK_N * K_BITS // 16
    NVW: tl.constexpr = BLOCK_DV * V_BITS // 16
    NK: tl.constexpr = 2 * NKW
    NV: tl.constexpr = 2 * NVW
    offs_n = tl.arange(0, NK)
    LATE: tl.constexpr = NP > 1 and not PREFETCH
    if PREFETCH:
        first = _chunk_at(it0, gap_at, gap, GAP)
        k_nxt = _load_k_phased(kc, krs, krz, kcs, kp, s_kc, s_krs, s_krz, s_kcs, s_kp, first,
                               (it0 < it1).to(tl.int32), D, BLOCK_D, G, BLOCK_N, K_BITS,
                               HAS_K_PLAIN, NP, PW, PL)
        v_nxt = _load_v_phased(vc, vrs, vrz, vcs, s_vc, s_vrs, s_vrz, s_vcs, first,
                               (it0 < it1).to(tl.int32), DV, BLOCK_DV, G, BLOCK_N, K_BITS,
                               V_BITS)
    for it in range(it0, it1):
        c = _chunk_at(it, gap_at, gap, GAP)         # the chunk this step reads
        # c again (it < it1), as the loads took it before the gap: written as c, ptxas
        # allocated the loops otherwise (sm_90, 3.9 and 3.6: 4-330 B more spills)
        cur = _chunk_at(tl.minimum(it, it1 - 1), gap_at, gap, GAP)
        if PREFETCH:
            k_cur = k_nxt
            v_cur = v_nxt
            # the next chunk's loads first (the last chunk reloads itself: never out of range)
            nxt = _chunk_at(tl.minimum(it + 1, it1 - 1), gap_at, gap, GAP)
            k_nxt = _load_k_phased(kc, krs, krz, kcs, kp, s_kc, s_krs, s_krz, s_kcs, s_kp,
                                   nxt, (it < it1).to(tl.int32), D,
                                   BLOCK_D, G, BLOCK_N, K_BITS, HAS_K_PLAIN, NP, PW, PL)
            v_nxt = _load_v_phased(vc, vrs, vrz, vcs, s_vc, s_vrs, s_vrz, s_vcs,
                                   nxt, (it < it1).to(tl.int32), DV,
                                   BLOCK_DV, G, BLOCK_N, K_BITS, V_BITS)
        else:
            # the later parts' words are loaded where their matmuls use them (LATE)
            k_cur = _load_k_phased(kc, krs, krz, kcs, kp, s_kc, s_krs, s_krz, s_kcs, s_kp,
                                   cur, (it < it1).to(tl.int32), D,
                                   BLOCK_D, G, BLOCK_N, K_BITS, HAS_K_PLAIN, NP, PW, PL,
                                   1 if LATE else 0)
        k_t0, k_t1, k_rs, k_rz, k_cs, plain = k_cur
        # every code comes as 1024 + code * 2^s: the matmul starts from a @ (-1024), the
        # same products, so the fp32 accumulator cancels the 1024s exactly as it adds them
        aa = ()
        for p in tl.static_range(NP):
            if HAS_K_PLAIN or Q_ROWS:
                q_t = _frame_q(qr_rows, s_qrd, qp_rows, s_qpd, m_valid, plain, D,
                               PW if p < NP - 1 else PL, p * PW)
                if F16_Q:
                    q_t = tl.where(m_valid[:, None], q_t * q_div[:, None], 0.0)
            else:
                q_t = qs[p]
            if F16_Q:
                a = _f16_in_loop(q_t) * k_rs[p][None, :]
            else:
                a = (q_t * k_rs[p].to(tl.float32)[None, :]).to(tl.float16)
            minus = tl.full([PW if p < NP - 1 else PL, NK], -1024.0, tl.float16)
            if p == 0:
                bias_k = tl.dot(a, minus, out_dtype=tl.float32)
                z_k = tl.sum(q_t * k_rz[p].to(tl.float32)[None, :], axis=1)   # zero points' term
            else:
                bias_k = tl.dot(a, minus, bias_k, out_dtype=tl.float32)
                z_k = z_k + tl.sum(q_t * k_rz[p].to(tl.float32)[None, :], axis=1)
            aa = aa + (a,)
        if HAS_BIAS == 1:
            # a mask row per query row: the chunk's BLOCK_N values in token order, one
            # contiguous load per row, then split into the phases' columns
            vals = _mask_block(bias_rows, c * BLOCK_N + tl.arange(0, BLOCK_N), s_bias,
                               m_valid, kv_hi, HAS_HI)
            if vals.dtype == tl.int1 and MASK_BITS:
                bits = _token_bits(vals, BLOCK_M, K_BITS, NKW)
            else:
                bias_ph = _phase_split(vals, BLOCK_M, K_BITS, NKW)
        if LATE:    # part by part, each part's words loaded where its matmuls use them
            raws = ()
            for k in tl.static_range(KPER):
                raws = raws + (bias_k,)
            for p in tl.static_range(NP):
                if p == 0:
                    t0 = k_t0[0]
                    t1 = k_t1[0]
                else:       # a later part's words, as _load_k_phased loads the first's
                    ok = (it < it1).to(tl.int32)
                    h2 = p * (PW // 2) + tl.arange(0, (PW if p < NP - 1 else PL) // 2)
                    t0, t1 = _paired_words(
                        (kc + (cur // CH).to(tl.int64) * s_kc).to(tl.pointer_type(tl.int16)),
                        2 * h2, 2 * h2 + 1, G * K_BITS // 16, (cur % CH) * NKW,
                        tl.arange(0, NKW), 2 * h2 < D * ok, 2 * h2 + 1 < D * ok,
                        tl.arange(0, NKW) < NKW)
                new_raws = ()
                for k in tl.static_range(KPER):
                    new_raws = new_raws + (tl.dot(aa[p], _phase_f16(
                        t0, t1, k, K_BITS, (PW if p < NP - 1 else PL) // 2, NKW),
                        raws[k], out_dtype=tl.float32),)
                raws = new_raws
        ss = ()
        z_s = (z_k * qk_rows)[:, None]      # (one layout conversion for every phase)
        for k in tl.static_range(KPER):
            SH = 1.0 / (1 << (K_BITS * k))
            if LATE:
                raw = raws[k]
            else:       # phase by phase (one part, or both parts' words loaded)
                raw = bias_k
                for p in tl.static_range(NP):
                    raw = tl.dot(aa[p], _phase_f16(k_t0[p], k_t1[p], k, K_BITS,
                                                   (PW if p < NP - 1 else PL) // 2, NKW), raw,
                                 out_dtype=tl.float32)
            s = (raw * (qk_rows * SH)[:, None] + z_s) * k_cs[k].to(tl.float32)[None, :]
            tok = c * BLOCK_N + _phase_columns(offs_n, k, K_BITS, NKW)
            if HAS_BIAS == 1:       # (loaded above; _mask_scores applies the bounds)
                if vals.dtype == tl.int1 and MASK_BITS:
                    s = tl.where(_phase_bits(bits, k, K_BITS, NKW) != 0, s, float("-inf"))
                else:
                    s = s + _additive_log2(bias_ph[k])
            ss = ss + (_mask_scores(s, tok, m_valid, kv_lo, kv_hi, bias_rows, s_bias,
                                    0 if HAS_BIAS == 1 else HAS_BIAS, HAS_LO, HAS_HI),)
        m_new = tl.maximum(m_i, tl.max(_tuple_max(ss, KPER), axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        ps = ()
        for k in tl.static_range(KPER):
            ps = ps + (tl.exp2(ss[k] - m_ref[:, None]),)
        l_i = l_i * alpha + tl.sum(_tuple_sum(ps, KPER), axis=1)
        m_i = m_new
        # per K phase: its probabilities times the V rows of its tokens. Without PREFETCH
        # they are loaded only now: issued with the K loads, their words live across the
        # score matmuls (sm_90, triton 3.6: the template then spills 60 B, the kernel not)
        if not PREFETCH:
            v_cur = _load_v_phased(vc, vrs, vrz, vcs, s_vc, s_vrs, s_vrz, s_vcs,
                                   cur, (it < it1).to(tl.int32), DV,
                                   BLOCK_DV, G, BLOCK_N, K_BITS, V_BITS)
        v_t0, v_t1, v_rs, v_rz, v_cs = v_cur
        pas = ()
        bias_v = tl.zeros([BLOCK_M, NV], dtype=tl.float32)   # the -1024s, as for the scores
        for k in tl.static_range(KPER):
            pa = (ps[k] * v_rs[k].to(tl.float32)[None, :]).to(tl.float16)
            bias_v = tl.dot(pa, tl.full([NK, NV], -1024.0, tl.float16), bias_v,
                            out_dtype=tl.float32)
            # the zero points' term: one reduction for every phase, or (a prompt's blocks)
            # one a phase, which holds no [BLOCK_M, NK] sum across them (sm_90, triton 3.9:
            # the fp32-mask prompt template then keeps its loop in registers, 12 B of
            # spills where the one reduction gave 36 B and 5 local loads and stores a tile)
            if Q_ROWS:
                if k == 0:
                    z_v = tl.sum(ps[k] * v_rz[k].to(tl.float32)[None, :], axis=1)
                else:
                    z_v += tl.sum(ps[k] * v_rz[k].to(tl.float32)[None, :], axis=1)
            elif k == 0:
                pz = ps[k] * v_rz[k].to(tl.float32)[None, :]
            else:
                pz += ps[k] * v_rz[k].to(tl.float32)[None, :]
            pas = pas + (pa,)
        if not Q_ROWS:
            z_v = tl.sum(pz, axis=1)
        new_accs = ()
        for v in tl.static_range(VPER):
            SV = 1.0 / (1 << (V_BITS * v))
            raw = bias_v
            for k in tl.static_range(KPER):
                raw = tl.dot(pas[k], _phase_f16(v_t0[k], v_t1[k], v, V_BITS, NK // 2, NVW), raw,
                             out_dtype=tl.float32)
            cs = v_cs[v].to(tl.float32)
            new_accs = new_accs + (accs[v] * alpha[:, None]
                                   + (raw * SV + z_v[:, None]) * cs[None, :],)
        accs = new_accs
    return m_i, l_i, accs


@triton.jit
def _decode_range_phased(q, qr_rows, s_qrd, qp_rows, s_qpd,
                         kc, krs, krz, kcs, vc, vrs, vrz, vcs, kp,
                         s_kc, s_krs, s_krz, s_kcs, s_vc, s_vrs, s_vrz, s_vcs, s_kp,
                         start, end, m_valid, kv_lo, kv_hi, bias_rows, s_bias, qk_scale,
                         BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         G: tl.constexpr, BLOCK_N: tl.constexpr, K_BITS: tl.constexpr,
                         V_BITS: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_K_PLAIN: tl.constexpr,
                         PREFETCH: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                         MASK_BITS: tl.constexpr = True, KEY_PART: tl.constexpr = 0):
    """``_decode_range`` with fp16 code operands, codes unpacked two per instruction.

    The packed layouts stay as stored; the loop reads them as 16-bit words and regroups the
    matmuls instead of the codes. A K row (one channel) holds 16 / K_BITS tokens per word;
    the score matmul is split into KPER = 8 / K_BITS phases, phase k scoring the tokens at
    position k of each byte (``_phase_columns``), with the words of channels 2i and 2i + 1
    side by side in one 32-bit register (``_paired_words``): an MMA operand register holds
    two consecutive rows of the reduction dim, so a phase's operand register is one AND-OR
    of that pair (``_phase_f16``). The value matmul reduces over tokens: per K phase, its
    probabilities [BLOCK_M, NK] against the V rows of that phase's tokens (paired the same
    way), split into VPER = 8 / V_BITS phases of channels, one accumulator each, put back
    in channel order at the end. Every code is 1024 + code * 2^s in fp16 (exact); the
    1024 * rowsum of the other operand and the 2^s are taken off in fp32. A head dim
    between two powers of two (D = 192) is scored in two parts (128 + 64), and one past 128
    (256) in two of 128, each later part's words loaded after the matmuls of the parts
    before it, the queries read from their rows (``qr_rows``) in the same parts. Scores, masks and
    the online softmax are those of ``_decode_range_bytes``. A bool mask row is held as one
    bit per token (``_token_bits``) with MASK_BITS, else as its values split per phase like
    a float one: each is what keeps its caller's loop in registers on sm_90 (bits: the
    template's prompt block; values: the one-launch op's; docs/performance.md). With
    per-row bounds (HAS_LO / HAS_HI), the tiles every valid row sees whole run in a loop of
    their own without them, after the edge tiles (``_steps_phased``). KEY_PART > 0 (a
    prompt's blocks, whose masks and bounds leave the loop fewer registers: ``key_part``):
    the keys in parts of at most KEY_PART channels, a power-of-two head dim as well, the
    queries read per step from their rows (sm_90, triton 3.9, the template's 16-row block:
    D = 128 in parts of 32 spills 0 B with a bool mask where in one part it spilled 16 B
    with one reload a tile, 4 B with an fp32 one where 84 B, 8 a tile; 3.6: 12 B where
    352 B, 46 a tile; D = 192 in parts of 64 0 B where 104 B, 8 a tile; 3.6: 40 B, none in
    the loops, where 104 B, 6 a tile).

    The scores' fp16 operand is q * k_rs. With fp16 key scales (F16_Q; not where the
    queries are read per step in parts) it is formed in fp16 arithmetic, fp16(q / f) * k_rs (``_f16_in_loop``: a
    conversion per two values and one multiply, where fp32 took a conversion of each scale,
    two multiplies and a pack), f a power of two per row with f >= |q| / 2^15: every
    |q_i| <= |q| (and a key frame's plain row has its rotated row's norm), so q / f is
    finite in fp16 whatever the queries' range, and f goes back with the softmax scale
    (``qk_rows``). That is two roundings where fp16(q * k_rs) had one. Key scales in bf16 or
    fp32 (past the fp16 range) keep the fp32 product.
    """
    CH: tl.constexpr = G // BLOCK_N
    VPER: tl.constexpr = 8 // V_BITS
    NVW: tl.constexpr = BLOCK_DV * V_BITS // 16
    NV: tl.constexpr = 2 * NVW
    # keys of a head dim between two powers of two (D = 192 in a 256 block) in two parts,
    # each a power of two (128 + 64): no padded channels in registers or matmuls; and of a
    # head dim past 128 (256 = 128 + 128), so that a step holds one part's code words at a
    # time (``_steps_phased``: LATE). The queries then come in the same parts, from their
    # rows (qr_rows)
    DPB: tl.constexpr = D - BLOCK_D // 2
    PARTS: tl.constexpr = (BLOCK_D != D or BLOCK_D > 128 or KEY_PART > 0) and (
        DPB == 16 or DPB == 32 or DPB == 64 or DPB == 128)
    # the parts' width PW (the last part PL, the rest): half the block, at most KEY_PART
    # channels in a prompt's blocks (``key_part``), a step holding one part's words and
    # queries at a time
    PW: tl.constexpr = BLOCK_D if not PARTS else min(BLOCK_D // 2, KEY_PART) if KEY_PART > 0 \
        else BLOCK_D // 2
    NP: tl.constexpr = (D + PW - 1) // PW if PARTS else 1
    PL: tl.constexpr = D - (NP - 1) * PW if PARTS else BLOCK_D
    # a prompt's blocks read the queries per step (``_frame_q``), as key frames do, instead
    # of holding them across the loop (sm_90, D = 192 template, triton 3.9: 16 B -> 0 B)
    Q_ROWS: tl.constexpr = KEY_PART > 0 and NP > 1
    NQ: tl.constexpr = 1 if NP == 1 or Q_ROWS or HAS_K_PLAIN else NP    # blocks in qs
    if NQ == 1:
        qs = (q,)
    else:
        qs = ()
        for p in tl.static_range(NP):
            offs_q = p * PW + tl.arange(0, PW if p < NP - 1 else PL)
            q_p = tl.load(qr_rows[:, None] + offs_q[None, :] * s_qrd,
                          mask=m_valid[:, None] & (offs_q < D)[None, :], other=0.0)
            qs = qs + (q_p.to(tl.float32),)
    # fp16 key scales: the score operand fp16(q / f) * k_rs in fp16 (see above); q_div =
    # 1 / f for the rows read per step (key frames), the held ones divided here. Rows out
    # of the block stay zeros the compiler can see (sm_90: 1,364 instructions a tile of
    # the k2v2 decode kernel with triton 3.9, 1,484 with q / f on every row). Not for rows
    # read per step in parts (key frames at D = 192: the one-launch op reloaded 2 values a
    # tile, 1,726 instructions and 52 B against 1,779 and 40 B with the fp32 product)
    F16_Q: tl.constexpr = not Q_ROWS and not (HAS_K_PLAIN and NP > 1) \
        and krs.dtype.element_ty == tl.float16
    qk_rows = tl.full([BLOCK_M], 1.0, tl.float32) * qk_scale
    q_div = tl.full([BLOCK_M], 1.0, tl.float32)
    if F16_Q:
        nrm2 = tl.sum(qs[0] * qs[0], axis=1)
        for p in tl.static_range(1, NQ):
            nrm2 += tl.sum(qs[p] * qs[p], axis=1)
        f = tl.exp2(tl.maximum(tl.ceil(0.5 * tl.log2(tl.maximum(nrm2, 1.0))) - 15.0, 0.0))
        qk_rows = qk_rows * f
        q_div = 1.0 / f
        q_sc = ()
        for p in tl.static_range(NQ):
            q_sc = q_sc + (tl.where(m_valid[:, None], qs[p] * (1.0 / f)[:, None], 0.0),)
        qs = q_sc
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    accs = ()
    for v in tl.static_range(VPER):
        accs = accs + (tl.zeros([BLOCK_M, NV], dtype=tl.float32),)
    it0 = start * CH
    it1 = end * CH
    if HAS_LO or HAS_HI:
        # every valid row of the block sees tiles [lo, hi) whole: their steps run without the
        # bounds (sm_90: 4-22% fewer instructions a tile), after the edge tiles [start, lo)
        # and [hi, end) with them (first: their values are dead in the long loop)
        lo = start
        hi = end
        if HAS_LO:
            lo = tl.cdiv(tl.max(tl.where(m_valid, kv_lo, 0), axis=0), G)
        if HAS_HI:
            hi = tl.min(tl.where(m_valid, kv_hi, 2147483647), axis=0) // G
        lo = tl.minimum(tl.maximum(lo, start), end)
        hi = tl.minimum(tl.maximum(hi, lo), end)
        m_i, l_i, accs = _steps_phased(
            qs, m_i, l_i, accs, qr_rows, s_qrd, qp_rows, s_qpd, kc, krs, krz, kcs, vc, vrs,
            vrz, vcs, kp, s_kc, s_krs, s_krz, s_kcs, s_vc, s_vrs, s_vrz, s_vcs, s_kp,
            it0, (lo + end - hi) * CH, lo * CH, (hi - lo) * CH, m_valid, kv_lo, kv_hi,
            bias_rows, s_bias, qk_rows, q_div, BLOCK_M, D, BLOCK_D, G, BLOCK_N, K_BITS, V_BITS,
            HAS_LO, HAS_HI, True, HAS_BIAS, HAS_K_PLAIN, PREFETCH, DV, BLOCK_DV, MASK_BITS,
            NP, PW, PL, Q_ROWS, F16_Q)
        it0 = lo * CH
        it1 = hi * CH
    m_i, l_i, accs = _steps_phased(
        qs, m_i, l_i, accs, qr_rows, s_qrd, qp_rows, s_qpd, kc, krs, krz, kcs, vc, vrs, vrz,
        vcs, kp, s_kc, s_krs, s_krz, s_kcs, s_vc, s_vrs, s_vrz, s_vcs, s_kp,
        it0, it1, 0, 0, m_valid, kv_lo, kv_hi, bias_rows, s_bias, qk_rows, q_div, BLOCK_M, D,
        BLOCK_D, G, BLOCK_N, K_BITS, V_BITS, False, False, False, HAS_BIAS, HAS_K_PLAIN,
        PREFETCH, DV, BLOCK_DV, MASK_BITS, NP, PW, PL, Q_ROWS, F16_Q)
    # [M, NV * VPER] (column n * VPER + v) -> channel order: n = b * NVW + w, channel
    # (16 // V_BITS) * w + b * VPER + v
    out = tl.reshape(_interleave(accs, VPER, BLOCK_M, NV), [BLOCK_M, 2, NVW, VPER])
    return m_i, l_i, tl.reshape(tl.permute(out, (0, 2, 1, 3)), [BLOCK_M, BLOCK_DV])


@triton.jit
def _decode_range_bytes(q, qr_rows, s_qrd, qp_rows, s_qpd,
                        kc, krs, krz, kcs, vc, vrs, vrz, vcs, kp,
                        s_kc, s_krs, s_krz, s_kcs, s_vc, s_vrs, s_vrz, s_vcs, s_kp,
                        start, end, m_valid, kv_lo, kv_hi, bias_rows, s_bias, qk_scale,
                        BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        G: tl.constexpr, BLOCK_N: tl.constexpr, K_BITS: tl.constexpr,
                        V_BITS: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
                        HAS_BIAS: tl.constexpr, HAS_K_PLAIN: tl.constexpr,
                        INPUT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
                        DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Online-softmax attention of the query block q [BLOCK_M, BLOCK_D] (rotated, fp32) over
    packed tiles [start, end) of one (batch row, kv head): returns (m, l, acc) in log2 units,
    acc [BLOCK_M, BLOCK_DV]. D / BLOCK_D: the keys' (and queries') head dim, padded;
    DV / BLOCK_DV: the values' (and the output's), padded (DV = D but for MLA-style caches).

    The per-tile pointers (kc .. vcs, kp) address tile 0 of this (batch row, kv head); s_*
    are their tile strides. The range is walked BLOCK_N tokens ("a chunk") at a time, and
    with PREFETCH the loads of chunk i + 1 are issued before chunk i is computed, so they
    are in flight during its two dots and its softmax (register double buffering; Triton
    does not pipeline loads that feed in-register unpacking by itself). Per chunk, with the
    dual-scale fold of the module doc::

        s   = qk_scale * cs_k * ((q * rs_k) @ code_k + rowsum(q * rz_k))
        acc = acc * alpha + cs_v * ((p * rs_v) @ code_v + rowsum(p * rz_v))

    Masks: query row m sees token t (= tile * G + offset) when kv_lo[m] <= t (HAS_LO) and
    t < kv_hi[m] (HAS_HI); HAS_BIAS adds bias_rows[m] + t * s_bias (natural-log units) to
    the score. HAS_K_PLAIN: a tile whose kp flag is 1 is scored with the un-rotated queries
    (rows ``qp_rows``, column stride ``s_qpd``), any other with the rotated ones read again
    from theirs (``qr_rows``, ``s_qrd``: q's values in memory), per tile (``_frame_q``).
    """
    CH: tl.constexpr = G // BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    it0 = start * CH
    it1 = end * CH
    if PREFETCH:
        kbyte, k_rs, k_rz, k_cs, vbyte, v_rs, v_rz, v_cs, plain = _load_chunk(
            kc, krs, krz, kcs, vc, vrs, vrz, vcs, kp, s_kc, s_krs, s_krz, s_kcs, s_vc, s_vrs,
            s_vrz, s_vcs, s_kp, it0, (it0 < it1).to(tl.int32), D, BLOCK_D, DV, BLOCK_DV, G,
            BLOCK_N, K_BITS, V_BITS, HAS_K_PLAIN)
    for it in range(it0, it1):
        if PREFETCH:
            c_kbyte, c_k_rs, c_k_rz, c_k_cs = kbyte, k_rs, k_rz, k_cs
            c_vbyte, c_v_rs, c_v_rz, c_v_cs, c_plain = vbyte, v_rs, v_rz, v_cs, plain
            # the next chunk's loads first (the last chunk reloads itself: never out of range)
            kbyte, k_rs, k_rz, k_cs, vbyte, v_rs, v_rz, v_cs, plain = _load_chunk(
                kc, krs, krz, kcs, vc, vrs, vrz, vcs, kp, s_kc, s_krs, s_krz, s_kcs, s_vc, s_vrs,
                s_vrz, s_vcs, s_kp, tl.minimum(it + 1, it1 - 1), (it < it1).to(tl.int32), D,
                BLOCK_D, DV, BLOCK_DV, G, BLOCK_N, K_BITS, V_BITS, HAS_K_PLAIN)
        else:
            c_kbyte, c_k_rs, c_k_rz, c_k_cs, c_vbyte, c_v_rs, c_v_rz, c_v_cs, c_plain = _load_chunk(
                kc, krs, krz, kcs, vc, vrs, vrz, vcs, kp, s_kc, s_krs, s_krz, s_kcs, s_vc, s_vrs,
                s_vrz, s_vcs, s_kp, tl.minimum(it, it1 - 1), (it < it1).to(tl.int32), D, BLOCK_D,
                DV, BLOCK_DV, G, BLOCK_N, K_BITS, V_BITS, HAS_K_PLAIN)
        q_t = q
        if HAS_K_PLAIN:
            q_t = _frame_q(qr_rows, s_qrd, qp_rows, s_qpd, m_valid, c_plain, D, BLOCK_D)
        rs = c_k_rs.to(tl.float32)
        rz = c_k_rz.to(tl.float32)
        s = _packed_dot(q_t * rs[None, :], c_kbyte, q_t * rz[None, :], BLOCK_D, BLOCK_N,
                        K_BITS, INPUT_PRECISION) * (c_k_cs.to(tl.float32) * qk_scale)[None, :]
        tok = it * BLOCK_N + offs_n
        s = _mask_scores(s, tok, m_valid, kv_lo, kv_hi, bias_rows, s_bias, HAS_BIAS, HAS_LO,
                         HAS_HI)
        p, m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc)
        v_rs_f = c_v_rs.to(tl.float32)
        acc += _packed_dot(p * v_rs_f[None, :], c_vbyte, p * c_v_rz.to(tl.float32)[None, :],
                           BLOCK_N, BLOCK_DV, V_BITS, INPUT_PRECISION) \
            * c_v_cs.to(tl.float32)[None, :]
    return m_i, l_i, acc


@triton.jit
def _decode_range(q, qr_rows, s_qrd, qp_rows, s_qpd,
                  kc, krs, krz, kcs, vc, vrs, vrz, vcs, kp,
                  s_kc, s_krs, s_krz, s_kcs, s_vc, s_vrs, s_vrz, s_vcs, s_kp,
                  start, end, m_valid, kv_lo, kv_hi, bias_rows, s_bias, qk_scale,
                  BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  G: tl.constexpr, BLOCK_N: tl.constexpr, K_BITS: tl.constexpr,
                  V_BITS: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HAS_K_PLAIN: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
                  DV: tl.constexpr, BLOCK_DV: tl.constexpr, PHASED: tl.constexpr,
                  MASK_BITS: tl.constexpr = True, KEY_PART: tl.constexpr = 0):
    """Online-softmax attention of the query block q [BLOCK_M, BLOCK_D] (rotated, fp32) over
    packed tiles [start, end) of one (batch row, kv head): returns (m, l, acc) in log2 units,
    acc [BLOCK_M, BLOCK_DV]. The loop shared by the standalone kernel and the decode
    template. PHASED (:func:`phased_decode`, decided by the launcher): fp16 operands through
    ``_decode_range_phased`` (codes unpacked two per instruction; MASK_BITS: how it holds a
    bool mask; KEY_PART: a prompt's blocks score the keys in parts, ``key_part``); else
    ``_decode_range_bytes``."""
    if PHASED:
        tl.static_assert(INPUT_PRECISION == "fp16", "the phased loop takes fp16 operands")
        tl.static_assert(BLOCK_N * K_BITS >= 128, "phased: K phases need 16 tokens")
        tl.static_assert(BLOCK_DV * V_BITS >= 128, "phased: V phases need 16 channels")
        tl.static_assert((DV * V_BITS) % 16 == 0, "phased: V rows of whole 16-bit words")
        m_i, l_i, acc = _decode_range_phased(
            q, qr_rows, s_qrd, qp_rows, s_qpd, kc, krs, krz, kcs, vc, vrs, vrz, vcs, kp, s_kc,
            s_krs, s_krz, s_kcs,
            s_vc, s_vrs, s_vrz, s_vcs, s_kp, start, end, m_valid, kv_lo, kv_hi, bias_rows,
            s_bias, qk_scale, BLOCK_M, D, BLOCK_D, G, BLOCK_N, K_BITS, V_BITS, HAS_LO, HAS_HI,
            HAS_BIAS, HAS_K_PLAIN, PREFETCH, DV, BLOCK_DV, MASK_BITS, KEY_PART)
    else:
        m_i, l_i, acc = _decode_range_bytes(
            q, qr_rows, s_qrd, qp_rows, s_qpd, kc, krs, krz, kcs, vc, vrs, vrz, vcs, kp, s_kc,
            s_krs, s_krz, s_kcs,
            s_vc, s_vrs, s_vrz, s_vcs, s_kp, start, end, m_valid, kv_lo, kv_hi, bias_rows,
            s_bias, qk_scale, BLOCK_M, D, BLOCK_D, G, BLOCK_N, K_BITS, V_BITS, HAS_LO, HAS_HI,
            HAS_BIAS, HAS_K_PLAIN, INPUT_PRECISION, PREFETCH, DV, BLOCK_DV)
    return m_i, l_i, acc


@triton.jit
def _head_tiles(q, qr_rows, s_qrd, qp_rows, s_qpd, kc, krs, krz, kcs, vc, vrs, vrz, vcs, kp,
                head, start, end, m_valid, kv_lo, kv_hi, bias_rows, s_bias, qk_scale,
                BLOCK_M: tl.constexpr,
                D: tl.constexpr, BLOCK_D: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
                K_BITS: tl.constexpr, V_BITS: tl.constexpr, HAS_LO: tl.constexpr,
                HAS_HI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_K_PLAIN: tl.constexpr,
                INPUT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr, DV: tl.constexpr,
                BLOCK_DV: tl.constexpr, PHASED: tl.constexpr, MASK_BITS: tl.constexpr = True,
                KEY_PART: tl.constexpr = 0):
    """``_decode_range`` over tiles [start, end) of one (batch row, kv head) of contiguous
    state tensors [B, H, N, ...]: ``head`` = (b * H + h) * N, the flat index of its tile 0."""
    K_ROW_BYTES: tl.constexpr = G * K_BITS // 8
    V_ROW_BYTES: tl.constexpr = DV * V_BITS // 8
    return _decode_range(
        q, qr_rows, s_qrd, qp_rows, s_qpd, kc + head * (D * K_ROW_BYTES), krs + head * D,
        krz + head * D, kcs + head * G,
        vc + head * (G * V_ROW_BYTES), vrs + head * G, vrz + head * G, vcs + head * DV, kp + head,
        D * K_ROW_BYTES, D, D, G, G * V_ROW_BYTES, G, G, DV, 1, start, end, m_valid, kv_lo, kv_hi,
        bias_rows, s_bias, qk_scale, BLOCK_M, D, BLOCK_D, G, BLOCK_N, K_BITS, V_BITS, HAS_LO,
        HAS_HI, HAS_BIAS, HAS_K_PLAIN, INPUT_PRECISION, PREFETCH, DV, BLOCK_DV, PHASED,
        MASK_BITS, KEY_PART)


# ------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------
@triton.jit
def _kvarn_decode_attn_kernel(
    q_ptr,            # rotated queries [B, Hq, Tq, D] fp32, last stride 1
    stride_qb,        # q.stride(0)
    stride_qh,        # q.stride(1)
    stride_qt,        # q.stride(2)
    k_codes_ptr,      # uint8 [B, H, N, D, G * K_BITS / 8], contiguous
    k_row_scale_ptr,  # [B, H, N, D] per-channel scale s_ch (rs_k), contiguous
    k_row_zero_ptr,   # [B, H, N, D] per-channel zero z_ch (rz_k), contiguous
    k_col_scale_ptr,  # [B, H, N, G] per-token scale s_tok (cs_k), contiguous
    v_codes_ptr,      # uint8 [B, H, N, G, DV * V_BITS / 8], contiguous
    v_row_scale_ptr,  # [B, H, N, G] per-token scale s_tok (rs_v), contiguous
    v_row_zero_ptr,   # [B, H, N, G] per-token zero z_tok (rz_v), contiguous
    v_col_scale_ptr,  # [B, H, N, DV] per-channel scale s_ch (cs_v), contiguous
    n_tiles_ptr,      # int32/int64 [B]: valid tiles of each batch row (clamped to [0, N])
    kv_start_ptr,     # int32/int64 [B, Tq]: first visible quantized token per query (HAS_KV_START)
    kv_end_ptr,       # int32/int64 [B, Tq]: one past the last visible quantized token (HAS_KV_END)
    bias_ptr,         # fp32 [B, Hq or 1, Tq, N * G] additive mask over the quantized tokens (HAS_BIAS)
    stride_bb,        # bias.stride(0)
    stride_bh,        # bias.stride(1) (0: one mask for every query head)
    stride_bt,        # bias.stride(2); the token stride is 1
    q_plain_ptr,      # un-rotated queries, same strides as q (HAS_K_PLAIN)
    k_plain_ptr,      # uint8 [B, H, N]: 1 = that K tile is stored un-rotated (HAS_K_PLAIN)
    o_ptr,            # fp32 [B, Hq, Tq, SPLIT, DV]: per-split output, normalized by its own l
    lse_ptr,          # fp32 [B, Hq, Tq, SPLIT]: per-split natural-log lse (-inf when empty)
    qk_scale,         # softmax scale * log2(e)
    H,                # kv heads
    N,                # tile capacity of the cache tensors
    Tq,               # query rows per head
    GROUP_Q: tl.constexpr,          # g = Hq // H query heads per kv head (any int >= 1)
    D: tl.constexpr,                # keys' (and queries') head dim
    BLOCK_D: tl.constexpr,          # D rounded up to a power of two >= 16
    DV: tl.constexpr,               # values' (and the output's) head dim (D but for MLA-style caches)
    BLOCK_DV: tl.constexpr,         # DV rounded up to a power of two >= 16
    G: tl.constexpr,                # tokens per tile (power of two >= 16)
    K_BITS: tl.constexpr,           # K code width (2, 4, 8)
    V_BITS: tl.constexpr,           # V code width (2, 4, 8)
    SPLIT: tl.constexpr,            # splits of the tile range (grid axis 1)
    BLOCK_M: tl.constexpr,          # query rows per program, a power of two >= 16 (tl.dot)
    BLOCK_N: tl.constexpr,          # tokens per loop step, a divisor of G >= 16
    PREFETCH: tl.constexpr,         # issue the next step's loads before this step's math
    HAS_KV_START: tl.constexpr,     # a constexpr so the common decode case has no mask math
    HAS_KV_END: tl.constexpr,       # causal bound inside the quantized region (multi-token queries)
    HAS_BIAS: tl.constexpr,         # an additive mask over the quantized tokens
    HAS_K_PLAIN: tl.constexpr,      # per-tile key frames (key_frame="auto" caches)
    INPUT_PRECISION: tl.constexpr,  # "ieee" (exact fp32), "tf32" or "fp16" (faster, ~1e-3 rel. error)
    PHASED: tl.constexpr,           # the phased fp16 loop (phased_decode)
):
    """Flash-decoding partials of one (batch row, kv head, split, query block).

    How is this kernel parallelized? Grid (B * H, SPLIT, cdiv(g * Tq, BLOCK_M)). Program
    (b * H + h, s, mb) packs the query rows m = t * g + hg (query head h * g + hg, query
    position t) of block mb, so every K/V tile of kv head h is read and unpacked once for
    all its g query heads (GQA) and the BLOCK_M / g positions of the block. The valid tiles [first, n_tiles[b]) are cut into
    SPLIT contiguous ranges of cdiv(n_valid, SPLIT) tiles; split s walks its range with an
    online softmax and stores (acc / l, m + log l) for its rows. Empty ranges store
    (0, -inf). ``_combine_splits_kernel`` reduces the splits.
    """
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_valid = offs_m < GROUP_Q * Tq
    hq = h * GROUP_Q + offs_m % GROUP_Q   # query head of each row (position-major rows: a
    tq = offs_m // GROUP_Q                # block holds every query head of its positions)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D

    # the rotated queries' rows (HAS_K_PLAIN: the loop reads them again per tile, _frame_q)
    qr_rows = q_ptr + b.to(tl.int64) * stride_qb + hq.to(tl.int64) * stride_qh + tq * stride_qt
    q = tl.load(qr_rows[:, None] + offs_d[None, :],
                mask=m_valid[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    # the un-rotated queries' rows (HAS_K_PLAIN: read by the loop for a key-frame tile)
    qp_rows = q_plain_ptr + b.to(tl.int64) * stride_qb + hq.to(tl.int64) * stride_qh \
        + tq * stride_qt

    # ---- this split's tile range
    n = tl.minimum(tl.maximum(tl.load(n_tiles_ptr + b).to(tl.int32), 0), N)
    first = n * 0
    if HAS_KV_START:
        kv_lo = tl.load(kv_start_ptr + b.to(tl.int64) * Tq + tq, mask=m_valid, other=0).to(tl.int32)
        # skip the tiles that no row of this block can see
        lowest = tl.min(tl.where(m_valid, kv_lo, 2147483647), axis=0)
        first = tl.minimum(tl.maximum(lowest, 0) // G, n)
    last = n
    if HAS_KV_END:
        kv_hi = tl.load(kv_end_ptr + b.to(tl.int64) * Tq + tq, mask=m_valid, other=0).to(tl.int32)
        # skip the tiles past every row's bound
        last = tl.maximum(tl.minimum(tl.cdiv(tl.max(tl.where(m_valid, kv_hi, 0), axis=0), G), n),
                          first)
    per_split = tl.cdiv(last - first, SPLIT)
    start = first + split * per_split
    end = tl.minimum(start + per_split, last)

    head = (b.to(tl.int64) * H + h) * N  # flat index of tile 0 of (b, h)
    if not HAS_KV_START:
        kv_lo = tq
    if not HAS_KV_END:
        kv_hi = tq
    bias_rows = bias_ptr + b.to(tl.int64) * stride_bb + hq.to(tl.int64) * stride_bh \
        + tq.to(tl.int64) * stride_bt
    m_i, l_i, acc = _head_tiles(
        q, qr_rows, 1, qp_rows, 1, k_codes_ptr, k_row_scale_ptr, k_row_zero_ptr, k_col_scale_ptr,
        v_codes_ptr,
        v_row_scale_ptr, v_row_zero_ptr, v_col_scale_ptr, k_plain_ptr, head, start, end,
        m_valid, kv_lo, kv_hi, bias_rows, 1, qk_scale, BLOCK_M, D, BLOCK_D, G, BLOCK_N, K_BITS,
        V_BITS, HAS_KV_START, HAS_KV_END, HAS_BIAS, HAS_K_PLAIN, INPUT_PRECISION, PREFETCH, DV,
        BLOCK_DV, PHASED)

    # ---- store this split's normalized partial and its lse (natural log)
    _store_partial(o_ptr, lse_ptr, split, m_i, l_i, acc,
                   (b.to(tl.int64) * (H * GROUP_Q) + hq) * Tq + tq, m_valid, SPLIT, DV, BLOCK_DV)


@triton.jit
def _combine_splits_kernel(
    o_part_ptr,       # fp32 [rows, SPLIT, D]: per-split normalized outputs
    lse_part_ptr,     # fp32 [rows, SPLIT]: per-split lse (-inf for an empty split)
    out_ptr,          # fp32 [rows, D]: merged output (0 when every split is empty)
    lse_ptr,          # fp32 [rows]: merged lse (-inf when every split is empty)
    D: tl.constexpr,            # head dim
    BLOCK_D: tl.constexpr,      # D rounded up to a power of two
    SPLIT: tl.constexpr,        # number of splits
    BLOCK_S: tl.constexpr,      # SPLIT rounded up to a power of two
):
    """Merge SPLIT partials of one query row by log-sum-exp.

    M = max_s lse_s; w_s = exp(lse_s - M); out = sum_s w_s out_s / sum_s w_s;
    lse = M + log(sum_s w_s). With every lse_s = -inf the reference point falls back to 0,
    so w = 0 and out = 0, lse = -inf (no NaN).

    How is this kernel parallelized? One program per query row (B * Hq * Tq programs).
    """
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < SPLIT
    lse_s = tl.load(lse_part_ptr + row * SPLIT + offs_s, mask=s_mask, other=float("-inf"))
    o_s = tl.load(o_part_ptr + (row * SPLIT + offs_s[:, None]) * D + offs_d[None, :],
                  mask=s_mask[:, None] & (offs_d < D)[None, :], other=0.0)
    m = tl.max(lse_s, axis=0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_ref)
    den = tl.sum(w, axis=0)
    has = den > 0.0
    out = tl.sum(w[:, None] * o_s, axis=0) / tl.where(has, den, 1.0)
    tl.store(out_ptr + row * D + offs_d, out, mask=offs_d < D)
    tl.store(lse_ptr + row, tl.where(has, m_ref + tl.log(tl.where(has, den, 1.0)), float("-inf")))


@triton.jit
def _exact_chunk(q, kb, vb, slot, pos, ok, q_pos, m_valid, mask_rows, s_mk, mask_len, qk_scale,
                 window, m_i, l_i, acc, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 DV: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step of ``_exact_range`` over the slots ``slot`` [BLOCK_E] of one
    exact buffer (keys kb [*, D], values vb [*, DV]), at positions ``pos``, ``ok`` where a
    slot holds a token."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = tl.load(kb + slot.to(tl.int64)[:, None] * D + offs_d[None, :],
                mask=ok[:, None] & (offs_d < D)[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * qk_scale
    allowed = ok[None, :] & m_valid[:, None]
    if CAUSAL:
        allowed = allowed & (pos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
    if HAS_MASK:
        s = s + _additive_log2(tl.load(mask_rows[:, None] + pos[None, :].to(tl.int64) * s_mk,
                                       mask=allowed & (pos < mask_len)[None, :], other=0))
    s = tl.where(allowed, s, float("-inf"))
    p, m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc)
    v = tl.load(vb + slot.to(tl.int64)[:, None] * DV + offs_dv[None, :],
                mask=ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
    acc = tl.dot(p, v.to(tl.float32), acc, input_precision=PRECISION)
    return m_i, l_i, acc


@triton.jit
def _exact_range(q, sk, sv, tk, tv, S, W, lo, hi, length, n_tok, q_pos, m_valid, mask_rows,
                 s_mk, mask_len, qk_scale, window, BLOCK_M: tl.constexpr, D: tl.constexpr,
                 BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_E: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 HAS_MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Online-softmax attention of the plain query block q [BLOCK_M, BLOCK_D] (fp32) over
    slots [lo, hi) of the exact region of one (batch row, kv head), numbered sink then tail:
    sink slots [0, S) at positions 0..S-1, tail ring slots [0, W) (numbers S..S+W-1), slot w
    holding position S + n_tok + (w - n_tok) mod W (n_tok: the packed tokens), each visible
    when it holds a token (< length; the tail only once the sink is full), under the causal,
    window and mask rules of ``ops/regions.exact_region``.
    sk/tk [S|W, D] and sv/tv [S|W, DV] point at the row's slots (contiguous). Returns
    (m, l, acc) in log2 units. Dots: fp32 with INPUT_PRECISION "ieee", else tf32, whose
    10-bit significand holds an fp16 or bf16 cache's keys and values and a 16-bit model's
    queries exactly (fp32 sums; the probabilities rounded to 10 bits)."""
    PRECISION: tl.constexpr = "ieee" if INPUT_PRECISION == "ieee" else "tf32"
    offs_e = tl.arange(0, BLOCK_E)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    sink_hi = tl.minimum(hi, S)
    for e0 in range(lo, sink_hi, BLOCK_E):
        j = e0 + offs_e
        m_i, l_i, acc = _exact_chunk(q, sk, sv, j, j, (j < sink_hi) & (j < length), q_pos, m_valid,
                                     mask_rows, s_mk, mask_len, qk_scale, window, m_i, l_i, acc,
                                     D, BLOCK_D, DV, BLOCK_DV, CAUSAL, HAS_WINDOW, HAS_MASK,
                                     PRECISION)
    ring = tl.maximum(W, 1)
    tail_end = tl.where(length > S, length, 0)      # the tail holds tokens once the sink is full
    tail_hi = tl.maximum(hi, S) - S
    for e0 in range(tl.maximum(lo, S) - S, tail_hi, BLOCK_E):
        w = e0 + offs_e
        pos = S + n_tok + ((w - n_tok) % ring + ring) % ring
        ok = (w < tail_hi) & (pos < tail_end)
        m_i, l_i, acc = _exact_chunk(q, tk, tv, w, pos, ok, q_pos, m_valid, mask_rows, s_mk,
                                     mask_len, qk_scale, window, m_i, l_i, acc, D, BLOCK_D, DV,
                                     BLOCK_DV, CAUSAL, HAS_WINDOW, HAS_MASK, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _normalized(m_i, l_i):
    """An online-softmax state's (l, natural-log lse): 1 and -inf where it saw nothing
    (acc / the first is its normalized output, 0 there)."""
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    return l_safe, tl.where(has, (m_i + tl.log2(l_safe)) * _LN2, float("-inf"))


@triton.jit
def _merged(m_ref, den):
    """The merge of partials weighted exp(lse - m_ref), summing to den: (1 / den, the
    merged natural-log lse; 1 and -inf where none saw anything, NaN kept)."""
    has = den > 0.0
    den_safe = tl.where(has, den, 1.0)
    lse = tl.where(has, m_ref + tl.log(den_safe), float("-inf"))
    return 1.0 / den_safe, tl.where(den != den, den, lse)


@triton.jit
def _store_partial(o_part_ptr, lse_part_ptr, slot, m_i, l_i, acc, rows, m_valid,
                   SLOTS: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Store one program's normalized partial (acc / l, natural-log lse; 0 and -inf when it
    saw nothing) at ``slot`` of its rows: o_part [rows, SLOTS, DV], lse_part [rows, SLOTS]."""
    l_safe, lse = _normalized(m_i, l_i)
    out = acc / l_safe[:, None]
    row = rows * SLOTS + slot
    offs_dv = tl.arange(0, BLOCK_DV)
    tl.store(o_part_ptr + row[:, None] * DV + offs_dv[None, :], out,
             mask=m_valid[:, None] & (offs_dv < DV)[None, :])
    tl.store(lse_part_ptr + row, lse, mask=m_valid)


@triton.jit
def _query_rows(q_ptr, s_qb, s_qh, s_qt, b64, h, pid_m, Tq, GROUP_Q: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """Query block pid_m of (batch row b64, kv head h), rows packed position-major (row m:
    query head h * GROUP_Q + m % GROUP_Q, position m // GROUP_Q): (valid, query head,
    position, row pointers into q)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    hq = h * GROUP_Q + offs_m % GROUP_Q
    tq = offs_m // GROUP_Q
    q_rows = q_ptr + b64 * s_qb + hq.to(tl.int64) * s_qh + tq.to(tl.int64) * s_qt
    return offs_m < GROUP_Q * Tq, hq, tq, q_rows


@triton.jit
def _exact_state(q_ptr, s_qb, s_qh, s_qt, sink_k_ptr, sink_v_ptr, tail_k_ptr, tail_v_ptr,
                 mask_ptr, s_mb, s_mh, s_mt, s_mk, mask_len, b64, h, pid_m, lo, hi, length,
                 n_raw, qk_scale, H, Tq, S, W, window, GROUP_Q: tl.constexpr, D: tl.constexpr,
                 BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                 G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr):
    """Slots [lo, hi) of the exact region (sink ++ tail) for one block of query rows, with
    the plain queries: (m_valid, hq, tq, m, l, acc), m in log2 units, acc un-normalized."""
    m_valid, hq, tq, q_rows = _query_rows(q_ptr, s_qb, s_qh, s_qt, b64, h, pid_m, Tq, GROUP_Q,
                                          BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=m_valid[:, None] & (offs_d < D)[None, :],
                other=0.0).to(tl.float32)
    mask_rows = mask_ptr + b64 * s_mb + hq.to(tl.int64) * s_mh + tq.to(tl.int64) * s_mt
    head_s = (b64 * H + h) * S
    head_w = (b64 * H + h) * W
    m_i, l_i, acc = _exact_range(
        q, sink_k_ptr + head_s * D, sink_v_ptr + head_s * DV, tail_k_ptr + head_w * D,
        tail_v_ptr + head_w * DV, S, W, lo, hi, length, n_raw * G, length - Tq + tq, m_valid,
        mask_rows, s_mk, mask_len, qk_scale, window, BLOCK_M, D, BLOCK_D, DV, BLOCK_DV, BLOCK_E,
        CAUSAL, HAS_WINDOW, HAS_MASK, INPUT_PRECISION)
    return m_valid, hq, tq, m_i, l_i, acc


@triton.jit(noinline=True)
def _exact_staged(q_ptr, s_qb, s_qh, s_qt, sink_k_ptr, sink_v_ptr, tail_k_ptr, tail_v_ptr,
                  mask_ptr, s_mb, s_mh, s_mt, s_mk, mask_len, stage_ptr, lse_ptr, b, h, pid_m,
                  length, n_raw, qk_scale, H, Tq, S, W, window, GROUP_Q: tl.constexpr,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr,
                  BLOCK_DV: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_E: tl.constexpr, SCRATCH_W: tl.constexpr, CAUSAL: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr):
    """FUSED: the whole exact region for one block of query rows, its normalized output
    stored in the block's scratch rows (``stage_ptr`` [BLOCK_M, SCRATCH_W]) and its lse
    (natural log) in ``lse_ptr`` at the rows' places, for the program to merge. A function
    of its own (noinline, scalar arguments: its registers are allocated apart from the tile
    loop's; returning tensors from one does not compile on triton 3.6)."""
    b64 = b.to(tl.int64)
    m_valid, hq, tq, m_i, l_i, acc = _exact_state(
        q_ptr, s_qb, s_qh, s_qt, sink_k_ptr, sink_v_ptr, tail_k_ptr, tail_v_ptr, mask_ptr, s_mb,
        s_mh, s_mt, s_mk, mask_len, b64, h, pid_m, 0, S + W, length, n_raw, qk_scale, H, Tq, S,
        W, window, GROUP_Q, D, BLOCK_D, DV, BLOCK_DV, G, BLOCK_M, BLOCK_E, CAUSAL, HAS_WINDOW,
        HAS_MASK, INPUT_PRECISION)
    l_safe, lse = _normalized(m_i, l_i)
    offs_r = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    tl.store(stage_ptr + offs_r[:, None] * SCRATCH_W + offs_dv[None, :], acc / l_safe[:, None])
    tl.store(lse_ptr + (b64 * (H * GROUP_Q) + hq) * Tq + tq, lse, mask=m_valid)


@triton.jit(noinline=True)
def _exact_program(q_ptr, s_qb, s_qh, s_qt, sink_k_ptr, sink_v_ptr, tail_k_ptr, tail_v_ptr,
                   mask_ptr, s_mb, s_mh, s_mt, s_mk, mask_len, o_part_ptr, lse_part_ptr,
                   b, h, pid_m, split, length, n_raw, qk_scale, H, Tq, S, W, window,
                   GROUP_Q: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   DV: tl.constexpr, BLOCK_DV: tl.constexpr, G: tl.constexpr,
                   SPLIT: tl.constexpr, EXACT: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_E: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Program SPLIT + e of ``_kvarn_attn_kernel``: part e of the exact region's slots for
    one block of query rows, its normalized partial stored at slot SPLIT + e. A function of
    its own, called (noinline: scalar arguments only), so that its registers are allocated
    apart from the tile loop's (inlined, sm_90 triton 3.6: the tile loop spilled ~24 B
    more)."""
    b64 = b.to(tl.int64)
    per_e = tl.cdiv(S + W, EXACT)
    lo = (split - SPLIT) * per_e
    m_valid, hq, tq, m_i, l_i, acc = _exact_state(
        q_ptr, s_qb, s_qh, s_qt, sink_k_ptr, sink_v_ptr, tail_k_ptr, tail_v_ptr, mask_ptr, s_mb,
        s_mh, s_mt, s_mk, mask_len, b64, h, pid_m, lo, tl.minimum(lo + per_e, S + W), length,
        n_raw, qk_scale, H, Tq, S, W, window, GROUP_Q, D, BLOCK_D, DV, BLOCK_DV, G, BLOCK_M,
        BLOCK_E, CAUSAL, HAS_WINDOW, HAS_MASK, INPUT_PRECISION)
    _store_partial(o_part_ptr, lse_part_ptr, split, m_i, l_i, acc,
                   (b64 * (H * GROUP_Q) + hq) * Tq + tq, m_valid, SPLIT + EXACT, DV, BLOCK_DV)


@triton.jit
def _kvarn_attn_kernel(
    q_ptr, s_qb, s_qh, s_qt,      # queries [B, Hq, Tq, D] as the model gives them (last stride 1)
    rot_ptr,                      # fp32 [D, D]: the keys' rotation (q_rot = q @ rot)
    rot_v_ptr,                    # fp32 [DV, DV]: the values' rotation (out = out_rot @ rot_v^T)
    sink_k_ptr, sink_v_ptr,       # [B, H, S, D], [B, H, S, DV] exact sink, contiguous
    tail_k_ptr, tail_v_ptr,       # [B, H, W, D], [B, H, W, DV] exact tail ring, contiguous
    lengths_ptr,                  # int [B]: tokens written per batch row
    n_tiles_ptr,                  # int [B]: packed tiles per batch row
    k_codes_ptr, k_row_scale_ptr, k_row_zero_ptr, k_col_scale_ptr,   # as _kvarn_decode_attn_kernel
    v_codes_ptr, v_row_scale_ptr, v_row_zero_ptr, v_col_scale_ptr,
    k_plain_ptr,                  # uint8 [B, H, N] per-tile key frames (HAS_K_PLAIN)
    mask_ptr, s_mb, s_mh, s_mt, s_mk,   # the model's mask (bool or additive float), its strides
    mask_len,                     # its key length M
    o_part_ptr,                   # fp32 [B, Hq, Tq, SPLIT + EXACT, DV] partials (tiles, exact)
    lse_part_ptr,                 # fp32 [B, Hq, Tq, SPLIT + EXACT]
    count_ptr,                    # int32 [B * H * M_BLOCKS], zero: programs done per block
    out_ptr,                      # [B, Hq, Tq, DV] in q's dtype, contiguous
    lse_ptr,                      # fp32 [B, Hq, Tq]
    err_ptr,                      # int32 device error flags (MASK_FLAG)
    scratch_ptr,                  # fp32 [B * H * SPLIT * M_BLOCKS, BLOCK_M, SCRATCH_W]
                                  # (Q_SCRATCH: the rotated q; FUSED: the exact region's acc)
    qk_scale, H, N, Tq, S, W, window, M_BLOCKS,
    GROUP_Q: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, G: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    SPLIT: tl.constexpr,            # splits of the packed tiles
    EXACT: tl.constexpr,            # splits of the exact region (sink ++ tail slots)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
    PREFETCH: tl.constexpr,
    CAUSAL: tl.constexpr,           # causal visibility (bottom-right: query t at length - Tq + t)
    MULTI: tl.constexpr,            # Tq > 1 (a causal bound inside the packed region)
    HAS_WINDOW: tl.constexpr,       # a sliding window of ``window`` positions
    HAS_MASK: tl.constexpr,
    MASK_ROW: tl.constexpr,         # one mask row serves every query row of a batch row
    MASK_FLAG: tl.constexpr,        # record a mask shorter than a row's length in err_ptr
    ERR_MASK: tl.constexpr,         # its bit
    HAS_K_PLAIN: tl.constexpr, INPUT_PRECISION: tl.constexpr, PHASED: tl.constexpr,
    Q_SCRATCH: tl.constexpr,        # the rotated q through scratch (decode blocks; see there)
    FUSED: tl.constexpr,            # one program per block: tiles, exact region, output
    SCRATCH_W: tl.constexpr,        # scratch row width: max(BLOCK_D, BLOCK_DV)
):
    """``kvarn::attention`` of one step in one launch: the exact region, the packed tiles and
    their log-sum-exp merge.

    How is this kernel parallelized? Grid (B * H, SPLIT + EXACT, M_BLOCKS), rows packed
    position-major as in ``_kvarn_decode_attn_kernel``. Programs s < SPLIT rotate their
    query block (q @ rot, in the kernel) and walk split s of the packed tiles, as that
    kernel does; programs SPLIT + e attend part e of the exact region's S + W slots
    (``_exact_range``) with the plain queries. Each stores its normalized partial, then
    takes a ticket on its block's counter (an acq_rel atomic after a CTA barrier); the
    program that finishes last merges the SPLIT + EXACT partials: the tile splits weighted
    in the rotated frame, rotated back once (@ rot_v^T, in column chunks), plus the exact
    region's, written in q's dtype.

    FUSED (a prompt: one split, its query blocks fill the GPU by themselves): grid
    (B * H, 1, M_BLOCKS), and each program walks all the tiles its rows see, then the whole
    exact region, and writes its rows' output itself: no partials, counters or merge (the
    partials of a 32k-token prompt at 32 heads were 1-4 GB).
    """
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    b64 = b.to(tl.int64)
    m_valid, hq, tq, q_rows = _query_rows(q_ptr, s_qb, s_qh, s_qt, b64, h, pid_m, Tq, GROUP_Q,
                                          BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    length = tl.load(lengths_ptr + b).to(tl.int32)
    n_raw = tl.load(n_tiles_ptr + b).to(tl.int32)
    q_pos = length - Tq + tq
    mask_rows = mask_ptr + b64 * s_mb + hq.to(tl.int64) * s_mh + tq.to(tl.int64) * s_mt
    rows = (b64 * (H * GROUP_Q) + hq) * Tq + tq
    ROT_PRECISION: tl.constexpr = "ieee" if INPUT_PRECISION == "ieee" else "tf32"
    SLOTS: tl.constexpr = SPLIT + EXACT
    MERGE_SPLITS: tl.constexpr = max(1, 32 // BLOCK_M)   # tile partials the merge loads at a time
    HAS_HI: tl.constexpr = CAUSAL and MULTI
    # rows of rot (columns of rot_v^T) per rotation step: 4096 fp32 values in registers
    RK: tl.constexpr = max(16, min(BLOCK_D, 4096 // BLOCK_D))
    RC: tl.constexpr = max(16, min(BLOCK_DV, 4096 // BLOCK_DV))

    if split < SPLIT:
        # ---- q @ rot, RK rows of rot at a time (the whole matrix in registers would spill)
        q = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for k0 in tl.static_range(0, BLOCK_D, RK):
            offs_k = k0 + tl.arange(0, RK)
            q_k = tl.load(q_rows[:, None] + offs_k[None, :],
                          mask=m_valid[:, None] & (offs_k < D)[None, :], other=0.0).to(tl.float32)
            r = tl.load(rot_ptr + offs_k[:, None] * D + offs_d[None, :],
                        mask=(offs_k < D)[:, None] & d_mask[None, :], other=0.0)
            q = tl.dot(q_k, r, q, input_precision=ROT_PRECISION)
        # with key frames (per tile, _frame_q) or a head dim the phased loop takes in two
        # parts, the loop reads the rotated rows: they go through scratch (the launcher sets
        # Q_SCRATCH then)
        tl.static_assert(Q_SCRATCH or not (HAS_K_PLAIN or (PHASED and (
            BLOCK_D != D or BLOCK_D > 128 or FUSED))),
                         "the loop reads the rotated q from scratch")
        q_mem = q_rows
        if Q_SCRATCH:
            # through a scratch row block: the loop takes q in the layout of a load (straight
            # from the dot's accumulator layout, sm_90 decode spills: triton 3.6, 308 B)
            pid = (pid_bh * SPLIT + split) * M_BLOCKS + pid_m
            offs_r = tl.arange(0, BLOCK_M)
            q_mem = scratch_ptr + pid.to(tl.int64) * (BLOCK_M * SCRATCH_W) + offs_r * SCRATCH_W
            scratch = q_mem[:, None] + offs_d[None, :]
            tl.store(scratch, q)
            tl.debug_barrier()
            q = tl.load(scratch)
        # ---- which packed tokens each row sees (``regions.tile_bounds``)
        n = tl.minimum(tl.maximum(n_raw, 0), N)
        kv_hi = tl.zeros_like(tq) + n * G
        if CAUSAL and MULTI:
            kv_hi = tl.minimum(kv_hi, tl.maximum(q_pos - S + 1, 0))
        kv_lo = tq * 0
        first = n * 0
        if HAS_WINDOW:
            kv_lo = tl.maximum(q_pos - window + 1 - S, 0)
            lowest = tl.min(tl.where(m_valid, kv_lo, 2147483647), axis=0)
            first = tl.minimum(lowest // G, n)
        last = n
        if HAS_HI:
            last = tl.maximum(tl.minimum(tl.cdiv(tl.max(tl.where(m_valid, kv_hi, 0), axis=0), G), n),
                              first)
        if HAS_MASK:
            # only tiles the mask covers whole: never a read past its end (a mask shorter than
            # a row's length is an error the caller reports; a valid one covers every tile)
            last = tl.maximum(tl.minimum(last, tl.maximum(mask_len - S, 0) // G), first)
        per_split = tl.cdiv(last - first, SPLIT)
        start = first + split * per_split
        end = tl.minimum(start + per_split, last)
        if MASK_ROW:
            TILE_MASK = mask_ptr + b64 * s_mb + S * s_mk
        else:
            TILE_MASK = mask_rows + S * s_mk
        m_i, l_i, acc = _head_tiles(
            q, q_mem, 1, q_rows, 1, k_codes_ptr, k_row_scale_ptr, k_row_zero_ptr, k_col_scale_ptr,
            v_codes_ptr, v_row_scale_ptr, v_row_zero_ptr, v_col_scale_ptr, k_plain_ptr,
            (b64 * H + h) * N, start, end, m_valid, kv_lo, kv_hi, TILE_MASK, s_mk,
            qk_scale, BLOCK_M, D, BLOCK_D, G, BLOCK_N, K_BITS, V_BITS, HAS_WINDOW, HAS_HI,
            2 if MASK_ROW else HAS_MASK, HAS_K_PLAIN, INPUT_PRECISION, PREFETCH, DV, BLOCK_DV,
            PHASED, False, OP_KEY_PART if FUSED else 0)   # a bool mask as its values; a
        # prompt's keys in parts (``key_part``)
        if FUSED:
            # then the whole exact region with the plain queries (its output staged in this
            # block's scratch rows, q's no longer needed), and the block's output
            if MASK_FLAG:
                if pid_m == 0:
                    short = (length > mask_len).to(tl.int32) * ERR_MASK
                    tl.atomic_or(err_ptr, short, sem="relaxed")
            stage = scratch_ptr + (pid_bh * M_BLOCKS + pid_m).to(tl.int64) * (BLOCK_M * SCRATCH_W)
            tl.debug_barrier()
            _exact_staged(q_ptr, s_qb, s_qh, s_qt, sink_k_ptr, sink_v_ptr, tail_k_ptr, tail_v_ptr,
                          mask_ptr, s_mb, s_mh, s_mt, s_mk, mask_len, stage, lse_ptr, b, h,
                          pid_m, length, n_raw, qk_scale, H, Tq, S, W, window, GROUP_Q, D,
                          BLOCK_D, DV, BLOCK_DV, G, BLOCK_M, BLOCK_E, SCRATCH_W, CAUSAL,
                          HAS_WINDOW, HAS_MASK, INPUT_PRECISION)
            tl.debug_barrier()
            # the two partials, as the merge weighs them (natural-log lse)
            l_safe, lse_t = _normalized(m_i, l_i)
            lse_e = tl.load(lse_ptr + rows, mask=m_valid, other=float("-inf"))
            top = tl.maximum(lse_t, lse_e)
            m_ref = tl.where(top == float("-inf"), 0.0, top)
            w_t = tl.exp(lse_t - m_ref)
            w_e = tl.exp(lse_e - m_ref)
            inv, lse = _merged(m_ref, w_t + w_e)
            tl.store(lse_ptr + rows, lse, mask=m_valid)
            acc_t = acc * (w_t / l_safe)[:, None]
            offs_r = tl.arange(0, BLOCK_M)
            offs_dv = tl.arange(0, BLOCK_DV)
            for c0 in tl.static_range(0, BLOCK_DV, RC):
                offs_c = c0 + tl.arange(0, RC)
                c_ok = offs_c < DV
                r_t = tl.load(rot_v_ptr + offs_c[None, :] * DV + offs_dv[:, None],
                              mask=c_ok[None, :] & (offs_dv < DV)[:, None], other=0.0)
                o_e = tl.load(stage + offs_r[:, None] * SCRATCH_W + offs_c[None, :])
                out = tl.dot(acc_t, r_t, input_precision=ROT_PRECISION) \
                    + w_e[:, None] * tl.where(w_e[:, None] > 0.0, o_e, 0.0)
                out = out * inv[:, None]
                tl.store(out_ptr + rows[:, None] * DV + offs_c[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & c_ok[None, :])
        else:
            _store_partial(o_part_ptr, lse_part_ptr, split, m_i, l_i, acc, rows, m_valid, SLOTS,
                           DV, BLOCK_DV)
    else:
        _exact_program(q_ptr, s_qb, s_qh, s_qt, sink_k_ptr, sink_v_ptr, tail_k_ptr, tail_v_ptr,
                       mask_ptr, s_mb, s_mh, s_mt, s_mk, mask_len, o_part_ptr, lse_part_ptr,
                       b, h, pid_m, split, length, n_raw, qk_scale, H, Tq, S, W, window,
                       GROUP_Q, D, BLOCK_D, DV, BLOCK_DV, G, SPLIT, EXACT, BLOCK_M, BLOCK_E,
                       CAUSAL, HAS_WINDOW, HAS_MASK, INPUT_PRECISION)
        if MASK_FLAG:
            if (pid_m == 0) & (split == SPLIT):
                short = (length > mask_len).to(tl.int32) * ERR_MASK
                tl.atomic_or(err_ptr, short, sem="relaxed")

    if not FUSED:
        # ---- the last program of this block merges its SPLIT + EXACT partials
        tl.debug_barrier()
        ticket = tl.atomic_add(count_ptr + pid_bh * M_BLOCKS + pid_m, 1, sem="acq_rel", scope="gpu")
        if ticket == SLOTS - 1:
            offs_dv = tl.arange(0, BLOCK_DV)
            base = rows * SLOTS
            # every partial's lse in one load, [BLOCK_M, SLOTS]: the reference point and the sum
            BLOCK_S: tl.constexpr = triton.next_power_of_2(SLOTS)
            offs_s = tl.arange(0, BLOCK_S)
            lse_all = tl.load(lse_part_ptr + base[:, None] + offs_s[None, :],
                              mask=m_valid[:, None] & (offs_s < SLOTS)[None, :], other=float("-inf"),
                              cache_modifier=".cg")
            top = tl.max(lse_all, axis=1)
            m_ref = tl.where(top == float("-inf"), 0.0, top)
            den = tl.sum(tl.exp(lse_all - m_ref[:, None]), axis=1)
            # the tile splits' outputs, MERGE_SPLITS at a time: their loads in flight together
            offs_g = tl.arange(0, MERGE_SPLITS)
            acc_rot = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
            for s0 in range(0, SPLIT, MERGE_SPLITS):
                s_ok = (s0 + offs_g) < SPLIT
                w_g = tl.exp(tl.load(lse_part_ptr + base[:, None] + (s0 + offs_g)[None, :],
                                     mask=m_valid[:, None] & s_ok[None, :], other=float("-inf"),
                                     cache_modifier=".cg") - m_ref[:, None])
                o_g = tl.load(o_part_ptr + ((base[:, None] + s0 + offs_g[None, :]) * DV)[:, :, None]
                              + offs_dv[None, None, :],
                              mask=(m_valid[:, None] & s_ok[None, :])[:, :, None]
                              & (offs_dv < DV)[None, None, :], other=0.0, cache_modifier=".cg")
                acc_rot += tl.sum(w_g[:, :, None] * tl.where(w_g[:, :, None] > 0.0, o_g, 0.0), axis=1)
            inv, lse = _merged(m_ref, den)
            tl.store(lse_ptr + rows, lse, mask=m_valid)
            for c0 in tl.static_range(0, BLOCK_DV, RC):
                offs_c = c0 + tl.arange(0, RC)
                c_ok = offs_c < DV
                r_t = tl.load(rot_v_ptr + offs_c[None, :] * DV + offs_dv[:, None],
                              mask=c_ok[None, :] & (offs_dv < DV)[:, None], other=0.0)
                out = tl.dot(acc_rot, r_t, input_precision=ROT_PRECISION)
                for s in tl.static_range(SPLIT, SLOTS):     # the exact region's, in column chunks
                    w_e = tl.exp(tl.load(lse_part_ptr + base + s, mask=m_valid, other=float("-inf"),
                                         cache_modifier=".cg") - m_ref)
                    o_e = tl.load(o_part_ptr + (base + s)[:, None] * DV + offs_c[None, :],
                                  mask=m_valid[:, None] & c_ok[None, :], other=0.0,
                                  cache_modifier=".cg")
                    out += w_e[:, None] * tl.where(w_e[:, None] > 0.0, o_e, 0.0)
                out = out * inv[:, None]
                tl.store(out_ptr + rows[:, None] * DV + offs_c[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & c_ok[None, :])


# ------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------
def phased_decode(input_precision: str, block_n: int, k_bits: int, dv: int, v_bits: int) -> bool:
    """Whether the decode loop runs phased (``_decode_range_phased``): fp16 operands, and
    matmuls at least 16 wide in every phase, i.e. BLOCK_N * K_BITS >= 128 (16 tokens per K
    phase) and BLOCK_DV * V_BITS >= 128 (16 channels per V phase), with V rows of whole
    16-bit words. The one place this is decided: the kernel's and the decode template's
    launchers pass it as the PHASED constexpr."""
    block_dv = max(16, triton.next_power_of_2(dv))
    return (input_precision == "fp16" and block_n * k_bits >= 128 and block_dv * v_bits >= 128
            and (dv * v_bits) % 16 == 0)


#: Warps and register double buffering of the decode loop by path, for a block of up to
#: 16 query rows: the phased loop is fastest with 2 warps (its V matmuls are 16-32 channels
#: wide) and its next chunk's words in flight spill (sm_90: 0.6 KB), so it issues each
#: chunk's loads where they are used. (Past 128 value channels: ``loop_warps``.)
DECODE_WARPS = {True: 2, False: 4}
DECODE_PREFETCH = {True: False, False: True}


def loop_block_n(block_m: int, group: int) -> int:
    """The loop's default tokens per step: the whole tile (up to 128) for a block of up to
    16 query rows; 64 for larger blocks (multi-token shapes)."""
    return min(group, 128 if block_m <= 16 else 64)


#: A prompt's blocks (the lowering's multi-token template configs, the one-launch op's FUSED
#: blocks) score the keys in parts of at most this many channels (``KEY_PART``): masks and
#: per-row bounds leave their loop fewer registers than a decode step's, and what spilled
#: there was the tile's key words, loaded at the top of a step. The widest part that keeps
#: each block's loop in registers on sm_90 (static report, triton 3.9 and 3.6): the
#: template's 32 up to 128 channels, 64 past them; the op's 64 (parts of 32 at D = 128:
#: 3-5% fewer instructions a tile in the template and its fp32-mask spills 12 B -> 4 B;
#: at 192 they reload 2-6 values a tile, at 256 issue 7-9% more; the op's block no better
#: at 128, 11% more at 256).
OP_KEY_PART = tl.constexpr(64)


def key_part(block_d: int) -> int:
    """``KEY_PART`` of the template's multi-token configs for keys of ``block_d`` channels
    (padded): 32 up to 128, else 64."""
    return 32 if block_d <= 128 else 64


def loop_warps(phased: bool, block_m: int, dv: int = 128) -> int:
    """The loop's default warps: ``DECODE_WARPS`` for a block of up to 16 rows; 4 for larger
    blocks, each warp 16 rows (sm_90, phased, 64 rows: 2,676 B of spills at 2 warps and
    128-token steps, none at 4 warps and 64; 32 rows: 344 B against none), and for value
    rows past 128 channels (``dv``, padded to a power of two: the accumulators grow with it;
    phased, D = Dv = 256: at 2 warps the kernel spills 40 B with triton 3.9 and 128 B with
    3.6, the 16-row prompt block 440 B and 360 B; at 4 warps none, the decode template 8 B
    with 3.6)."""
    if block_m > 16 or dv > 128:
        return 4
    return DECODE_WARPS[phased]


#: Exact-region slots per loop step of ``_exact_range``, and per program at most
#: (``exact_splits``): a program reads about what a tile split does (64 slots of an fp16
#: head of 128: 32 KB, two packed k4v2 tiles and a half).
EXACT_BLOCK = 32
EXACT_SLOTS_PER_PROGRAM = 64


def exact_splits(slots: int) -> int:
    """Programs that share the exact region's ``slots`` (sink + tail) in the one-launch
    kernel: one per ``EXACT_SLOTS_PER_PROGRAM`` slots, at least 1, at most 16."""
    return max(1, min(16, -(-slots // EXACT_SLOTS_PER_PROGRAM)))


def _default_splits(bh: int, capacity: int, device: torch.device) -> int:
    """Enough programs to fill the GPU (about two waves), never more splits than tiles."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(capacity, triton.cdiv(2 * sms, max(bh, 1)), 64))


def combine_splits(o_part: torch.Tensor, lse_part: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-split partials o [..., SPLIT, D], lse [..., SPLIT] into (out [..., D], lse [...])."""
    if o_part.dtype != torch.float32 or lse_part.dtype != torch.float32:
        raise TypeError(f"Expected float32 partials, but got {o_part.dtype} and {lse_part.dtype}.")
    if o_part.shape[:-1] != lse_part.shape:
        raise ValueError(f"Expected o_part [..., SPLIT, D] and lse_part [..., SPLIT], but got "
                         f"{list(o_part.shape)} and {list(lse_part.shape)}.")
    *lead, split, d = o_part.shape
    if split == 1:
        return o_part.reshape(*lead, d), lse_part.reshape(lead)
    o_part, lse_part = o_part.contiguous(), lse_part.contiguous()
    out = torch.empty(*lead, d, dtype=torch.float32, device=o_part.device)
    lse = torch.empty(lead, dtype=torch.float32, device=o_part.device)
    rows = lse.numel()
    if rows:
        _combine_splits_kernel[(rows,)](
            o_part, lse_part, out, lse, D=d, BLOCK_D=triton.next_power_of_2(d), SPLIT=split,
            BLOCK_S=triton.next_power_of_2(split))
    return out, lse


class _TilePlan(NamedTuple):
    heads: int
    cap: int
    group: int
    dv: int
    k_bits: int
    v_bits: int
    input_precision: str
    block_m: int
    split: int
    block_n: int
    phased: bool
    prefetch: bool
    num_warps: int


def default_block_m(rows: int, phased: bool) -> int:
    """Query rows per program for ``rows`` = g * Tq rows per kv head: the phased loop
    (``phased``: it runs phased at the 16-row block's step) 16, the decode step's block,
    for any number of rows; the byte loop a power of two, 16-64.

    sm_90, per warp instruction and query row of a 128-token tile, a 256-query prompt at
    k4v2, key frames on: the phased loop at 16 rows 253 with no mask, 313 with a bool mask
    per row, no spills but 8 B, 4 programs per SM; at 64 rows 293 and 330, 760 B and 880 B of
    spills, 2 programs per SM (every warp of a 64-row block unpacks the whole tile for its
    16 rows: the larger block saves L2 reads, not work). The byte loop (tf32): 498 at 16
    rows, 294 at 64 (its unpacking is shared by the rows of a warp)."""
    if phased:
        return 16
    return min(64, max(16, triton.next_power_of_2(max(rows, 1))))


def _no_fp8_scales(name: str, t: torch.Tensor) -> None:
    """The scale dtypes the attention kernels take: fp16, bf16 or fp32 (not fp8)."""
    if t.dtype == torch.float8_e4m3fn:
        raise NotImplementedError(
            f"Expected {name} in one of {KERNEL_SCALE_DTYPES}, but got float8_e4m3fn: fp8 "
            "scales need their per-vector factor, which the kernel does not apply yet.")
    if t.dtype not in KERNEL_SCALE_DTYPES:
        raise TypeError(f"Expected {name} dtype in {KERNEL_SCALE_DTYPES}, but got {t.dtype}.")


def check_tile_tensors(tensors: dict, factors: dict, q: torch.Tensor, heads: int, cap: int,
                       group: int, dv: int, kb: int, vb: int, scale_rule) -> None:
    """One-line errors for the packed tiles ([B, H, N, ...], as ``QuantizedTiles.core``) of
    queries q [B, Hq, Tq, D]: each tensor's shape, device, contiguity and dtype (codes
    uint8; scales as ``scale_rule(name, tensor)`` allows; fp8 per-vector ``factors`` [B, H,
    N, 1] in the kernel scale dtypes). Shared by the attention launchers and the latent
    one."""
    bsz, _, _, d = q.shape
    expected = {
        "k_codes": (bsz, heads, cap, d, group * kb // 8),
        "k_row_scale": (bsz, heads, cap, d), "k_row_zero": (bsz, heads, cap, d),
        "k_col_scale": (bsz, heads, cap, group),
        "v_codes": (bsz, heads, cap, group, dv * vb // 8),
        "v_row_scale": (bsz, heads, cap, group), "v_row_zero": (bsz, heads, cap, group),
        "v_col_scale": (bsz, heads, cap, dv),
    }
    expected.update({name: (bsz, heads, cap, 1) for name in factors})
    for name, t in {**tensors, **factors}.items():
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"Expected {name} of shape {list(expected[name])} (B={bsz}, H={heads}, "
                             f"N={cap}, D={d}, Dv={dv}, G={group}), but got {list(t.shape)}.")
        if t.device != q.device:
            raise ValueError(f"Expected {name} on {q.device}, but got {t.device}.")
        if not t.is_contiguous():
            raise ValueError(f"Expected a contiguous {name}, but got strides {t.stride()}.")
        if name.endswith("codes"):
            if t.dtype != torch.uint8:
                raise TypeError(f"Expected {name} of dtype torch.uint8, but got {t.dtype}.")
        elif name.endswith("factor"):
            if t.dtype not in KERNEL_SCALE_DTYPES:
                raise TypeError(f"Expected {name} dtype in {KERNEL_SCALE_DTYPES}, but got {t.dtype}.")
        else:
            scale_rule(name, t)


def _tile_plan(q, k_codes, k_row_scale, k_row_zero, k_col_scale, v_codes, v_row_scale,
               v_row_zero, v_col_scale, n_tiles, k_plain, input_precision, block_m, split,
               block_n, prefetch, num_warps, k_bits=None, v_bits=None) -> _TilePlan:
    """The packed tiles' checks (one-line errors) and the tile loop's sizes, shared by the
    launchers: q [B, Hq, Tq, D] gives B, Hq, Tq and D; None picks each default."""
    bsz, hq, tq, d = q.shape
    if k_codes.dim() != 5:
        raise ValueError(f"Expected k_codes of shape [B, H, N, D, G*kb/8], but got "
                         f"{list(k_codes.shape)}.")
    heads, cap = k_codes.shape[1], k_codes.shape[2]
    group = k_col_scale.shape[-1] if k_col_scale.dim() == 4 else -1
    if heads < 1 or hq % heads:
        raise ValueError(f"Expected the query heads Hq={hq} to be a multiple of the kv heads "
                         f"H={heads}, but got Hq % H = {hq % max(heads, 1)}.")
    kb = _bits_of(k_codes, group, "K code") if group > 0 else 0
    dv = v_col_scale.shape[-1] if v_col_scale.dim() == 4 else d
    if dv < 1:
        raise ValueError(f"Expected v_col_scale [B, H, N, Dv] with Dv >= 1, but got "
                         f"{list(v_col_scale.shape)}.")
    vb = _bits_of(v_codes, dv, "V code")
    tensors = {"k_codes": k_codes, "k_row_scale": k_row_scale, "k_row_zero": k_row_zero,
               "k_col_scale": k_col_scale, "v_codes": v_codes, "v_row_scale": v_row_scale,
               "v_row_zero": v_row_zero, "v_col_scale": v_col_scale}
    check_tile_tensors(tensors, {}, q, heads, cap, group, dv, kb, vb, _no_fp8_scales)
    for name, given, got in (("k_bits", k_bits, kb), ("v_bits", v_bits, vb)):
        if given is not None and given != got:
            raise ValueError(f"Expected {name}={given} to match the packed rows, but the rows "
                             f"hold {got}-bit codes.")
    if group < 16 or group & (group - 1):
        raise NotImplementedError(
            f"Expected a power-of-two tile length G >= 16 for the Triton kernel, but got {group}.")
    if n_tiles.dtype not in (torch.int32, torch.int64) or tuple(n_tiles.shape) != (bsz,):
        raise ValueError(f"Expected n_tiles int32/int64 of shape [{bsz}], but got "
                         f"{n_tiles.dtype} {list(n_tiles.shape)}.")
    if n_tiles.device != q.device:
        raise ValueError(f"Expected n_tiles on {q.device}, but got {n_tiles.device}.")
    if input_precision is None:
        input_precision = CUDA_PRECISION if q.is_cuda else "ieee"
    if input_precision not in ("ieee", "tf32", "fp16"):
        raise ValueError(f"Expected input_precision 'ieee', 'tf32' or 'fp16', but got "
                         f"{input_precision!r}.")
    g = hq // heads
    rows = g * tq
    if block_m is None:
        block_m = default_block_m(rows, phased_decode(input_precision, loop_block_n(16, group),
                                                      kb, dv, vb))
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"Expected block_m a power of two >= 16, but got {block_m}.")
    if split is None:
        split = _default_splits(bsz * heads * triton.cdiv(rows, block_m), cap, q.device)
    block_n = loop_block_n(block_m, group) if block_n is None else block_n
    if block_n < 16 or block_n & (block_n - 1) or group % block_n:
        raise ValueError(f"Expected block_n a power of two >= 16 dividing G={group}, but got "
                         f"{block_n}.")
    if not isinstance(split, int) or isinstance(split, bool) or split < 1:
        raise ValueError(f"Expected num_splits a positive int, but got {split!r}.")
    phased = phased_decode(input_precision, block_n, kb, dv, vb)
    prefetch = DECODE_PREFETCH[phased] if prefetch is None else bool(prefetch)
    num_warps = loop_warps(phased, block_m, dv) if num_warps is None else num_warps
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"Expected num_warps 1, 2, 4, 8 or 16, but got {num_warps!r}.")
    if k_plain is not None and (tuple(k_plain.shape) != (bsz, heads, cap)
                                or k_plain.dtype != torch.uint8 or k_plain.device != q.device):
        raise ValueError(f"Expected k_plain uint8 of shape [{bsz}, {heads}, {cap}] on {q.device}, "
                         f"but got {k_plain.dtype} {list(k_plain.shape)} on {k_plain.device}.")
    return _TilePlan(heads, cap, group, dv, kb, vb, input_precision, block_m, split, block_n,
                     phased, prefetch, num_warps)


def _bits_of(codes: torch.Tensor, row_len: int, what: str) -> int:
    """Code width from a packed row: bytes * 8 / codes per row."""
    nbytes = codes.shape[-1]
    if (nbytes * 8) % row_len or (nbytes * 8) // row_len not in KERNEL_BITS:
        raise ValueError(f"Expected {what} rows of {row_len} codes packed at 2, 4 or 8 bits "
                         f"({[row_len * b // 8 for b in KERNEL_BITS]} bytes), but got "
                         f"{nbytes} bytes per row.")
    return nbytes * 8 // row_len


def kvarn_decode_attention(
    q_rot: torch.Tensor,
    k_codes: torch.Tensor,
    k_row_scale: torch.Tensor,
    k_row_zero: torch.Tensor,
    k_col_scale: torch.Tensor,
    v_codes: torch.Tensor,
    v_row_scale: torch.Tensor,
    v_row_zero: torch.Tensor,
    v_col_scale: torch.Tensor,
    n_tiles: torch.Tensor,
    *,
    scale: float,
    k_bits: int | None = None,
    v_bits: int | None = None,
    num_splits: int | None = None,
    kv_start: torch.Tensor | None = None,
    block_m: int | None = None,
    input_precision: str | None = None,
    return_partials: bool = False,
    q_plain: torch.Tensor | None = None,
    k_plain: torch.Tensor | None = None,
    kv_end: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    block_n: int | None = None,
    prefetch: bool | None = None,
    num_warps: int | None = None,
):
    """Attention of rotated queries over the packed quantized region of a KVarN cache.

    Args:
        q_rot: fp32 [B, Hq, Tq, D], already rotated (q @ H), not pre-scaled.
        k_codes, k_row_scale, k_row_zero, k_col_scale: K tiles, uint8 [B, H, N, D, G*kb/8],
            [B, H, N, D], [B, H, N, D], [B, H, N, G] (fp16/bf16/fp32 scales), contiguous.
        v_codes, v_row_scale, v_row_zero, v_col_scale: V tiles, uint8 [B, H, N, G, Dv*vb/8],
            [B, H, N, G], [B, H, N, G], [B, H, N, Dv], contiguous. Dv, the values' head dim,
            is read from v_col_scale; it may differ from D (MLA-style caches: D = 192,
            Dv = 128): the V tiles are then in the frame of ``rotation_matrix(Dv)``, and the
            caller rotates the output back with that matrix.
        n_tiles: int32/int64 [B], valid tiles per batch row (values are clamped to [0, N]).
        scale: softmax scale (e.g. D ** -0.5).
        k_bits, v_bits: optional; inferred from the packed row lengths and checked if given.
        num_splits: SPLIT, tiles ranges walked in parallel; default: 1 on CPU, about two
            waves of programs on a GPU.
        kv_start: optional int32/int64 [B, Tq]: query t of row b sees only quantized tokens
            with index j * G + t' >= kv_start[b, t] (sliding window); None: all.
        block_m: query rows per program (power of two >= 16); default
            min(64, next_pow2(g * Tq)) with g = Hq // H.
        input_precision: "ieee" (exact fp32 dots), "tf32" or "fp16" (fp16 operands, fp32
            sums: tf32's significand with fp16's range, fewer instructions; see
            ``_packed_dot``); default: :data:`CUDA_PRECISION` on a GPU, "ieee" otherwise.
        return_partials: also return the per-split (o [B, Hq, Tq, SPLIT, Dv], lse [..., SPLIT]).
        q_plain, k_plain: per-tile key frames (``key_frame="auto"`` caches): k_plain uint8
            [B, H, N], 1 where a K tile is stored un-rotated; those tiles are scored with
            q_plain (the un-rotated queries, fp32, same shape and strides as q_rot). Values
            are always rotated, so the output stays in the rotated frame.
        kv_end: optional int32/int64 [B, Tq]: query t of row b sees only quantized tokens
            with index < kv_end[b, t] (causality inside the quantized region, e.g. a prefill
            chunk that froze its own tokens); None: all.
        bias: optional mask [B, Hq or 1, Tq, N * G] over the quantized tokens (token stride
            1): additive in natural-log units in any float dtype (-inf hides a token), or bool
            (True attends).
        block_n: tokens per loop step, a power of two >= 16 dividing G (default
            :func:`loop_block_n`).
        prefetch: issue the next step's loads before this step's math (default: off for the
            phased fp16 loop, :func:`phased_decode`, on otherwise: ``DECODE_PREFETCH``).
        num_warps: warps per program (default :func:`loop_warps`).

    Returns:
        (out_rot fp32 [B, Hq, Tq, Dv] normalized over the quantized region only (in the
         values' rotated frame),
         lse fp32 [B, Hq, Tq] natural log of sum exp(scale * q·k)); rows with no visible
        token give out = 0 and lse = -inf. With ``return_partials``, (out, lse, o_part, lse_part).
    """
    if q_rot.dim() != 4:
        raise ValueError(f"Expected q_rot of shape [B, Hq, Tq, D], but got {list(q_rot.shape)}.")
    if q_rot.dtype != torch.float32:
        raise TypeError(f"Expected q_rot of dtype torch.float32, but got {q_rot.dtype}.")
    if q_rot.stride(-1) != 1:
        raise ValueError(f"Expected q_rot with a unit last stride, but got {q_rot.stride()}.")
    bsz, hq, tq, d = q_rot.shape
    plan = _tile_plan(q_rot, k_codes, k_row_scale, k_row_zero, k_col_scale, v_codes, v_row_scale,
                      v_row_zero, v_col_scale, n_tiles, k_plain, input_precision, block_m,
                      num_splits, block_n, prefetch, num_warps, k_bits, v_bits)
    heads, cap, group, dv, kb, vb = plan[:6]
    input_precision, block_m, split, block_n, phased, prefetch, num_warps = plan[6:]
    g = hq // heads
    rows = g * tq
    if kv_start is not None:
        if kv_start.dtype not in (torch.int32, torch.int64) or tuple(kv_start.shape) != (bsz, tq):
            raise ValueError(f"Expected kv_start int32/int64 of shape [{bsz}, {tq}], but got "
                             f"{kv_start.dtype} {list(kv_start.shape)}.")
        if kv_start.device != q_rot.device:
            raise ValueError(f"Expected kv_start on {q_rot.device}, but got {kv_start.device}.")
        kv_start = kv_start.contiguous()
    if kv_end is not None:
        if kv_end.dtype not in (torch.int32, torch.int64) or tuple(kv_end.shape) != (bsz, tq):
            raise ValueError(f"Expected kv_end int32/int64 of shape [{bsz}, {tq}], but got "
                             f"{kv_end.dtype} {list(kv_end.shape)}.")
        if kv_end.device != q_rot.device:
            raise ValueError(f"Expected kv_end on {q_rot.device}, but got {kv_end.device}.")
        kv_end = kv_end.contiguous()
    if bias is not None:
        if not (bias.is_floating_point() or bias.dtype == torch.bool) or bias.dim() != 4 \
                or bias.shape[0] != bsz or bias.shape[1] not in (1, hq) or bias.shape[2] != tq \
                or bias.shape[3] != cap * group or bias.stride(-1) != 1:
            raise ValueError(f"Expected a float or bool bias [{bsz}, {hq} or 1, {tq}, "
                             f"{cap * group}] with a unit last stride, but got {bias.dtype} "
                             f"{list(bias.shape)} {bias.stride()}.")
        if bias.device != q_rot.device:
            raise ValueError(f"Expected bias on {q_rot.device}, but got {bias.device}.")
    if (q_plain is None) != (k_plain is None):
        raise ValueError("Expected q_plain and k_plain together (per-tile key frames), or neither.")
    if k_plain is not None:
        if q_plain.shape != q_rot.shape or q_plain.stride() != q_rot.stride() \
                or q_plain.dtype != torch.float32:
            raise ValueError(f"Expected q_plain fp32 with the shape and strides of q_rot "
                             f"{list(q_rot.shape)} {q_rot.stride()}, but got {q_plain.dtype} "
                             f"{list(q_plain.shape)} {q_plain.stride()}.")
        if q_plain.device != q_rot.device:
            raise ValueError(f"Expected q_plain on {q_rot.device}.")
        k_plain = k_plain.contiguous()
    dev = q_rot.device
    o_part = torch.empty(bsz, hq, tq, split, dv, dtype=torch.float32, device=dev)
    lse_part = torch.empty(bsz, hq, tq, split, dtype=torch.float32, device=dev)
    if o_part.numel() or lse_part.numel():
        grid = (bsz * heads, split, triton.cdiv(rows, block_m))
        _kvarn_decode_attn_kernel[grid](
            q_rot, q_rot.stride(0), q_rot.stride(1), q_rot.stride(2),
            k_codes, k_row_scale, k_row_zero, k_col_scale,
            v_codes, v_row_scale, v_row_zero, v_col_scale,
            n_tiles, kv_start if kv_start is not None else n_tiles,
            kv_end if kv_end is not None else n_tiles,
            bias if bias is not None else q_rot,
            *((bias.stride(0), bias.stride(1) if bias.shape[1] > 1 else 0, bias.stride(2))
              if bias is not None else (0, 0, 0)),
            q_plain if q_plain is not None else q_rot, k_plain if k_plain is not None else n_tiles,
            o_part, lse_part,
            float(scale) * math.log2(math.e), heads, cap, tq,
            GROUP_Q=g, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), DV=dv,
            BLOCK_DV=max(16, triton.next_power_of_2(dv)), G=group,
            K_BITS=kb, V_BITS=vb, SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n, PREFETCH=prefetch,
            HAS_KV_START=kv_start is not None, HAS_KV_END=kv_end is not None,
            HAS_BIAS=bias is not None, HAS_K_PLAIN=k_plain is not None,
            INPUT_PRECISION=input_precision, PHASED=phased,
            num_warps=num_warps,
        )
    out, lse = combine_splits(o_part, lse_part)
    if return_partials:
        return out, lse, o_part, lse_part
    return out, lse


def kvarn_attention(
    q: torch.Tensor,
    sink_k: torch.Tensor, sink_v: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor,
    lengths: torch.Tensor, n_tiles: torch.Tensor,
    k_codes: torch.Tensor, k_row_scale: torch.Tensor, k_row_zero: torch.Tensor,
    k_col_scale: torch.Tensor,
    v_codes: torch.Tensor, v_row_scale: torch.Tensor, v_row_zero: torch.Tensor,
    v_col_scale: torch.Tensor,
    rot: torch.Tensor, rot_v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    window: int,
    mask: torch.Tensor | None = None,
    k_plain: torch.Tensor | None = None,
    error_flags: torch.Tensor | None = None,
    error_bit: int = 0,
    num_splits: int | None = None,
    input_precision: str | None = None,
    block_n: int | None = None,
    prefetch: bool | None = None,
    num_warps: int | None = None,
    return_lse: bool = False,
):
    """``kvarn::attention`` over a whole packed cache (exact sink and tail ring, packed
    tiles) in one kernel launch (:func:`_kvarn_attn_kernel`), plus the zeroing of its
    per-block counters. A prompt's launch (one split, several query blocks) runs FUSED: one
    program per block for all of it, no partials or counters.

    Args:
        q: [B, Hq, Tq, D] queries as the model gives them (fp16, bf16, fp32 or fp64, computed
            in fp32; last stride 1), not rotated: the kernel rotates them (``rot``) for the
            tiles.
        sink_k, sink_v, tail_k, tail_v: the exact region, contiguous [B, H, S, D],
            [B, H, S, Dv], [B, H, W, D], [B, H, W, Dv] (one dtype).
        lengths, n_tiles: int [B]: tokens written and tiles packed per batch row.
        k_codes ... v_col_scale: the packed tiles, as :func:`kvarn_decode_attention` takes them.
        rot, rot_v: fp32 [D, D] and [Dv, Dv] rotations (``rotation_matrix``), contiguous.
        scale, causal, window: as ``kvarn::attention`` (query t of row b sits at position
            lengths[b] - Tq + t; window 0: none).
        mask: optional bool (True attends) or additive float mask broadcastable to
            [B, Hq, Tq, M], read in place with its own strides; M must cover every row's
            length (``error_flags`` records a shorter one: nothing past M is read).
        k_plain: uint8 [B, H, N], per-tile key frames (1: the K tile is not rotated).
        error_flags, error_bit: an int32 device tensor OR-ed with ``error_bit`` when a row's
            length exceeds the mask's M (the unchecked CUDA steps); None: not recorded.
        num_splits, input_precision, block_n, prefetch, num_warps: the tile loop's, as
            :func:`kvarn_decode_attention`.
        return_lse: also return the natural-log lse [B, Hq, Tq] (fp32).

    Returns:
        out [B, Hq, Tq, Dv] in q's dtype (0 for a row that sees nothing), and with
        ``return_lse`` its lse (-inf for such a row).
    """
    if q.dim() != 4 or q.stride(-1) != 1 or not q.is_floating_point() or q.element_size() < 2:
        raise ValueError(f"Expected float queries q [B, Hq, Tq, D] with a unit last stride, but "
                         f"got {q.dtype} {list(q.shape)} {q.stride()}.")
    bsz, hq, tq, d = q.shape
    if sink_k.dim() != 4 or tail_k.dim() != 4:
        raise ValueError(f"Expected sink_k [B, H, S, D] and tail_k [B, H, W, D], but got "
                         f"{list(sink_k.shape)} and {list(tail_k.shape)}.")
    heads, s_len, w_len = sink_k.shape[1], sink_k.shape[2], tail_k.shape[2]
    dv = v_col_scale.shape[-1]
    exact = {"sink_k": (sink_k, (bsz, heads, s_len, d)), "sink_v": (sink_v, (bsz, heads, s_len, dv)),
             "tail_k": (tail_k, (bsz, heads, w_len, d)), "tail_v": (tail_v, (bsz, heads, w_len, dv)),
             "rot": (rot, (d, d)), "rot_v": (rot_v, (dv, dv))}
    for name, (t, shape) in exact.items():
        if tuple(t.shape) != shape or not t.is_contiguous() or t.device != q.device:
            raise ValueError(f"Expected a contiguous {name} of shape {list(shape)} on {q.device}, "
                             f"but got {list(t.shape)} {t.stride()} on {t.device}.")
        if name.startswith("rot") and t.dtype != torch.float32:
            raise TypeError(f"Expected {name} of dtype torch.float32, but got {t.dtype}.")
        if not name.startswith("rot") and t.dtype != sink_k.dtype:
            raise TypeError(f"Expected the exact region in one dtype, but got sink_k "
                            f"{sink_k.dtype} and {name} {t.dtype}.")
    for name, t in (("lengths", lengths), ("n_tiles", n_tiles)):
        if t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != (bsz,) \
                or t.device != q.device:
            raise ValueError(f"Expected {name} int32/int64 of shape [{bsz}] on {q.device}, but "
                             f"got {t.dtype} {list(t.shape)} on {t.device}.")
    plan = _tile_plan(q, k_codes, k_row_scale, k_row_zero, k_col_scale, v_codes, v_row_scale,
                      v_row_zero, v_col_scale, n_tiles, k_plain, input_precision, None,
                      num_splits, block_n, prefetch, num_warps)
    if plan.heads != heads:
        raise ValueError(f"Expected the tiles' kv heads ({plan.heads}) to match the sink's ({heads}).")
    split, block_m = plan.split, plan.block_m
    m_blocks = triton.cdiv((hq // heads) * tq, block_m)
    m4 = None
    strides = (0, 0, 0, 0)
    if mask is not None:
        if mask.dim() > 4 or mask.dim() < 1 or mask.device != q.device or not (
                mask.dtype == torch.bool or mask.is_floating_point()):
            raise ValueError(f"Expected a bool or float mask broadcastable to [{bsz}, {hq}, {tq}, "
                             f"M] on {q.device}, but got {mask.dtype} {list(mask.shape)}.")
        m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        for size, full in zip(m4.shape[:3], (bsz, hq, tq)):
            if size not in (1, full):
                raise ValueError(f"Expected a mask broadcastable to [{bsz}, {hq}, {tq}, M], but "
                                 f"got {list(mask.shape)}.")
        strides = tuple(0 if m4.shape[i] == 1 else m4.stride(i) for i in range(3)) + (m4.stride(3),)
    dev = q.device
    out = torch.empty(bsz, hq, tq, dv, dtype=q.dtype, device=dev)
    lse = torch.empty(bsz, hq, tq, dtype=torch.float32, device=dev)
    if out.numel():
        # a prompt (one split: its query blocks fill the GPU by themselves) runs FUSED, one
        # program per block doing tiles, exact region and output: no partials, which at
        # 32k tokens and 32 heads were 3.8 GB (7 slots of fp32 per query row). Otherwise
        # the exact region is shared by several programs (one per 64 slots) where they help
        # fill the GPU
        fused = split == 1 and m_blocks > 1
        exact = 1 if fused else exact_splits(s_len + w_len)
        slots = 0 if fused else split + exact
        # the rotated q of a block of up to 16 rows goes through scratch (fp32, the size of
        # q times the splits), and with key frames or a head dim that is not a power of two
        # any block's (the loop reads it there); else a larger block takes the dot's
        # layout. FUSED also stages the exact region's output there
        block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
        q_scratch = block_m <= 16 or k_plain is not None or block_d != d or block_d > 128 \
            or fused
        scratch_w = max(block_d, block_dv)
        o_part = torch.empty(bsz, hq, tq, slots, dv, dtype=torch.float32, device=dev)
        lse_part = torch.empty(bsz, hq, tq, slots, dtype=torch.float32, device=dev)
        counts = torch.zeros(0 if fused else bsz * heads * m_blocks, dtype=torch.int32,
                             device=dev)
        _kvarn_attn_kernel[(bsz * heads, 1 if fused else split + exact, m_blocks)](
            q, q.stride(0), q.stride(1), q.stride(2), rot, rot_v,
            sink_k, sink_v, tail_k, tail_v, lengths, n_tiles,
            k_codes, k_row_scale, k_row_zero, k_col_scale,
            v_codes, v_row_scale, v_row_zero, v_col_scale,
            k_plain if k_plain is not None else n_tiles,
            m4 if m4 is not None else q, *strides, m4.shape[-1] if m4 is not None else 0,
            o_part, lse_part, counts, out, lse,
            error_flags if error_flags is not None else lse,     # (read only with MASK_FLAG)
            torch.empty(bsz * heads * split * m_blocks * block_m * scratch_w
                        if q_scratch or fused else 0, dtype=torch.float32, device=dev),
            float(scale) * math.log2(math.e), heads, plan.cap, tq, s_len, w_len, int(window),
            m_blocks,
            GROUP_Q=hq // heads, D=d, BLOCK_D=block_d, DV=dv, BLOCK_DV=block_dv,
            G=plan.group, K_BITS=plan.k_bits,
            V_BITS=plan.v_bits, SPLIT=split, EXACT=exact, BLOCK_M=block_m, BLOCK_N=plan.block_n,
            BLOCK_E=EXACT_BLOCK,
            PREFETCH=plan.prefetch, CAUSAL=bool(causal), MULTI=tq > 1, HAS_WINDOW=window > 0,
            HAS_MASK=m4 is not None,
            MASK_ROW=m4 is not None and strides[1] == 0 and (tq == 1 or strides[2] == 0),
            MASK_FLAG=m4 is not None and error_flags is not None,
            ERR_MASK=int(error_bit), HAS_K_PLAIN=k_plain is not None,
            INPUT_PRECISION=plan.input_precision, PHASED=plan.phased, Q_SCRATCH=q_scratch,
            FUSED=fused, SCRATCH_W=scratch_w, num_warps=plan.num_warps)
    return (out, lse) if return_lse else out


def kvarn_decode_attention_tiles(q_rot: torch.Tensor, k: QuantizedTiles, v: QuantizedTiles,
                                 n_tiles: torch.Tensor, *, scale: float, **kwargs):
    """:func:`kvarn_decode_attention` from K/V ``QuantizedTiles`` [B, H, N, ...]."""
    for name, t in (("k", k), ("v", v)):
        if t.row_scale_factor is not None or t.col_scale_factor is not None:
            raise NotImplementedError(
                f"Expected {name} tiles with fp16/bf16/fp32 scales, but got fp8 scales with "
                "per-vector factors; the kernel does not apply them yet (use the reference).")
    if k.plain is not None and "k_plain" not in kwargs:
        kwargs["k_plain"] = k.plain
    return kvarn_decode_attention(q_rot, k.codes, k.row_scale, k.row_zero, k.col_scale,
                                  v.codes, v.row_scale, v.row_zero, v.col_scale, n_tiles,
                                  scale=scale, k_bits=k.bits, v_bits=v.bits, **kwargs)
