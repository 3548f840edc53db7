"""Traceable torch decompositions of ``kvarn::attention`` for the Inductor lowering.

The eager reference (:func:`kvarn_compile.ops.attention.attention`) reads the fill level
(``int(n_tiles.max())``) and checks the mask length with a host sync, so it cannot be
traced into an Inductor graph. The functions here compute the same attention with
static shapes only: every tile slot of the cache is scored and the empty ones are masked
(``j < n_tiles * G``), so ``make_fx`` traces them and Inductor generates code for them
(C++ on CPU, Triton on CUDA).

The attention is split into the two regions the packed cache has, exactly as the eager
reference does it (and with the same functions):

* **exact** (sink + tail ring, high precision): ``ops.regions.exact_region``;
* **tiles** (packed, rotated frame): ``ops.attention.tile_partials`` - dual-scale scores
  and values straight from the codes, returned as per-split partials ``(o_part,
  lse_part)`` in the flash-decoding convention (each split normalized by its own sum, lse
  in natural log);

and merged by log-sum-exp (``ops.regions.merge_regions``). :func:`attention_dense`
computes the tile partials inline in torch (one split); :func:`attention_split` calls the
opaque op ``torch.ops.kvarn.tile_partials_`` instead, whose own lowering offers the Triton
templates on CUDA (``lowering/tiles.py``). Both decompositions take the op's arguments
flattened, plus the rotation: ``(q, *buffers[, mask], rot)`` and keyword scalars, the form Inductor's
``SubgraphTemplate`` needs (tensors positional, scalars keyword).

A state with no tile slot (its capacity is below sink + one tile) has only the exact
region; both decompositions then return it (a reduction over zero tile columns does not
lower).

``kvarn::latent_attention`` (absorbed multi-head latent attention over a latent state) has
one decomposition, :func:`latent_attention_split`, composed as the CUDA op composes it
(``ops.dispatch.latent_attention_cuda``): the exact region as one attention of
[q | q_pe] over [latent | RoPE key] (``ops.attention.latent_fields``), the tiles behind the
opaque ``torch.ops.kvarn.latent_tile_partials_`` (per key frame and split; its lowering
offers the ``kvarn_latent`` template, ``lowering/latent.py``), the frames merged after
rotating the rotated frame's output back, then the regions. Flat arguments
``(q, q_pe, *buffers[, mask], rot, rot_pe)``: ``rot`` = ``rotation_matrix(D)`` (the latent),
``rot_pe`` = ``rotation_matrix(Dv)`` (the RoPE key).

Differences from the reference, all deliberate and tested: no host-side check that the
mask covers every position (a shorter mask is padded with "attend"); summation order
differs (results agree to float rounding).
"""

from __future__ import annotations

import torch

from kvarn_compile.ops import regions
from kvarn_compile.ops.attention import LATENT_TILE_ARGS, latent_fields, tile_inputs, tile_partials
from kvarn_compile.state import unpack

__all__ = ["attention_dense", "attention_split", "tile_partials", "tile_inputs",
           "latent_attention_split", "latent_tile_inputs"]



def _split_args(args: tuple[torch.Tensor, ...], n_buffers: int, has_mask: bool):
    """(q, buffers, mask, rot, rot_v) from the flat ``(q, *buffers[, mask], rot[, rot_v])``:
    ``rot_v`` (the values' Dv-sized rotation) only where Dv differs from D."""
    q, buffers = args[0], list(args[1:1 + n_buffers])
    mask = args[1 + n_buffers] if has_mask else None
    at = 1 + n_buffers + int(has_mask)
    rot = args[at]
    return q, buffers, mask, rot, args[at + 1] if len(args) > at + 1 else rot


#: Up to this many query rows per kv head (GQA group x query tokens: a decode step) the
#: products around the tiles (q @ H, the exact region, out @ H^T) are multiply-and-sum
#: reductions Inductor fuses (``regions.small_matmul``), not BLAS calls tiled for big matrices.
SMALL_ROWS = 16


def _attention(args, n_buffers: int, has_mask: bool, scale: float, causal: bool,
               window: int, split_max: int, tiles_fn) -> torch.Tensor:
    q, buffers, mask, rot, rot_v = _split_args(args, n_buffers, has_mask)
    f = unpack(buffers)
    rows = q.shape[1] // max(f.sink_k.shape[1], 1) * q.shape[2]
    matmul = regions.small_matmul if rows <= SMALL_ROWS else torch.matmul
    out_ex, lse_ex = regions.exact_region(q, f, mask, scale, causal, window, matmul=matmul)
    if f.k.codes.shape[2] == 0:
        # no tile slot (a cache allocated for fewer than sink + one tile positions): the
        # exact region is the whole attention; a softmax over zero tile columns has no max
        return out_ex.to(q.dtype)
    o_part, lse_part = tiles_fn(*tile_inputs(q, buffers, mask, causal, window, rot, matmul),
                                scale, split_max)
    out_rot, lse_t = regions.combine_splits(o_part, lse_part)
    out, _ = regions.merge_regions(out_ex, lse_ex, matmul(out_rot, rot_v.T), lse_t)
    return out.to(q.dtype)


def attention_dense(*args: torch.Tensor, n_buffers: int, has_mask: bool, scale: float,
                    causal: bool, window: int) -> torch.Tensor:
    """``kvarn::attention`` as plain torch ops over the whole tile capacity (traceable).

    ``args`` = ``(q, *buffers[, mask], rot[, rot_v])`` with ``rot`` = ``rotation_matrix(D)``
    and ``rot_v`` = ``rotation_matrix(Dv)`` where the values' head dim differs: the
    rotations are inputs (graph constants in the lowering), not tensors built here,
    because the trace runs on fake tensors.
    """
    return _attention(args, n_buffers, has_mask, scale, causal, window, 1, tile_partials)


def _tile_partials_op(q_rot, *rest):
    *tensors, bias, scale, split_max = rest
    bsz, hq, tq, d = q_rot.shape
    # -inf: a kernel may leave split slots it has no programs for untouched
    lse_part = q_rot.new_full((bsz, hq, tq, split_max), regions.NEG_INF)
    o_part = torch.ops.kvarn.tile_partials_(q_rot, *tensors, bias, lse_part, scale, split_max)
    return o_part, lse_part


def attention_split(*args: torch.Tensor, n_buffers: int, has_mask: bool, scale: float,
                    causal: bool, window: int, split_max: int) -> torch.Tensor:
    """``kvarn::attention`` with the tile region behind ``kvarn::tile_partials_``.

    The op is lowered separately (Triton templates on CUDA, see ``lowering/tiles.py``);
    everything around it (rotation, sink/tail attention, split and region merges) stays
    torch ops that Inductor fuses.
    """
    return _attention(args, n_buffers, has_mask, scale, causal, window, split_max,
                      _tile_partials_op)


# ------------------------------------------------------------------------------ latent attention
def latent_tile_inputs(q: torch.Tensor, q_pe: torch.Tensor, buffers, mask: torch.Tensor | None,
                       causal: bool, window: int, rot: torch.Tensor, rot_pe: torch.Tensor,
                       matmul=torch.matmul) -> tuple:
    """The tensor arguments of ``kvarn::latent_tile_partials_`` (``LATENT_TILE_ARGS``) from
    the latent attention's, as ``ops.dispatch.latent_attention_cuda`` builds the launcher's:
    q_rot = q @ rot and q_pe_rot = q_pe @ rot_pe (fp32); q_plain (un-rotated, fp32), the
    per-frame tile lists (``frame_tile_lists`` over the tiles any query can see) with key
    frames; the 8 tile tensors as stored and the fp8 factors with fp8 scales; n_tiles;
    kv_lo, kv_hi [B, Tq]; the mask as a bias [B, Hq or 1, Tq, N * G]. Static shapes."""
    f = unpack(buffers)
    bsz, _, s, _ = f.sink_k.shape
    n_max, g = f.k.codes.shape[2], f.k.col_scale.shape[-1]
    tq = q.shape[2]
    kv_lo, kv_hi = regions.tile_bounds(f, tq, causal, window)
    q32 = q.float()
    q_rot = matmul(q32, rot)
    pe_rot = matmul(q_pe.float(), rot_pe)
    bias = None
    if mask is not None:       # one row of the mask per query head it has (often 1)
        m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        cols = s + torch.arange(n_max * g, device=q.device)
        bias = regions.bias_at(m4, cols[None, :].expand(bsz, -1), (bsz, m4.shape[1], tq))
    factors = (f.k.row_factor, f.k.col_factor, f.v.row_factor, f.v.col_factor) \
        if f.layout.fp8_factors else (None,) * 4
    ids = count = None
    if f.k_plain is not None:
        # the kernel's own list builder (pure torch: a sort), not a copy of it
        from kvarn_compile.kernels.triton.latent_attention import frame_tile_lists

        first = kv_lo.min(-1).values.clamp_min(0) // g
        last = (kv_hi.max(-1).values + g - 1) // g
        ids, count = frame_tile_lists(f.k_plain, f.n_tiles, first, last)
    return (q_rot, q32 if ids is not None else None, pe_rot, *f.k.core, *f.v.core, *factors,
            ids, count, f.n_tiles, kv_lo, kv_hi, bias)


def _latent_tile_partials_op(q_rot, *rest):
    *tensors, scale, split_max = rest
    bsz, hq, tq, _ = q_rot.shape
    nf = 1 if tensors[LATENT_TILE_ARGS.index("tile_ids") - 1] is None else 2
    lse_part = q_rot.new_full((bsz, hq, tq, nf, split_max), regions.NEG_INF)
    o_part = torch.ops.kvarn.latent_tile_partials_(q_rot, *tensors, lse_part, scale, split_max)
    return o_part, lse_part


def merge_latent_frames(o_part: torch.Tensor, lse_part: torch.Tensor, rot: torch.Tensor,
                        matmul=torch.matmul) -> tuple[torch.Tensor, torch.Tensor]:
    """(out fp32 [B, Hq, Tq, D] in the original frame, lse [B, Hq, Tq]) from the partials of
    ``kvarn::latent_tile_partials_``: each frame's splits merged by lse, the rotated frame's
    output rotated back (``@ rot.T``), the frames merged (traceable torch; what
    ``ops.dispatch.merge_latent_partials`` does eagerly with the Triton combine kernel)."""
    out, lse = regions.combine_splits(o_part[:, :, :, 0], lse_part[:, :, :, 0])
    out = matmul(out, rot.T)
    if o_part.shape[3] == 2:
        out_p, lse_p = regions.combine_splits(o_part[:, :, :, 1], lse_part[:, :, :, 1])
        out, lse = regions.merge_regions(out, lse, out_p, lse_p)
    return out, lse


def latent_attention_split(*args: torch.Tensor, n_buffers: int, has_mask: bool, scale: float,
                           causal: bool, window: int, split_max: int) -> torch.Tensor:
    """``kvarn::latent_attention`` with the packed tiles behind
    ``kvarn::latent_tile_partials_`` (traceable, static shapes).

    ``args`` = ``(q, q_pe, *buffers[, mask], rot, rot_pe)``; the rotations are inputs (graph
    constants in the lowering). Everything around the tile op (the rotations of q and q_pe,
    the exact sink/tail attention, the split, frame and region merges) stays torch ops that
    Inductor fuses. Differences from the reference as :func:`attention_split`'s.
    """
    q, q_pe, buffers = args[0], args[1], list(args[2:2 + n_buffers])
    mask = args[2 + n_buffers] if has_mask else None
    at = 2 + n_buffers + int(has_mask)
    rot, rot_pe = args[at], args[at + 1]
    f = unpack(buffers)
    rows = q.shape[1] // max(f.sink_k.shape[1], 1) * q.shape[2]
    matmul = regions.small_matmul if rows <= SMALL_ROWS else torch.matmul
    out, lse = regions.exact_region(torch.cat([q, q_pe.to(q.dtype)], -1), latent_fields(f), mask,
                                    scale, causal, window, matmul=matmul)
    if f.k.codes.shape[2] == 0:      # no tile slot: the exact region is the whole attention
        return out.to(q.dtype)
    o_part, lse_part = _latent_tile_partials_op(
        *latent_tile_inputs(q, q_pe, buffers, mask, causal, window, rot, rot_pe, matmul),
        scale, split_max)
    out_t, lse_t = merge_latent_frames(o_part, lse_part, rot, matmul)
    out, _ = regions.merge_regions(out, lse, out_t, lse_t)
    return out.to(q.dtype)
