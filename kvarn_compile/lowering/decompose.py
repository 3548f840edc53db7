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

Differences from the reference, all deliberate and tested: no host-side check that the
mask covers every position (a shorter mask is padded with "attend"); summation order
differs (results agree to float rounding).
"""

from __future__ import annotations

import torch

from kvarn_compile.ops import regions
from kvarn_compile.ops.attention import tile_inputs, tile_partials
from kvarn_compile.state import unpack

__all__ = ["attention_dense", "attention_split", "tile_partials", "tile_inputs"]



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
