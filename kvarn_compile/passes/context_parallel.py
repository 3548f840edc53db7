"""Point a rewritten graph's kvarn ops at their context-parallel forms.

``kvarn_backend(..., context_parallel=group)`` runs the ordinary pass, then this: every
``kvarn::append_`` / ``append_from_`` / ``attention`` call gets the ``cp_`` op with the
group's key as its last argument (:mod:`kvarn_compile.ops.context_parallel`). The graph is
otherwise unchanged, so the report, the graph diff and the cache hand-over stay the same.
"""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["use_context_parallel_ops", "CP_OPS"]


def _ops() -> dict:
    k = torch.ops.kvarn
    return {k.append_.default: k.cp_append_.default,
            k.append_from_.default: k.cp_append_from_.default,
            k.attention.default: k.cp_attention.default}


#: plain op -> context-parallel op (filled on first use: the ops register on import)
CP_OPS: dict = {}


def use_context_parallel_ops(gm: fx.GraphModule, key: str) -> int:
    """Replace the plain ops in ``gm`` in place; returns how many calls changed.

    Raises ValueError for a graph holding an op that has no context-parallel form (the
    separate ``adopt_`` of knob tuning), before changing anything.
    """
    if not CP_OPS:
        CP_OPS.update(_ops())
    k = torch.ops.kvarn
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (k.adopt_.default, k.commit_.default,
                                                          k.tune_observe_.default):
            raise ValueError(f"context_parallel: the graph calls {node.target}, which has no "
                             "context-parallel form; leave tune_knobs out with context_parallel.")
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in CP_OPS:
            node.target = CP_OPS[node.target]
            node.args = (*node.args, key)
            changed += 1
    if changed:
        gm.recompile()
    return changed
