"""Caches stacked over layers: one tensor ``[L, B, S, H, D]`` (or ``[L, B, H, S, D]``) that
every layer indexes with its own layer number.

mistral-inference's ``BufferCache`` and nanochat's ``KVCache`` hold all layers' K (and V) in
one tensor; llama-style code on such a cache writes ``cache_k[layer, :bsz, a:b] = xk`` and
reads ``cache_k[layer, :bsz, :b]``: one basic index whose first entry is the layer's int.
:func:`split_layer_views` spells each such index as two, ``view = cache_k[layer]`` (one node
per tensor and layer, a view: the same memory) and the rest of the index on ``view``, so that
the rest of the pass sees one 4-D cache per layer (``view``, marked with
:data:`LAYER_VIEW`): the write and read tables match it as they match a per-layer cache, and
another layer's reads are reads of another cache. It returns a function that puts the graph
back as it was (called when no site over such a cache is rewritten, so an unchanged graph is
exactly Dynamo's).

A layer view is not a graph input: the packed state of its site is kept by site name (the
backend's fallback for caches made inside the graph), and the stacked tensor itself is not
released (the other layers' views share its memory).
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx

from kvarn_compile.passes.fx_utils import example, is_op

__all__ = ["LAYER_VIEW", "split_layer_views", "is_layer_view"]

#: meta key of a layer view node: (the stacked tensor node, the layer index)
LAYER_VIEW = "kvarn_layer_view"


def is_layer_view(node: object) -> bool:
    return isinstance(node, fx.Node) and LAYER_VIEW in node.meta


def _layer_index(node: fx.Node) -> tuple[fx.Node, int, tuple] | None:
    """(stacked tensor, layer, rest of the index) of ``x[layer, ...] (= v)`` on a 5-D tensor."""
    if not (is_op(node, "getitem") or is_op(node, "setitem")) or len(node.args) < 2:
        return None
    root, index = node.args[:2]
    val = example(root)
    if not isinstance(root, fx.Node) or not isinstance(val, torch.Tensor) or val.dim() != 5:
        return None
    entries = index if isinstance(index, tuple) else (index,)
    if not entries or isinstance(entries[0], bool) or not isinstance(entries[0], int):
        return None
    if any(isinstance(e, fx.Node) or e is None for e in entries[1:]):
        return None                             # advanced indexing or new axes: not ours
    rest = tuple(entries[1:]) or (Ellipsis,)
    return root, entries[0], rest


def split_layer_views(graph: fx.Graph) -> Callable[[], None] | None:
    """Rewrite ``x[layer, rest]`` (read or ``setitem``) on 5-D tensors as ``x[layer][rest]``;
    returns the undo, or None when the graph has no such index."""
    views: dict[tuple[fx.Node, int], fx.Node] = {}
    changed: list[tuple[fx.Node, tuple]] = []
    for node in list(graph.nodes):
        found = _layer_index(node)
        if found is None:
            continue
        root, layer, rest = found
        key = (root, layer % example(root).shape[0])
        if key not in views:
            with graph.inserting_before(node):
                view = graph.call_function(operator.getitem, (root, key[1]))
            view.meta.update({k: v for k, v in node.meta.items()
                              if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
            view.meta["example_value"] = example(root)[key[1]]
            view.meta[LAYER_VIEW] = key
            views[key] = view
        changed.append((node, node.args))
        node.args = (views[key], rest, *node.args[2:])
    if not changed:
        return None

    def undo() -> None:
        for node, args in changed:
            node.args = args
        for view in views.values():
            if not view.users:
                graph.erase_node(view)

    return undo
