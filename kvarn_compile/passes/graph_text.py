"""A short, stable text of an FX graph, one line per node: the backend's graph log
(``backend.graph_log``) and the golden graph tests both use it."""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx

__all__ = ["normalize_graph"]


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
        # Dynamo versions differ in tracing ``a == b`` as operator.eq or as ``.__eq__``
        op = n.target[2:-2] if n.target.startswith("__") and n.target.endswith("__") else None
        if op and callable(getattr(operator, op, None)):
            return f"operator.{op}"
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
