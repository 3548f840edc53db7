"""Triton kernel: split-K attention of ``kvarn::latent_attention`` over packed latent tiles.

Multi-head latent attention in its absorbed form (DeepSeek MLA) over a *latent state*: a
KVarN layer state whose keys are the normed latent (D = kv_lora_rank) and whose values are
the shared RoPE key (Dv = the RoPE dim, stored at 8 bits). For the queries q [B, Hq, Tq, D]
(latent space) and q_pe [B, Hq, Tq, Dv]::

    out = softmax(scale * (q · latentᵀ + q_pe · ropeᵀ) + mask) · latent      [B, Hq, Tq, D]

Like :mod:`.attention` this covers the *packed tiles only*; the caller attends the exact
sink and tail in torch and merges by log-sum-exp (``ops.dispatch.latent_attention_cuda`` does
it all, with ``ops.dispatch.merge_latent_partials``).

One packed copy of the latent serves both sides. Per tile, with the dual-scale fold of
:mod:`kvarn_compile.ops.attention` (``tile_scores`` + ``tile_value_scores`` for the scores,
``tile_key_values`` for the output)::

    K̂[c, t] = (code_k[c, t] * rs_k[c] + rz_k[c]) * cs_k[t]     latent tile [D, G]
    R̂[t, c] = (code_v[t, c] * rs_v[t] + rz_v[t]) * cs_v[c]     RoPE-key tile [G, Dv]

    s[t]   = scale * ( cs_k[t] * ((q * rs_k) @ code_k[:, t] + q @ rz_k)
                     + rs_v[t] * ((q_pe * cs_v) @ code_v[t, :]) + rz_v[t] * sum(q_pe * cs_v) )
    acc[c] += rs_k[c] * ((p * cs_k) @ code_k[c, :]) + rz_k[c] * sum(p * cs_k)

with an online softmax (p = exp(s - m)). The latent codes of a step are unpacked once and
scaled by their channel's scale, kt = code_k * rs_k (fp16 with the "fp16" operands, the GPU
default: exact integer codes times an fp16 scale, rounded once), and kt feeds both matmuls:
the scores (q [BLOCK_M, D] @ kt [D, BLOCK_N]) and the output (its transpose, as
kt [D, BLOCK_N] @ (p * cs_k)ᵀ [BLOCK_N, BLOCK_M]: the accumulator is kept [D, BLOCK_M]). The
zero-point terms (q @ rz_k, rowsum(p * cs_k) * rz_k: large for un-rotated tiles with offset
channels) and all softmax math stay in fp32.

D is wide (512) and a decode block has few query rows, so both matmuls are batched over
channel blocks of the latent (BLOCK_DC channels each): the warps split the blocks (a
[16, 512] x [512, 32] matmul would give every warp the whole query block as its operand:
spills), the block scores are summed (:func:`_latent_range`).

Frames. q and the output are in the latent tile's frame: rotated (q @ H_D, output rotated
back with H_Dᵀ) or, for a tile whose ``k_plain`` flag is set (``key_frame="auto"``), plain
(un-rotated q, output not rotated back). The RoPE tiles are always rotated (q_pe @ H_Dv). A
program never mixes frames: with per-tile key frames the grid has a frame axis, and the
program of frame f walks only the tiles of that frame (a compacted list of tile ids built
in torch, :func:`frame_tile_lists`), so it holds one query block and one accumulator, and
reads each tile once. The partials of the two frames are merged by lse after rotating the
rotated frame's back (``ops.dispatch.merge_latent_partials``), which is exact: the merge is
linear in the outputs.

Layout of one program: the query rows of one kv head (its Hq / H query heads x Tq query
positions, row m = head * Tq + t), BLOCK_M of them; BLOCK_N tokens per step (a divisor of
G), the next step's loads in flight during this one's math (``PREFETCH``). The configs and
their sm_90 register / spill numbers: :func:`default_config`.

Public:

* :func:`latent_tile_partials` - the tile partials (o_part, lse_part) per frame and split;
* :func:`frame_tile_lists` - the per-frame tile lists of a state with key frames.

(The whole op, exact region + tiles + merge, is composed in the ops floor:
``ops.dispatch.latent_attention_cuda``.)

The jit body :func:`_latent_range` is written for reuse from an Inductor template (as
``attention._decode_range`` is): it takes the query block in registers, the tile pointers
of one (batch row, kv head) with their tile strides and a range of tiles (or of a tile id
list), and returns the online-softmax state (m, l, acc).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvarn_compile.kernels import CUDA_PRECISION
from kvarn_compile.kernels.triton.attention import (
    _bits_of, _load_tile_part, _mask_scores, _unpack_bytes, _unpack_bytes_f16, check_tile_tensors,
)
from kvarn_compile.kernels.triton.quantize import KERNEL_SCALE_DTYPES

#: (major, minor) of the installed triton: the latent channel block's default depends on it.
_TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])

__all__ = ["latent_tile_partials", "frame_tile_lists", "default_config", "LATENT_SCALE_DTYPES"]

_LN2 = tl.constexpr(0.6931471805599453)

#: Scale dtypes the latent kernel reads (fp8 with its per-vector factors, see the launcher).
LATENT_SCALE_DTYPES = KERNEL_SCALE_DTYPES + (torch.float8_e4m3fn,)


# ------------------------------------------------------------------------------------------
# The tile loop, shared by the standalone kernel and (later) an Inductor template
# ------------------------------------------------------------------------------------------
@triton.jit
def _code_operand(byte, R: tl.constexpr, NC: tl.constexpr, BITS: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr):
    """Packed bytes [R, NC * BITS / 8] -> the codes [R, NC] as exact numbers in the dot's
    operand type: fp16 for "fp16" (1024 + code by the exponent-bias trick of
    ``attention._unpack_bytes_f16``, minus 1024: exact, one fp16 op per code), fp32 else."""
    if INPUT_PRECISION == "fp16":
        codes = _unpack_bytes_f16(byte, R, NC, BITS) - 1024.0
    else:
        codes = _unpack_bytes(byte.to(tl.int32), R, NC, BITS).to(tl.float32)
    return codes


@triton.jit
def _operand(x, INPUT_PRECISION: tl.constexpr):
    """x as a matmul operand: fp16 for "fp16", else as it is (fp32)."""
    if INPUT_PRECISION == "fp16":
        x = x.to(tl.float16)
    return x


@triton.jit
def _mma(a, b, acc, INPUT_PRECISION: tl.constexpr):
    """acc + a @ b for operands from :func:`_operand` / :func:`_code_operand`, fp32 sums."""
    if INPUT_PRECISION == "fp16":
        out = tl.dot(a, b, acc, out_dtype=tl.float32)
    else:
        out = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return out


@triton.jit
def _load_latent_chunk(kc, krs, krz, kcs, vc, vrs, vrz, vcs, krf, kcf, vrf, vcf, ids,
                       s_kc, s_krs, s_krz, s_kcs, s_vc, s_vrs, s_vrz, s_vcs, s_f, it, ok,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr,
                       BLOCK_DV: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
                       K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                       HAS_FACTORS: tl.constexpr, INDIRECT: tl.constexpr):
    """Issue every load of step ``it``: tokens (it % CH) * BLOCK_N + [0, BLOCK_N) of the
    tile at position it // CH of the walk (CH = G // BLOCK_N): that tile itself, or with
    INDIRECT the tile ids[it // CH]. ``ok`` (0/1 int) = 0 reads nothing (zeros).

    Returns (tile index j (int64), latent bytes [BLOCK_D, BLOCK_N * K_BITS / 8], rs_k
    [BLOCK_D], rz_k [BLOCK_D], cs_k [BLOCK_N], RoPE bytes [BLOCK_N, BLOCK_DV * V_BITS / 8],
    rs_v [BLOCK_N], rz_v [BLOCK_N], cs_v [BLOCK_DV]) with HAS_FACTORS's fp8 per-vector
    factors applied to the four scales (fp32)."""
    CH: tl.constexpr = G // BLOCK_N
    pos = it // CH
    if INDIRECT:
        j = tl.load(ids + pos * ok).to(tl.int64)
    else:
        j = pos.to(tl.int64)
    kbyte, k_rs, k_rz, k_cs, vbyte, v_rs, v_rz, v_cs = _load_tile_part(
        kc, krs, krz, kcs, vc, vrs, vrz, vcs, s_kc, s_krs, s_krz, s_kcs, s_vc, s_vrs, s_vrz,
        s_vcs, j, (it % CH) * BLOCK_N, ok, D, BLOCK_D, DV, BLOCK_DV, G, BLOCK_N, K_BITS, V_BITS)
    k_rs, k_rz, k_cs = k_rs.to(tl.float32), k_rz.to(tl.float32), k_cs.to(tl.float32)
    v_rs, v_rz, v_cs = v_rs.to(tl.float32), v_rz.to(tl.float32), v_cs.to(tl.float32)
    if HAS_FACTORS:
        jf = j * s_f * ok
        k_rs = k_rs * tl.load(krf + jf).to(tl.float32)
        k_cs = k_cs * tl.load(kcf + jf).to(tl.float32)
        v_rs = v_rs * tl.load(vrf + jf).to(tl.float32)
        v_cs = v_cs * tl.load(vcf + jf).to(tl.float32)
    return j, kbyte, k_rs, k_rz, k_cs, vbyte, v_rs, v_rz, v_cs


@triton.jit
def _latent_range(q, q_pe, kc, krs, krz, kcs, vc, vrs, vrz, vcs, krf, kcf, vrf, vcf, ids,
                  s_kc, s_krs, s_krz, s_kcs, s_vc, s_vrs, s_vrz, s_vcs, s_f,
                  start, end, m_valid, kv_lo, kv_hi, bias_rows, s_bias, qk_scale,
                  BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DC: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                  G: tl.constexpr, BLOCK_N: tl.constexpr, K_BITS: tl.constexpr,
                  V_BITS: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HAS_FACTORS: tl.constexpr, INDIRECT: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr):
    """Online-softmax latent attention of one query block over tiles [start, end) of one
    (batch row, kv head): returns (m, l, acc) in log2 units, acc [NC, BLOCK_DC, BLOCK_M]: the
    latent's channels in NC = BLOCK_D / BLOCK_DC blocks (channel c * BLOCK_DC + i of row m at
    [c, i, m]), in the frame of the tiles walked (the caller walks the tiles of one frame
    and passes q in that frame), not yet divided by l.

    q [NC, BLOCK_M, BLOCK_DC] fp32: the latent-space queries in the walked tiles' frame, in
    channel blocks (channel c * BLOCK_DC + i of row m at [c, m, i]: :func:`_blocked_rows`);
    q_pe [BLOCK_M, BLOCK_DV] fp32: the RoPE queries, rotated (q_pe @ H_Dv). D / BLOCK_D:
    the latent's width and its power-of-two padding (padded channels: q = 0, scales 0);
    DV / BLOCK_DV: the RoPE key's.

    Why channel blocks: the latent is wide (D = 512) and a decode block has few query rows
    (16). As one [BLOCK_M, 512] x [512, BLOCK_N] matmul every warp would hold the whole
    query block as its operand (the warps can only split the 16-64 output columns); as NC
    matmuls batched over the channel blocks, the warps split the blocks, and the output
    matmul's accumulator is split the same way. The blocks' scores are summed.

    The tile pointers (kc .. vcs; the fp8 factors krf .. vcf with HAS_FACTORS, [.., N, 1],
    tile stride s_f) address tile 0 of this (batch row, kv head); s_* are the tile strides.
    Without INDIRECT, [start, end) are tile indices; with INDIRECT, positions in the tile
    id list ``ids`` (int32, the tiles of one frame, ascending). The walk goes BLOCK_N tokens
    (a step) at a time; with PREFETCH the next step's loads are issued before this step's
    math (register double buffering, as ``attention._decode_range``). Per step::

        kt  = code_k * rs_k                                   [D, BLOCK_N], unpacked once
        s   = qk_scale * (cs_k * (q @ kt + rowsum(q * rz_k))
                          + rs_v * ((q_pe * cs_v) @ code_vᵀ) + rz_v * rowsum(q_pe * cs_v))
        acc = acc * alpha + kt @ (p * cs_k)ᵀ + rz_k * rowsum(p * cs_k)

    Masks: row m sees token t (= tile * G + offset) when kv_lo[m] <= t (HAS_LO) and
    t < kv_hi[m] (HAS_HI); HAS_BIAS adds bias_rows[m] + t * s_bias (natural-log units).
    Rows that see nothing keep m = -inf, l = 0, acc = 0.
    """
    CH: tl.constexpr = G // BLOCK_N
    NC: tl.constexpr = BLOCK_D // BLOCK_DC
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([NC, BLOCK_DC, BLOCK_M], dtype=tl.float32)
    q_op = _operand(q, INPUT_PRECISION)       # the score matmul's operand, loop-invariant
    it0 = start * CH
    it1 = end * CH
    if PREFETCH:
        j, kbyte, k_rs, k_rz, k_cs, vbyte, v_rs, v_rz, v_cs = _load_latent_chunk(
            kc, krs, krz, kcs, vc, vrs, vrz, vcs, krf, kcf, vrf, vcf, ids, s_kc, s_krs, s_krz,
            s_kcs, s_vc, s_vrs, s_vrz, s_vcs, s_f, it0, (it0 < it1).to(tl.int32), D, BLOCK_D,
            DV, BLOCK_DV, G, BLOCK_N, K_BITS, V_BITS, HAS_FACTORS, INDIRECT)
    for it in range(it0, it1):
        if PREFETCH:
            c_j, c_kbyte, c_k_rs, c_k_rz, c_k_cs = j, kbyte, k_rs, k_rz, k_cs
            c_vbyte, c_v_rs, c_v_rz, c_v_cs = vbyte, v_rs, v_rz, v_cs
            # the next step's loads first (the last step reloads itself: never out of range)
            j, kbyte, k_rs, k_rz, k_cs, vbyte, v_rs, v_rz, v_cs = _load_latent_chunk(
                kc, krs, krz, kcs, vc, vrs, vrz, vcs, krf, kcf, vrf, vcf, ids, s_kc, s_krs,
                s_krz, s_kcs, s_vc, s_vrs, s_vrz, s_vcs, s_f, tl.minimum(it + 1, it1 - 1),
                (it < it1).to(tl.int32), D, BLOCK_D, DV, BLOCK_DV, G, BLOCK_N, K_BITS, V_BITS,
                HAS_FACTORS, INDIRECT)
        else:
            c_j, c_kbyte, c_k_rs, c_k_rz, c_k_cs, c_vbyte, c_v_rs, c_v_rz, c_v_cs = \
                _load_latent_chunk(
                    kc, krs, krz, kcs, vc, vrs, vrz, vcs, krf, kcf, vrf, vcf, ids, s_kc, s_krs,
                    s_krz, s_kcs, s_vc, s_vrs, s_vrz, s_vcs, s_f, it, (it < it1).to(tl.int32),
                    D, BLOCK_D, DV, BLOCK_DV, G, BLOCK_N, K_BITS, V_BITS, HAS_FACTORS,
                    INDIRECT)
        # ---- the latent codes of this step, unpacked once and scaled by their channel's
        # scale: kt = code_k * rs_k [NC, BLOCK_DC, BLOCK_N], the operand of both matmuls
        codes_k = _code_operand(c_kbyte, BLOCK_D, BLOCK_N, K_BITS, INPUT_PRECISION)
        kt = tl.reshape(codes_k * _operand(c_k_rs, INPUT_PRECISION)[:, None],
                        [NC, BLOCK_DC, BLOCK_N])
        rz = tl.reshape(c_k_rz, [NC, 1, BLOCK_DC])
        part = _mma(q_op, kt, tl.broadcast_to(tl.sum(q * rz, axis=2)[:, :, None],
                                              [NC, BLOCK_M, BLOCK_N]), INPUT_PRECISION)
        s = tl.sum(part, axis=0) * c_k_cs[None, :]
        # ---- the RoPE part: [BLOCK_M, BLOCK_DV] x [BLOCK_DV, BLOCK_N]
        codes_v = _code_operand(c_vbyte, BLOCK_N, BLOCK_DV, V_BITS, INPUT_PRECISION)
        q_c = q_pe * c_v_cs[None, :]
        s += (_mma(_operand(q_c, INPUT_PRECISION), tl.trans(codes_v),
                   tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), INPUT_PRECISION)
              * c_v_rs[None, :] + tl.sum(q_c, axis=1)[:, None] * c_v_rz[None, :])
        s = s * qk_scale
        tok = c_j * G + (it % CH) * BLOCK_N + offs_n
        s = _mask_scores(s, tok, m_valid, kv_lo, kv_hi, bias_rows, s_bias, HAS_BIAS, HAS_LO,
                         HAS_HI)
        # ---- online softmax (a row with every score -inf keeps p = 0, alpha = 0: no NaN)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        # ---- the output from the same operand: [NC, BLOCK_DC, BLOCK_N] x [NC, BLOCK_N, BLOCK_M]
        w = p * c_k_cs[None, :]
        w3 = tl.broadcast_to(tl.trans(_operand(w, INPUT_PRECISION))[None, :, :],
                             [NC, BLOCK_N, BLOCK_M])
        acc = _mma(kt, w3, acc * alpha[None, None, :], INPUT_PRECISION) \
            + tl.sum(w, axis=1)[None, None, :] * tl.reshape(c_k_rz, [NC, BLOCK_DC, 1])
    return m_i, l_i, acc


@triton.jit
def _blocked_rows(offs_m, NC: tl.constexpr, BLOCK_DC: tl.constexpr):
    """Offsets [NC, len(offs_m), BLOCK_DC] of channel c * BLOCK_DC + i of row offs_m[m] at
    [c, m, i] (rows of unit channel stride; offs_m: each row's start), and the channel."""
    ch = tl.arange(0, NC)[:, None, None] * BLOCK_DC + tl.arange(0, BLOCK_DC)[None, None, :]
    return offs_m[None, :, None] + ch, ch


# ------------------------------------------------------------------------------------------
# The standalone kernel
# ------------------------------------------------------------------------------------------
@triton.jit
def _latent_tiles_kernel(
    q_ptr,            # latent queries, rotated (q @ H_D), fp32 [B, Hq, Tq, D], last stride 1
    q_plain_ptr,      # the same un-rotated, same strides (NF == 2)
    s_qb, s_qh, s_qt,
    qpe_ptr,          # RoPE queries, rotated (q_pe @ H_Dv), fp32 [B, Hq, Tq, DV], last stride 1
    s_pb, s_ph, s_pt,
    kc, krs, krz, kcs,        # latent tiles: uint8 [B,H,N,D,G*K_BITS/8], [B,H,N,D] x2, [B,H,N,G]
    vc, vrs, vrz, vcs,        # RoPE tiles: uint8 [B,H,N,G,DV*V_BITS/8], [B,H,N,G] x2, [B,H,N,DV]
    krf, kcf, vrf, vcf,       # fp8 factors [B, H, N, 1] (HAS_FACTORS)
    n_tiles_ptr,      # int32/int64 [B]: filled tiles per row (clamped to [0, N])
    kv_lo_ptr,        # int32/int64 [B, Tq]: first visible quantized token (HAS_LO)
    kv_hi_ptr,        # int32/int64 [B, Tq]: one past the last visible quantized token (HAS_HI)
    bias_ptr,         # fp32 [B, Hq or 1, Tq, N * G] additive mask (HAS_BIAS), token stride 1
    s_bb, s_bh, s_bt,
    ids_ptr,          # int32 [B, H, NF, N]: per frame, its tiles in ascending order (NF == 2)
    count_ptr,        # int32 [B, H, NF]: how many of them to walk (NF == 2)
    o_ptr,            # fp32 [B, Hq, Tq, NF, SPLIT, D]: per-split output, normalized by its l
    lse_ptr,          # fp32 [B, Hq, Tq, NF, SPLIT]: per-split natural-log lse (-inf: empty)
    qk_scale,         # softmax scale * log2(e)
    H, N, Tq,
    GROUP_Q: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DC: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, G: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    NF: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_FACTORS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Partials of one (batch row, kv head) x (frame, split) x query block.

    Grid (B * H, NF * SPLIT, cdiv(g * Tq, BLOCK_M)), g = Hq // H. NF = 1 (no key frames):
    split s walks a contiguous share of the tiles any row of the block can see. NF = 2:
    program (f, s) walks its share of frame f's tile list, with the queries of that frame
    (q_plain for f = 1). Stores (acc / l, m + log l) per row; empty shares (0, -inf).
    """
    pid_bh = tl.program_id(0)
    pid_fs = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    frame = pid_fs // SPLIT
    split = pid_fs % SPLIT
    NC: tl.constexpr = BLOCK_D // BLOCK_DC

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_valid = offs_m < GROUP_Q * Tq
    hq = (h * GROUP_Q + offs_m // Tq).to(tl.int64)
    tq = offs_m % Tq
    offs_dv = tl.arange(0, BLOCK_DV)
    q_off, ch = _blocked_rows(b * s_qb + hq * s_qh + tq * s_qt, NC, BLOCK_DC)
    q_msk = m_valid[None, :, None] & (ch < D)
    if NF == 2:
        if frame == 0:
            q = tl.load(q_ptr + q_off, mask=q_msk, other=0.0).to(tl.float32)
        else:
            q = tl.load(q_plain_ptr + q_off, mask=q_msk, other=0.0).to(tl.float32)
    else:
        q = tl.load(q_ptr + q_off, mask=q_msk, other=0.0).to(tl.float32)
    q_pe = tl.load(qpe_ptr + b * s_pb + hq[:, None] * s_ph + tq[:, None] * s_pt + offs_dv[None, :],
                   mask=m_valid[:, None] & (offs_dv < DV)[None, :], other=0.0).to(tl.float32)

    if HAS_LO:
        kv_lo = tl.load(kv_lo_ptr + b * Tq + tq, mask=m_valid, other=0).to(tl.int32)
    else:
        kv_lo = tq
    if HAS_HI:
        kv_hi = tl.load(kv_hi_ptr + b * Tq + tq, mask=m_valid, other=0).to(tl.int32)
    else:
        kv_hi = tq

    # ---- this program's share of the walk
    bh = b * H + h
    if NF == 2:
        count = tl.load(count_ptr + bh * NF + frame).to(tl.int32)
        ids = ids_ptr + (bh * NF + frame) * N
        first = count * 0
        last = count
    else:
        ids = ids_ptr
        n = tl.minimum(tl.maximum(tl.load(n_tiles_ptr + b).to(tl.int32), 0), N)
        first = n * 0
        if HAS_LO:   # skip the tiles no row of the block can see
            first = tl.minimum(tl.maximum(tl.min(tl.where(m_valid, kv_lo, 2147483647), axis=0), 0) // G, n)
        last = n
        if HAS_HI:
            last = tl.maximum(tl.minimum(tl.cdiv(tl.max(tl.where(m_valid, kv_hi, 0), axis=0), G), n),
                              first)
    per_split = tl.cdiv(last - first, SPLIT)
    start = first + split * per_split
    end = tl.minimum(start + per_split, last)

    K_ROW: tl.constexpr = G * K_BITS // 8
    V_ROW: tl.constexpr = DV * V_BITS // 8
    head = bh * N    # flat index of tile 0 of (b, h)
    bias_rows = bias_ptr + b * s_bb + hq * s_bh + tq.to(tl.int64) * s_bt
    m_i, l_i, acc = _latent_range(
        q, q_pe, kc + head * (D * K_ROW), krs + head * D, krz + head * D, kcs + head * G,
        vc + head * (G * V_ROW), vrs + head * G, vrz + head * G, vcs + head * DV,
        krf + head, kcf + head, vrf + head, vcf + head, ids,
        D * K_ROW, D, D, G, G * V_ROW, G, G, DV, 1,
        start, end, m_valid, kv_lo, kv_hi, bias_rows, 1, qk_scale,
        BLOCK_M, D, BLOCK_D, BLOCK_DC, DV, BLOCK_DV, G, BLOCK_N, K_BITS, V_BITS, HAS_LO,
        HAS_HI, HAS_BIAS, HAS_FACTORS, NF == 2, INPUT_PRECISION, PREFETCH)

    # ---- this share's normalized partial and its lse (natural log)
    has = l_i > 0.0
    out = tl.trans(acc / tl.where(has, l_i, 1.0)[None, None, :], 0, 2, 1)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * _LN2, float("-inf"))
    row = ((b * (H * GROUP_Q) + hq) * Tq + tq) * (NF * SPLIT) + pid_fs
    o_off, _ = _blocked_rows(row * D, NC, BLOCK_DC)
    tl.store(o_ptr + o_off, out, mask=q_msk)
    tl.store(lse_ptr + row, lse, mask=m_valid)


# ------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------
def _default_splits(programs: int, capacity: int, device: torch.device) -> int:
    """Enough programs to fill the GPU (about two waves), never more splits than tiles."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(capacity, triton.cdiv(2 * sms, max(programs, 1)), 64))


def default_config(d: int, rows: int, device: torch.device) -> dict:
    """block_m, block_n, block_dc and num_warps for a latent of width ``d`` and ``rows`` =
    g * Tq query rows per kv head (block_n is capped at G by the caller).

    From the sm_90 compile of the kernel (registers, spills, SASS; triton 3.9, fp16 operands,
    4-bit latent, 8-bit RoPE, G = 64): at D = 512 (DeepSeek), 16-row blocks, 32-token steps,
    two 256-channel blocks and 8 warps compile without spills (214 registers, 54 KiB of
    shared memory); 4 warps spill (640 B), 32-row blocks spill (8-230 B) and cost more
    instructions per query row than two 16-row blocks, 64-token steps spill 8 B. So
    Hq = 128 query heads run as 8 blocks of 16 rows (each tile read 8 times, from L2 after
    the first). D <= 256 fits 4 warps without spills. Triton before 3.9 (3.6: the version
    torch 2.11 brings) spills the 256-channel blocks at D = 512 (608 B, 744 local loads and
    stores a tile, 11,060 instructions: estimate 0.11 of H200 bandwidth) and not 64-channel
    ones (6,100: 0.20), which 3.9 compiles nearly as well as 256 (4,844 against 4,608
    instructions): those get 64."""
    block_d = max(16, triton.next_power_of_2(d))
    widest = 256 if _TRITON_VERSION >= (3, 9) else 64
    return {"block_m": 16, "block_n": 32, "block_dc": min(block_d, widest),
            "num_warps": 8 if block_d > 256 else 4}


def frame_tile_lists(k_plain: torch.Tensor, n_tiles: torch.Tensor, first: torch.Tensor | None = None,
                     last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-frame tile lists of a state with per-tile key frames: (ids int32 [B, H, 2, N],
    count int32 [B, H, 2]). ids[b, h, f, :count[b, h, f]] are the tiles j of frame f
    (k_plain == f) with first[b] <= j < min(last[b], n_tiles[b]), ascending. Static shapes,
    no host sync (a sort of a [B, H, 2, N] key)."""
    bsz, heads, n = k_plain.shape
    j = torch.arange(n, device=k_plain.device)
    limit = n_tiles.clamp(0, n) if last is None else torch.minimum(last, n_tiles.clamp(0, n))
    valid = j[None, :] < limit[:, None]
    if first is not None:
        valid = valid & (j[None, :] >= first[:, None])
    plain = k_plain.bool()
    sel = torch.stack([~plain, plain], 2) & valid[:, None, None, :]             # [B, H, 2, N]
    key = torch.where(sel, j, j + n)
    ids = torch.sort(key, dim=-1).indices.to(torch.int32)          # keys unique
    return ids.contiguous(), sel.sum(-1, dtype=torch.int32)


def _check_tiles(q_rot, tensors, factors, k_plain, n_tiles, kv_lo, kv_hi, bias):
    bsz, hq, tq, d = q_rot.shape
    kc = tensors["k_codes"]
    if kc.dim() != 5:
        raise ValueError(f"Expected k_codes of shape [B, H, N, D, G*kb/8], but got {list(kc.shape)}.")
    heads, cap = kc.shape[1], kc.shape[2]
    if heads < 1 or hq % heads:
        raise ValueError(f"Expected the query heads Hq={hq} to be a multiple of the kv heads "
                         f"H={heads}, but got Hq % H = {hq % max(heads, 1)}.")
    kcs, vcs = tensors["k_col_scale"], tensors["v_col_scale"]
    if kcs.dim() != 4 or vcs.dim() != 4:
        raise ValueError(f"Expected k_col_scale [B, H, N, G] and v_col_scale [B, H, N, Dv], but got "
                         f"{list(kcs.shape)} and {list(vcs.shape)}.")
    group, dv = kcs.shape[-1], vcs.shape[-1]
    if group < 16 or group & (group - 1):
        raise NotImplementedError(
            f"Expected a power-of-two tile length G >= 16 for the Triton kernel, but got {group}.")
    kb = _bits_of(kc, group, "latent (K) code")
    vb = _bits_of(tensors["v_codes"], dv, "RoPE (V) code")
    def latent_scales(name, t):
        if t.dtype not in LATENT_SCALE_DTYPES:
            raise TypeError(f"Expected {name} dtype in {LATENT_SCALE_DTYPES}, but got {t.dtype}.")
        if t.dtype == torch.float8_e4m3fn and not factors:
            raise ValueError(f"Expected the fp8 scales' per-vector factors with fp8 {name} "
                             "(k_row_factor, k_col_factor, v_row_factor, v_col_factor).")

    check_tile_tensors(tensors, factors, q_rot, heads, cap, group, dv, kb, vb, latent_scales)
    if n_tiles.dtype not in (torch.int32, torch.int64) or tuple(n_tiles.shape) != (bsz,) \
            or n_tiles.device != q_rot.device:
        raise ValueError(f"Expected n_tiles int32/int64 of shape [{bsz}] on {q_rot.device}, but got "
                         f"{n_tiles.dtype} {list(n_tiles.shape)} on {n_tiles.device}.")
    for name, t in (("kv_lo", kv_lo), ("kv_hi", kv_hi)):
        if t is not None and (t.dtype not in (torch.int32, torch.int64)
                              or tuple(t.shape) != (bsz, tq) or t.device != q_rot.device):
            raise ValueError(f"Expected {name} int32/int64 of shape [{bsz}, {tq}] on {q_rot.device}, "
                             f"but got {t.dtype} {list(t.shape)} on {t.device}.")
    if bias is not None and (bias.dtype != torch.float32 or bias.dim() != 4 or bias.shape[0] != bsz
                             or bias.shape[1] not in (1, hq) or bias.shape[2] != tq
                             or bias.shape[3] != cap * group or bias.stride(-1) != 1
                             or bias.device != q_rot.device):
        raise ValueError(f"Expected an fp32 bias [{bsz}, {hq} or 1, {tq}, {cap * group}] with a unit "
                         f"last stride on {q_rot.device}, but got {bias.dtype} {list(bias.shape)} "
                         f"{bias.stride()} on {bias.device}.")
    if k_plain is not None and (tuple(k_plain.shape) != (bsz, heads, cap)
                                or k_plain.dtype != torch.uint8 or k_plain.device != q_rot.device):
        raise ValueError(f"Expected k_plain uint8 of shape [{bsz}, {heads}, {cap}] on {q_rot.device}, "
                         f"but got {k_plain.dtype} {list(k_plain.shape)} on {k_plain.device}.")
    return heads, cap, group, dv, kb, vb


def _query(name, t, shape, like=None):
    if t.dtype != torch.float32 or tuple(t.shape) != tuple(shape) or t.stride(-1) != 1:
        raise ValueError(f"Expected {name} fp32 of shape {list(shape)} with a unit last stride, but "
                         f"got {t.dtype} {list(t.shape)} {t.stride()}.")
    if like is not None and (t.stride() != like.stride() or t.device != like.device):
        raise ValueError(f"Expected {name} with the strides and device of q_rot {like.stride()}, but "
                         f"got {t.stride()} on {t.device}.")


def latent_tile_partials(q_rot: torch.Tensor, q_plain: torch.Tensor | None, q_pe_rot: torch.Tensor,
                         k_codes: torch.Tensor, k_row_scale: torch.Tensor,
                         k_row_zero: torch.Tensor, k_col_scale: torch.Tensor,
                         v_codes: torch.Tensor, v_row_scale: torch.Tensor,
                         v_row_zero: torch.Tensor, v_col_scale: torch.Tensor,
                         k_plain: torch.Tensor | None, n_tiles: torch.Tensor,
                         kv_lo: torch.Tensor | None, kv_hi: torch.Tensor | None,
                         bias: torch.Tensor | None, scale: float, *,
                         factors: tuple[torch.Tensor, ...] | None = None,
                         num_splits: int | None = None, block_m: int | None = None,
                         block_n: int | None = None, block_dc: int | None = None,
                         num_warps: int | None = None,
                         input_precision: str | None = None, prefetch: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K latent attention partials over the packed tiles of a latent state.

    Args:
        q_rot: fp32 [B, Hq, Tq, D], the latent-space queries rotated (q @ rotation_matrix(D)),
            not pre-scaled, unit last stride.
        q_plain: the same un-rotated (same shape and strides), for the tiles stored plain;
            required with ``k_plain``, ignored without.
        q_pe_rot: fp32 [B, Hq, Tq, Dv], the RoPE queries rotated (q_pe @ rotation_matrix(Dv)).
        k_codes .. k_col_scale: the latent tiles (the state's key tiles), uint8
            [B, H, N, D, G*kb/8], [B, H, N, D] x2, [B, H, N, G]; contiguous.
        v_codes .. v_col_scale: the RoPE-key tiles (the state's value tiles), uint8
            [B, H, N, G, Dv*vb/8], [B, H, N, G] x2, [B, H, N, Dv]; contiguous.
            Scales in fp16/bf16/fp32, or fp8 (float8_e4m3fn) with ``factors``.
        k_plain: uint8 [B, H, N] (1 = that latent tile is stored un-rotated) or None.
        n_tiles: int32/int64 [B], filled tiles per row (clamped to [0, N]).
        kv_lo, kv_hi: int32/int64 [B, Tq] or None: query t of row b sees quantized tokens
            kv_lo[b, t] <= j < kv_hi[b, t] (token j of the tiles = tile * G + offset;
            ``regions.tile_bounds``); None: no bound on that side.
        bias: fp32 [B, Hq or 1, Tq, N * G] additive mask over the quantized tokens (natural
            log units, -inf hides, unit token stride) or None.
        scale: the softmax scale.
        factors: the fp8 scales' per-vector factors (k_row_factor, k_col_factor,
            v_row_factor, v_col_factor), each [B, H, N, 1], or None (scales used as stored;
            fp8 scales then need their factors folded in already, as fp32).
        num_splits: splits of each frame's tiles (default: 1 on CPU, ~2 waves on a GPU).
        block_m, block_n, block_dc, num_warps: query rows per program (power of two >= 16),
            tokens per step (power of two >= 16 dividing G), latent channels per block of
            the batched matmuls (power of two >= 16 dividing the padded D), warps (defaults:
            :func:`default_config`).
        input_precision: "ieee", "tf32" or "fp16" (codes exact in fp16, the other operand
            rounded to fp16, fp32 sums); default :data:`CUDA_PRECISION` on a GPU, "ieee" else.
        prefetch: issue the next step's loads before this step's math.

    Returns:
        (o_part fp32 [B, Hq, Tq, NF, SPLIT, D], lse_part fp32 [B, Hq, Tq, NF, SPLIT]), NF = 2
        with ``k_plain`` (frame 0: the rotated tiles, output in the rotated frame; frame 1:
        the plain tiles, output un-rotated), else 1. Each partial is normalized by its own
        softmax sum; an empty one has lse = -inf (and o = 0). ``ops.dispatch.merge_latent_partials``
        merges them.
    """
    if q_rot.dim() != 4:
        raise ValueError(f"Expected q_rot of shape [B, Hq, Tq, D], but got {list(q_rot.shape)}.")
    bsz, hq, tq, d = q_rot.shape
    _query("q_rot", q_rot, q_rot.shape)
    tensors = {"k_codes": k_codes, "k_row_scale": k_row_scale, "k_row_zero": k_row_zero,
               "k_col_scale": k_col_scale, "v_codes": v_codes, "v_row_scale": v_row_scale,
               "v_row_zero": v_row_zero, "v_col_scale": v_col_scale}
    fac = {} if factors is None else dict(zip(("k_row_factor", "k_col_factor", "v_row_factor",
                                               "v_col_factor"), factors))
    if factors is not None and len(factors) != 4:
        raise ValueError(f"Expected 4 fp8 factors (k row, k col, v row, v col), but got {len(factors)}.")
    heads, cap, group, dv, kb, vb = _check_tiles(q_rot, tensors, fac, k_plain, n_tiles, kv_lo,
                                                 kv_hi, bias)
    _query("q_pe_rot", q_pe_rot, (bsz, hq, tq, dv))
    if q_pe_rot.device != q_rot.device:
        raise ValueError(f"Expected q_pe_rot on {q_rot.device}, but got {q_pe_rot.device}.")
    frames = k_plain is not None
    if frames:
        if q_plain is None:
            raise ValueError("Expected q_plain (the un-rotated queries) with k_plain.")
        _query("q_plain", q_plain, q_rot.shape, like=q_rot)
    if input_precision is None:
        input_precision = CUDA_PRECISION if q_rot.is_cuda else "ieee"
    if input_precision not in ("ieee", "tf32", "fp16"):
        raise ValueError(f"Expected input_precision 'ieee', 'tf32' or 'fp16', but got "
                         f"{input_precision!r}.")
    g = hq // heads
    rows = g * tq
    cfg = default_config(d, rows, q_rot.device)
    block_m = cfg["block_m"] if block_m is None else block_m
    block_n = min(group, cfg["block_n"]) if block_n is None else block_n
    block_d = max(16, triton.next_power_of_2(d))
    block_dc = min(block_d, cfg["block_dc"]) if block_dc is None else block_dc
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    if block_dc < 16 or block_dc & (block_dc - 1) or block_d % block_dc:
        raise ValueError(f"Expected block_dc a power of two >= 16 dividing {block_d} (D={d} "
                         f"padded), but got {block_dc}.")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"Expected block_m a power of two >= 16, but got {block_m}.")
    if block_n < 16 or block_n & (block_n - 1) or group % block_n:
        raise ValueError(f"Expected block_n a power of two >= 16 dividing G={group}, but got "
                         f"{block_n}.")
    nf = 2 if frames else 1
    row_blocks = triton.cdiv(rows, block_m)
    split = num_splits if num_splits is not None else _default_splits(
        bsz * heads * nf * row_blocks, cap, q_rot.device)
    if not isinstance(split, int) or isinstance(split, bool) or split < 1:
        raise ValueError(f"Expected num_splits a positive int, but got {split!r}.")

    dev = q_rot.device
    o_part = torch.empty(bsz, hq, tq, nf, split, d, dtype=torch.float32, device=dev)
    lse_part = torch.empty(bsz, hq, tq, nf, split, dtype=torch.float32, device=dev)
    if not lse_part.numel():
        return o_part, lse_part
    if not cap:                      # no tile slots: every partial is empty
        return o_part.zero_(), lse_part.fill_(float("-inf"))
    if frames:
        first = None if kv_lo is None else kv_lo.min(-1).values.clamp_min(0) // group
        last = None if kv_hi is None else (kv_hi.max(-1).values + group - 1) // group
        ids, count = frame_tile_lists(k_plain, n_tiles, first, last)
    else:
        ids = count = n_tiles
    f0 = fac.get("k_row_factor", n_tiles)
    grid = (bsz * heads, nf * split, row_blocks)
    _latent_tiles_kernel[grid](
        q_rot, q_plain if frames else q_rot, q_rot.stride(0), q_rot.stride(1), q_rot.stride(2),
        q_pe_rot, q_pe_rot.stride(0), q_pe_rot.stride(1), q_pe_rot.stride(2),
        k_codes, k_row_scale, k_row_zero, k_col_scale, v_codes, v_row_scale, v_row_zero,
        v_col_scale, f0, fac.get("k_col_factor", f0), fac.get("v_row_factor", f0),
        fac.get("v_col_factor", f0), n_tiles,
        kv_lo.contiguous() if kv_lo is not None else n_tiles,
        kv_hi.contiguous() if kv_hi is not None else n_tiles,
        bias if bias is not None else q_rot,
        *((bias.stride(0), bias.stride(1) if bias.shape[1] > 1 else 0, bias.stride(2))
          if bias is not None else (0, 0, 0)),
        ids, count, o_part, lse_part, float(scale) * math.log2(math.e), heads, cap, tq,
        GROUP_Q=g, D=d, BLOCK_D=block_d, BLOCK_DC=block_dc, DV=dv,
        BLOCK_DV=max(16, triton.next_power_of_2(dv)), G=group, K_BITS=kb, V_BITS=vb, NF=nf,
        SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n, PREFETCH=bool(prefetch),
        HAS_LO=kv_lo is not None, HAS_HI=kv_hi is not None, HAS_BIAS=bias is not None,
        HAS_FACTORS=bool(fac), INPUT_PRECISION=input_precision, num_warps=num_warps,
    )
    return o_part, lse_part
