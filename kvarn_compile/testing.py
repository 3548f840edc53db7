"""Test helpers shipped with the package: graph normalization for golden tests, SQNR, and a
float64 attention oracle over a packed cache."""

from __future__ import annotations

import torch

from kvarn_compile.passes.graph_text import normalize_graph

__all__ = ["normalize_graph", "sqnr", "oracle_attention"]


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(|ref| / |ref - actual|)."""
    ref, act = reference.double(), actual.double()
    return (20 * torch.log10(ref.norm() / (ref - act).norm().clamp_min(1e-30))).item()


def oracle_attention(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None = None,
                     *, scale: float | None = None, causal: bool = True, window: int = 0
                     ) -> torch.Tensor:
    """Plain float64 softmax attention of ``q`` [B, Hq, Tq, D] over a packed cache's
    dequantized K/V (:func:`kvarn_compile.ops.append.materialize`): [B, Hq, Tq, D].

    The queries are the cache's newest Tq tokens. ``mask`` is a bool (True = attend) or an
    additive float mask broadcastable to [B, 1 or Hq, Tq, >= capacity]; ``window`` > 0 keeps
    the newest ``window`` keys of each query. A query that sees no key gets zeros. This is
    the oracle the fused ``kvarn::attention`` is tested against; it builds exactly what the
    runtime never does.
    """
    from kvarn_compile.ops.append import materialize
    from kvarn_compile.state import unpack

    k, v = materialize(buffers, dtype=torch.float64)           # [B, H, cap, D]
    bsz, hq, tq, d = q.shape
    grp = hq // k.shape[1]
    k, v = k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1)
    cap = k.shape[2]
    lengths = unpack(buffers).lengths
    kpos = torch.arange(cap)
    qpos = lengths[:, None] - tq + torch.arange(tq)[None]        # [B, Tq]
    allowed = (kpos[None, None] < lengths[:, None, None]).expand(bsz, tq, cap)
    if causal:
        allowed = allowed & (kpos[None, None] <= qpos[..., None])
    if window:
        allowed = allowed & (kpos[None, None] > qpos[..., None] - window)
    allowed = allowed[:, None]                                    # [B, 1, Tq, cap]
    scores = (q.double() @ k.transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = allowed & mask[..., :cap]
        else:
            scores = scores + mask[..., :cap].double()
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, -1).nan_to_num(0.0)               # rows seeing no key -> 0
    return p @ v
