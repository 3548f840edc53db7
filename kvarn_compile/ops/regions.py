"""The two regions of a packed cache's attention, and their log-sum-exp merge.

A packed cache holds its tokens in two kinds of storage: the **exact** region (sink and tail
ring, high precision) and the **packed tiles** (codes + dual scales, rotated frame). Every
implementation of ``kvarn::attention`` (the pure-torch reference, the Inductor
decomposition, the CUDA kernel path) attends the two apart and merges them by log-sum-exp;
this module is the one implementation of what they share:

* :func:`exact_region` - softmax attention over sink + tail: (out fp32, lse fp32);
* :func:`tile_bounds` - which quantized tokens each query may see (causal, window);
* :func:`bias_at` - an attention mask read at absolute key positions, as an additive bias;
* :func:`combine_splits` / :func:`merge_regions` - merging normalized partial outputs.

Everything here is static-shape torch (no host syncs), so it also traces into the Inductor
decompositions. Semantics shared by all: a query at absolute position ``lengths - Tq + t``
sees key positions ``<= it`` when causal, ``> it - window`` with a window, and what the
mask allows; a query that sees nothing gets out = 0 and lse = -inf.
"""

from __future__ import annotations

import torch

from kvarn_compile.state import StateFields

__all__ = ["exact_region", "small_matmul", "tile_bounds", "additive", "bias_at", "combine_splits",
           "merge_regions", "safe_lse", "normalized", "query_positions", "NEG_INF"]

NEG_INF = float("-inf")


def safe_lse(scores: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p, l, m_ref) with p = exp(s - m_ref), l = sum p; m_ref = 0 where the max is not finite
    (all -inf rows; a NaN max keeps NaN flowing into p)."""
    m = scores.amax(dim, keepdim=True)
    m_ref = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m_ref)
    return p, p.sum(dim, keepdim=True), m_ref


def normalized(p: torch.Tensor, denom: torch.Tensor, m_ref: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(p / denom, lse) with lse = -inf and p = 0 where nothing was seen; a NaN sum (a
    visible NaN score) keeps lse NaN, so a merge with another region stays NaN."""
    has = denom > 0
    safe = torch.where(has, denom, torch.ones_like(denom))
    lse = torch.where(has, m_ref + torch.log(safe), torch.full_like(denom, NEG_INF))
    lse = torch.where(denom != denom, denom, lse)      # NaN (x != x: no libdevice call)
    return p / safe, lse.squeeze(-1)


def query_positions(lengths: torch.Tensor, tq: int) -> torch.Tensor:
    """Absolute positions [B, Tq] of the queries: the last Tq written tokens of each row."""
    return lengths[:, None] - tq + torch.arange(tq, device=lengths.device)[None, :]


def additive(mask: torch.Tensor) -> torch.Tensor:
    """A mask as an additive fp32 bias: a bool one (True attends) as 0 / -inf."""
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, NEG_INF)
    return mask.float()


def bias_at(mask: torch.Tensor | None, positions: torch.Tensor, shape: tuple[int, int, int]
            ) -> torch.Tensor | None:
    """Additive fp32 mask [B, Hq, Tq, P] at absolute key ``positions`` [B, P].

    ``mask`` is bool (True = attend) or additive float, broadcastable to [B, Hq, Tq, M];
    positions beyond M read as "attend" (the eager op refuses such a mask before it gets
    here, see ``reference.check_mask``).
    """
    if mask is None:
        return None
    b, hq, tq = shape
    m = additive(mask.expand(b, hq, tq, mask.shape[-1]))
    idx = positions.clamp(0, m.shape[-1] - 1)[:, None, None, :].expand(b, hq, tq, -1)
    picked = m.gather(-1, idx)
    inside = (positions < m.shape[-1])[:, None, None, :]
    return torch.where(inside, picked, torch.zeros_like(picked))


def tile_bounds(f: StateFields[torch.Tensor], tq: int, causal: bool, window: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_lo, kv_hi) int64 [B, Tq]: query t of row b sees quantized tokens j (absolute
    position S + j) with kv_lo <= j < kv_hi. kv_hi never exceeds the row's filled tiles."""
    s, g = f.sink_k.shape[2], f.k.col_scale.shape[-1]
    bsz = f.lengths.shape[0]
    q_pos = query_positions(f.lengths, tq)
    filled = (f.n_tiles * g)[:, None].expand(bsz, tq)
    kv_hi = torch.minimum(filled, q_pos - s + 1).clamp_min(0) if causal else filled
    kv_lo = (q_pos - window + 1 - s).clamp_min(0) if window > 0 else torch.zeros_like(kv_hi)
    return kv_lo, kv_hi


def _exact_keys(f: StateFields[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute positions [B, S+W] of the sink and tail slots, and whether each holds a token."""
    bsz, _, s, _ = f.sink_k.shape
    w, g = f.tail_k.shape[2], f.k.col_scale.shape[-1]
    dev = f.lengths.device
    sink_pos = torch.arange(s, device=dev)[None, :].expand(bsz, s)
    base = s + f.n_tiles * g                                                     # first tail position
    slot = torch.arange(w, device=dev)[None, :]
    tail_pos = base[:, None] + (slot - (base[:, None] - s)) % w
    ok = torch.cat([sink_pos < f.lengths[:, None],
                    (tail_pos < f.lengths[:, None]) & (f.lengths[:, None] > s)], 1)
    return torch.cat([sink_pos, tail_pos], 1), ok


def small_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as a multiply and a sum over the shared dim (broadcasting the batch dims):
    what a compiled graph should run when ``a`` has a few rows (a decode step's queries):
    Inductor fuses it into one reduction kernel, where a BLAS call with 1-16 rows runs a
    GEMM kernel tiled for hundreds (fp32 on an H200: tens of microseconds each). Eager,
    it materializes the product: use it in traced code only."""
    return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)


def exact_region(q: torch.Tensor, f: StateFields[torch.Tensor], mask: torch.Tensor | None,
                 scale: float, causal: bool, window: int, *, matmul=torch.matmul
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, Hq, Tq, D] over sink + tail: (out fp32 [B,Hq,Tq,Dv], lse [B,Hq,Tq]).

    The query heads of a kv head are the rows of one product with its keys (no copy of the
    keys per query head). ``matmul``: :func:`small_matmul` in traced decode graphs."""
    bsz, heads, _, d = f.sink_k.shape
    hq, tq = q.shape[1], q.shape[2]
    grp = hq // heads
    pos, ok = _exact_keys(f)
    keys = torch.cat([f.sink_k, f.tail_k], 2).float()                           # [B,H,S+W,D]
    vals = torch.cat([f.sink_v, f.tail_v], 2).float()
    rows = q.float().reshape(bsz, heads, grp * tq, d)
    scores = (matmul(rows, keys.transpose(-1, -2)) * scale).reshape(bsz, heads, grp, tq, -1)
    q_pos = query_positions(f.lengths, tq)
    allowed = ok[:, None, :].expand(bsz, tq, -1)
    if causal:
        allowed = allowed & (pos[:, None, :] <= q_pos[:, :, None])
    if window > 0:
        allowed = allowed & (pos[:, None, :] > q_pos[:, :, None] - window)
    bias = bias_at(mask, pos, (bsz, hq, tq))
    if bias is not None:
        scores = scores + bias.reshape(scores.shape)
    scores = scores.masked_fill(~allowed[:, None, None], NEG_INF)
    p, denom, m_ref = safe_lse(scores)
    p, lse = normalized(p, denom, m_ref)
    out = matmul(p.reshape(bsz, heads, grp * tq, -1), vals)
    return out.reshape(bsz, hq, tq, vals.shape[-1]), lse.reshape(bsz, hq, tq)


def combine_splits(o_part: torch.Tensor, lse_part: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge normalized partials o [..., S, D], lse [..., S] into (o [..., D], lse [...]).

    Empty splits (lse = -inf) weigh 0; their o is ignored even if it is garbage (a kernel
    may leave an empty split's o unwritten), so 0 * NaN never reaches the output. A NaN
    lse (a split that saw a NaN score) makes the result NaN, as one softmax would.
    """
    m = lse_part.amax(-1, keepdim=True)
    m_ref = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse_part - m_ref)                                              # [..., S]
    den = w.sum(-1, keepdim=True)
    has = den > 0
    o = torch.where(w[..., None] > 0, o_part, torch.zeros_like(o_part))
    out = (w[..., None] * o).sum(-2) / torch.where(has, den, torch.ones_like(den))
    lse = torch.where(has, m_ref + torch.log(torch.where(has, den, torch.ones_like(den))),
                      torch.full_like(den, NEG_INF))
    lse = torch.where(den != den, den, lse).squeeze(-1)
    return out, lse


def merge_regions(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                  lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-merge two normalized partial outputs by their lse: (out, lse); out = 0 where
    both are empty."""
    return combine_splits(torch.stack([out_a, out_b], -2), torch.stack([lse_a, lse_b], -1))
