"""Test helpers shipped with the package: graph normalization for golden tests, SQNR, and a
float64 attention oracle over a packed cache."""

from __future__ import annotations

import re

import torch
import torch.fx as fx

__all__ = ["normalize_graph", "sqnr", "oracle_attention"]


def _fmt(a: object, names: dict[fx.Node, str]) -> str:
    if isinstance(a, fx.Node):
        return names[a]
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt(x, names) for x in a)
        if len(a) > 6 and all(isinstance(x, fx.Node) and names[x].startswith("state") for x in a):
            inner = f"<{len(a)} state buffers>"
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, slice):
        return f"{_fmt(a.start, names) if a.start is not None else ''}:{_fmt(a.stop, names) if a.stop is not None else ''}"
    if isinstance(a, float):
        return f"{a:.4g}"
    if isinstance(a, torch.dtype):
        return str(a).replace("torch.", "")
    if isinstance(a, torch.device):
        return f"'{a.type}'"
    return repr(a)


def _target(n: fx.Node) -> str:
    if n.op == "call_method":
        return f".{n.target}"
    t = n.target
    name = getattr(t, "__name__", str(t))
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._opname}"
    mod = getattr(t, "__module__", "") or ""
    if mod.startswith("_operator"):
        return f"operator.{name}"
    if name == "scaled_dot_product_attention":
        return "sdpa"
    return name


def normalize_graph(gm: fx.GraphModule) -> str:
    """A short, stable text of a graph: one line per node, inputs renamed in order.

    Placeholders become ``in0, in1, ...`` (kvarn state buffers ``state0 ...``), other nodes
    ``v0, v1, ...``; the packed-state buffer lists collapse to ``<N state buffers>``.
    """
    names: dict[fx.Node, str] = {}
    lines, n_in, n_state, n_val = [], 0, 0, 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("kvarn_"):
                names[node] = f"state{n_state}"
                n_state += 1
            else:
                names[node] = f"in{n_in}"
                n_in += 1
            continue
        if node.op == "output":
            lines.append(f"return {_fmt(node.args[0], names)}")
            continue
        names[node] = f"v{n_val}"
        n_val += 1
        args = [_fmt(a, names) for a in node.args]
        args += [f"{k}={_fmt(v, names)}" for k, v in node.kwargs.items()]
        lines.append(f"{names[node]} = {_target(node)}({', '.join(args)})")
    if n_state:
        lines.insert(0, f"# {n_in} inputs + {n_state} kvarn state buffers")
    text = "\n".join(lines)
    text = re.sub(r"@[\w.-]+:\d+'", "'", text)       # site names carry a source line
    return re.sub(r"[ \t]+\n", "\n", text)


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(|ref| / |ref - actual|)."""
    ref, act = reference.double(), actual.double()
    return (20 * torch.log10(ref.norm() / (ref - act).norm().clamp_min(1e-30))).item()


def oracle_attention(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None = None,
                     *, scale: float | None = None, causal: bool = True, window: int = 0
                     ) -> torch.Tensor:
    """Plain float64 softmax attention of ``q`` [B, Hq, Tq, D] over a packed cache's
    dequantized K/V (:func:`kvarn_compile.ops.reference.materialize`): [B, Hq, Tq, D].

    The queries are the cache's newest Tq tokens. ``mask`` is a bool (True = attend) or an
    additive float mask broadcastable to [B, 1 or Hq, Tq, >= capacity]; ``window`` > 0 keeps
    the newest ``window`` keys of each query. A query that sees no key gets zeros. This is
    the oracle the fused ``kvarn::attention`` is tested against; it builds exactly what the
    runtime never does.
    """
    from kvarn_compile.ops.reference import materialize
    from kvarn_compile.state import BUF

    k, v = materialize(buffers, dtype=torch.float64)           # [B, H, cap, D]
    bsz, hq, tq, d = q.shape
    grp = hq // k.shape[1]
    k, v = k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1)
    cap = k.shape[2]
    lengths = buffers[BUF["lengths"]]
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
