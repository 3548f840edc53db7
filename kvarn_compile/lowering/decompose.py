"""Traceable torch decompositions of ``kvarn::attention`` for the Inductor lowering.

The eager reference (:func:`kvarn_compile.ops.reference.attention`) reads the fill level
(``int(n_tiles.max())``) and checks the mask length with a host sync, so it cannot be
traced into an Inductor graph. The functions here compute the same attention with
static shapes only: every tile slot of the cache is scored and the empty ones are masked
(``j < n_tiles * G``), so ``make_fx`` traces them and Inductor generates code for them
(C++ on CPU, Triton on CUDA).

The attention is split into the two regions the packed cache has:

* **exact** (sink + tail ring, high precision): plain softmax attention, in torch;
* **tiles** (packed, rotated frame): ``tile_partials`` - dual-scale scores and values
  straight from the codes, returned as per-split partials ``(o_part, lse_part)`` in the
  flash-decoding convention (each split normalized by its own sum, lse in natural log);

and merged by log-sum-exp (see :func:`merge_regions`). :func:`attention_dense` computes
the tile partials inline in torch (one split); :func:`attention_split` calls the opaque op
``torch.ops.kvarn_lowering.tile_partials_`` instead, whose own lowering offers the Triton
templates on CUDA (``lowering/tiles.py``). Both decompositions take the op's arguments
flattened, plus the rotation: ``(q, *buffers[, mask], rot)`` and keyword scalars, the form Inductor's
``SubgraphTemplate`` needs (tensors positional, scalars keyword).

Differences from the reference, all deliberate and tested: no host-side check that the
mask covers every position (a shorter mask is padded with "attend"); summation order
differs (results agree to float rounding).
"""

from __future__ import annotations

import torch

from kvarn_compile.reference.quantize import unpack_codes
from kvarn_compile.reference.rotation import rotation_matrix
from kvarn_compile.state import BUF, N_BASE_BUFFERS

__all__ = ["attention_dense", "attention_split", "tile_partials_torch", "tile_inputs",
           "merge_regions", "TILE_INPUT_NAMES"]

#: The tensors a tile-partials kernel reads, in argument order.
TILE_INPUT_NAMES = ("q_rot", "k_codes", "k_row_scale", "k_row_zero", "k_col_scale",
                    "v_codes", "v_row_scale", "v_row_zero", "v_col_scale", "n_tiles",
                    "kv_lo", "kv_hi")

_NEG_INF = float("-inf")


def _b(buffers, name: str) -> torch.Tensor:
    return buffers[BUF[name]]


def _safe_lse(scores: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p, l, m_ref) with p = exp(s - m_ref), l = sum p; m_ref = 0 for all -inf rows."""
    m = scores.amax(dim, keepdim=True)
    m_ref = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m_ref)
    return p, p.sum(dim, keepdim=True), m_ref


def _bias_at(mask: torch.Tensor | None, positions: torch.Tensor, shape: tuple[int, ...]
             ) -> torch.Tensor | None:
    """Additive fp32 mask [B, Hq, Tq, P] at absolute key ``positions`` [B, P].

    ``mask`` is bool (True = attend) or additive float, broadcastable to [B, Hq, Tq, M];
    positions beyond M read as "attend" (the reference raises there instead).
    """
    if mask is None:
        return None
    b, hq, tq = shape
    m = mask.expand(b, hq, tq, mask.shape[-1])
    if m.dtype == torch.bool:
        m = torch.where(m, 0.0, _NEG_INF)
    m = m.float()
    idx = positions.clamp(0, m.shape[-1] - 1)[:, None, None, :].expand(b, hq, tq, -1)
    picked = m.gather(-1, idx)
    inside = (positions < m.shape[-1])[:, None, None, :]
    return torch.where(inside, picked, torch.zeros_like(picked))


def tile_inputs(q: torch.Tensor, buffers, mask: torch.Tensor | None, causal: bool,
                window: int, rot: torch.Tensor | None = None):
    """Everything a tile-partials kernel needs, computed from the op's arguments.

    Returns (q_rot fp32 [B,Hq,Tq,D], the 8 tile tensors (scales with their fp8 factors
    applied), n_tiles [B], kv_lo [B,Tq], kv_hi [B,Tq], bias [B,Hq,Tq,N*G] or None).
    Quantized token j of a row sits at absolute position S + j; query t of row b sits at
    lengths[b] - Tq + t. kv_lo/kv_hi bound the visible j per query (window, causal).
    """
    sink_k = _b(buffers, "sink_k")
    bsz, _, s, d = sink_k.shape
    n_max, g = _b(buffers, "k_codes").shape[2], _b(buffers, "k_col_scale").shape[-1]
    hq, tq = q.shape[1], q.shape[2]
    lengths, n_tiles = _b(buffers, "lengths"), _b(buffers, "n_tiles")
    q_pos = lengths[:, None] - tq + torch.arange(tq, device=q.device)[None, :]      # [B,Tq]
    filled = (n_tiles * g)[:, None].expand(bsz, tq)
    kv_hi = torch.minimum(filled, q_pos - s + 1).clamp_min(0) if causal else filled
    if window > 0:
        kv_lo = (q_pos - window + 1 - s).clamp_min(0)
    else:
        kv_lo = torch.zeros_like(kv_hi)
    q_rot = q.float() @ (rotation_matrix(d, q.device) if rot is None else rot)
    tensors = []
    for kind in ("k", "v"):
        rs = _b(buffers, f"{kind}_row_scale")
        cs = _b(buffers, f"{kind}_col_scale")
        if len(buffers) > N_BASE_BUFFERS:   # fp8 scales: fold their per-vector factor
            rs = rs.float() * _b(buffers, f"{kind}_row_factor").float()
            cs = cs.float() * _b(buffers, f"{kind}_col_factor").float()
        tensors += [_b(buffers, f"{kind}_codes"), rs, _b(buffers, f"{kind}_row_zero"), cs]
    positions = (s + torch.arange(n_max * g, device=q.device))[None, :].expand(bsz, -1)
    bias = _bias_at(mask, positions, (bsz, hq, tq))
    return (q_rot, *tensors, n_tiles, kv_lo, kv_hi, bias)


def tile_partials_torch(q_rot, k_codes, k_row_scale, k_row_zero, k_col_scale,
                        v_codes, v_row_scale, v_row_zero, v_col_scale, n_tiles, kv_lo,
                        kv_hi, bias, scale: float, split_max: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-scale attention partials over the packed tiles, in torch (one split).

    Same contract as the Triton kernels: returns (o_part fp32 [B, Hq, Tq, SPLIT_MAX, D],
    lse_part fp32 [B, Hq, Tq, SPLIT_MAX]); split 0 holds the whole region, the others are
    empty (o = 0, lse = -inf). Scores, in the rotated frame::

        s[t] = scale * cs_k[t] * ((q * rs_k) @ code_k[:, t] + q @ rz_k)
        o[c] = cs_v[c] * ((p * rs_v) @ code_v[:, c] + p @ rz_v) / sum(p)
    """
    bsz, hq, tq, d = q_rot.shape
    heads, n_max = k_codes.shape[1], k_codes.shape[2]
    g = k_col_scale.shape[-1]
    kb, vb = 8 * k_codes.shape[-1] // g, 8 * v_codes.shape[-1] // d
    grp = hq // heads
    qg = q_rot.float().reshape(bsz, heads, grp, tq, d)
    codes_k = unpack_codes(k_codes, kb).float()                                  # [B,H,N,D,G]
    qs = qg.unsqueeze(-2) * k_row_scale.float()[:, :, None, None]                # [B,H,g,Tq,N,D]
    dot = torch.einsum("bhgqnd,bhndt->bhgqnt", qs, codes_k)
    zero = torch.einsum("bhgqd,bhnd->bhgqn", qg, k_row_zero.float()).unsqueeze(-1)
    scores = ((dot + zero) * k_col_scale.float()[:, :, None, None]).flatten(-2) * scale
    j = torch.arange(n_max * g, device=q_rot.device)
    visible = ((j[None, None, :] >= kv_lo[:, :, None]) & (j[None, None, :] < kv_hi[:, :, None])
               & (j[None, None, :] < (n_tiles * g)[:, None, None]))               # [B,Tq,N*G]
    if bias is not None:
        scores = scores + bias.expand(bsz, hq, tq, n_max * g).reshape(scores.shape)
    scores = scores.masked_fill(~visible[:, None, None], _NEG_INF)
    p, denom, m_ref = _safe_lse(scores)
    has = denom > 0
    p = p / torch.where(has, denom, torch.ones_like(denom))
    codes_v = unpack_codes(v_codes, vb).float()                                  # [B,H,N,G,D]
    pt = p.unflatten(-1, (n_max, g))                                             # [B,H,g,Tq,N,G]
    weighted = torch.einsum("bhgqnt,bhntd->bhgqnd", pt * v_row_scale.float()[:, :, None, None], codes_v)
    zsum = (pt * v_row_zero.float()[:, :, None, None]).sum(-1, keepdim=True)
    out = ((weighted + zsum) * v_col_scale.float()[:, :, None, None]).sum(-2)   # [B,H,g,Tq,D]
    lse = torch.where(has, m_ref + torch.log(torch.where(has, denom, torch.ones_like(denom))),
                      torch.full_like(denom, _NEG_INF)).squeeze(-1)              # [B,H,g,Tq]
    out = out.reshape(bsz, hq, tq, 1, d)
    lse = lse.reshape(bsz, hq, tq, 1)
    if split_max > 1:
        out = torch.cat([out, out.new_zeros(bsz, hq, tq, split_max - 1, d)], 3)
        lse = torch.cat([lse, lse.new_full((bsz, hq, tq, split_max - 1), _NEG_INF)], 3)
    return out, lse


def combine_splits_torch(o_part: torch.Tensor, lse_part: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge split partials o [..., S, D], lse [..., S] into (o [..., D], lse [...]).

    Empty splits (lse = -inf) weigh 0; their o is ignored even if it is garbage (a kernel
    may leave an empty split's o unwritten), so 0 * NaN never reaches the output.
    """
    m = lse_part.amax(-1, keepdim=True)
    m_ref = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse_part - m_ref)                                              # [..., S]
    den = w.sum(-1, keepdim=True)
    has = den > 0
    o = torch.where(w[..., None] > 0, o_part, torch.zeros_like(o_part))
    out = (w[..., None] * o).sum(-2) / torch.where(has, den, torch.ones_like(den))
    lse = torch.where(has, m_ref + torch.log(torch.where(has, den, torch.ones_like(den))),
                      torch.full_like(den, _NEG_INF)).squeeze(-1)
    return out, lse


def _exact_region(q: torch.Tensor, buffers, mask, scale: float, causal: bool, window: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over sink + tail (high precision): (out fp32 [B,Hq,Tq,D], lse [B,Hq,Tq])."""
    sink_k, sink_v = _b(buffers, "sink_k"), _b(buffers, "sink_v")
    tail_k, tail_v = _b(buffers, "tail_k"), _b(buffers, "tail_v")
    bsz, heads, s, d = sink_k.shape
    w, g = tail_k.shape[2], _b(buffers, "k_col_scale").shape[-1]
    hq, tq = q.shape[1], q.shape[2]
    grp = hq // heads
    lengths, n_tiles = _b(buffers, "lengths"), _b(buffers, "n_tiles")
    dev = q.device
    sink_pos = torch.arange(s, device=dev)[None, :].expand(bsz, s)
    base = s + n_tiles * g                                                       # [B]
    slot = torch.arange(w, device=dev)[None, :]
    tail_pos = base[:, None] + (slot - (base[:, None] - s)) % w
    pos = torch.cat([sink_pos, tail_pos], 1)                                     # [B, S+W]
    ok = torch.cat([sink_pos < lengths[:, None],
                    (tail_pos < lengths[:, None]) & (lengths[:, None] > s)], 1)
    keys = torch.cat([sink_k, tail_k], 2).float()                               # [B,H,S+W,D]
    vals = torch.cat([sink_v, tail_v], 2).float()
    qg = q.float().reshape(bsz, heads, grp, tq, d)
    scores = (qg @ keys.unsqueeze(2).transpose(-1, -2)) * scale                  # [B,H,g,Tq,S+W]
    q_pos = lengths[:, None] - tq + torch.arange(tq, device=dev)[None, :]
    allowed = ok[:, None, :].expand(bsz, tq, -1)
    if causal:
        allowed = allowed & (pos[:, None, :] <= q_pos[:, :, None])
    if window > 0:
        allowed = allowed & (pos[:, None, :] > q_pos[:, :, None] - window)
    bias = _bias_at(mask, pos, (bsz, hq, tq))
    if bias is not None:
        scores = scores + bias.reshape(scores.shape)
    scores = scores.masked_fill(~allowed[:, None, None], _NEG_INF)
    p, denom, m_ref = _safe_lse(scores)
    has = denom > 0
    out = (p @ vals.unsqueeze(2)) / torch.where(has, denom, torch.ones_like(denom))
    lse = torch.where(has, m_ref + torch.log(torch.where(has, denom, torch.ones_like(denom))),
                      torch.full_like(denom, _NEG_INF)).squeeze(-1)
    return out.reshape(bsz, hq, tq, d), lse.reshape(bsz, hq, tq)


def merge_regions(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                  lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax-merge two normalized partial outputs by their lse; 0 where both are empty."""
    o = torch.stack([out_a, out_b], -2)
    lse = torch.stack([lse_a, lse_b], -1)
    return combine_splits_torch(o, lse)[0]


def _split_args(args: tuple[torch.Tensor, ...], n_buffers: int, has_mask: bool):
    """(q, buffers, mask, rot) from the flat ``(q, *buffers[, mask], rot)``."""
    q, buffers = args[0], list(args[1:1 + n_buffers])
    mask = args[1 + n_buffers] if has_mask else None
    return q, buffers, mask, args[1 + n_buffers + int(has_mask)]


def _attention(args, n_buffers: int, has_mask: bool, scale: float, causal: bool,
               window: int, split_max: int, tiles_fn) -> torch.Tensor:
    q, buffers, mask, rot = _split_args(args, n_buffers, has_mask)
    out_ex, lse_ex = _exact_region(q, buffers, mask, scale, causal, window)
    q_rot, *tiles, n_tiles, kv_lo, kv_hi, bias = tile_inputs(q, buffers, mask, causal, window, rot)
    o_part, lse_part = tiles_fn(q_rot, *tiles, n_tiles, kv_lo, kv_hi, bias, scale, split_max)
    out_rot, lse_t = combine_splits_torch(o_part, lse_part)
    out_t = out_rot @ rot.T
    return merge_regions(out_ex, lse_ex, out_t, lse_t).to(q.dtype)


def attention_dense(*args: torch.Tensor, n_buffers: int, has_mask: bool, scale: float,
                    causal: bool, window: int) -> torch.Tensor:
    """``kvarn::attention`` as plain torch ops over the whole tile capacity (traceable).

    ``args`` = ``(q, *buffers[, mask], rot)`` with ``rot`` = ``rotation_matrix(D)``: the
    rotation is an input (a graph constant in the lowering), not a tensor built here,
    because the trace runs on fake tensors.
    """
    return _attention(args, n_buffers, has_mask, scale, causal, window, 1, tile_partials_torch)


def _tile_partials_op(q_rot, *rest):
    *tensors, bias, scale, split_max = rest
    bsz, hq, tq, d = q_rot.shape
    # -inf: a kernel may leave split slots it has no programs for untouched
    lse_part = q_rot.new_full((bsz, hq, tq, split_max), _NEG_INF)
    o_part = torch.ops.kvarn_lowering.tile_partials_(q_rot, *tensors, bias, lse_part,
                                                     scale, split_max)
    return o_part, lse_part


def attention_split(*args: torch.Tensor, n_buffers: int, has_mask: bool, scale: float,
                    causal: bool, window: int, split_max: int) -> torch.Tensor:
    """``kvarn::attention`` with the tile region behind ``kvarn_lowering::tile_partials_``.

    The op is lowered separately (Triton templates on CUDA, see ``lowering/tiles.py``);
    everything around it (rotation, sink/tail attention, split and region merges) stays
    torch ops that Inductor fuses.
    """
    from kvarn_compile.lowering import tiles  # noqa: F401  (registers the op)

    return _attention(args, n_buffers, has_mask, scale, causal, window, split_max,
                      _tile_partials_op)
