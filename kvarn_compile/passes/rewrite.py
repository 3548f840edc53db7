"""The KVarN rewrite: each matched site becomes ``kvarn::append_`` + ``kvarn::attention``.

:func:`rewrite_graph` takes the sites :func:`~kvarn_compile.passes.sites.find_sites` found,
gives each a packed state (:class:`RewriteContext`), replaces its cache write and attention,
retires the model's own cache and hands a preallocated one over to the append (``_hand_over``).

Scope and invariants of the whole pass:

* Input: a Dynamo (torch-IR) ``GraphModule``; the pass runs on a *copy* owned by the
  backend. Output: the rewritten graph plus extra graph inputs (the packed states' buffers),
  appended after Dynamo's inputs, that the backend passes on every call. In keyed mode
  (``RewriteContext.state_key``, the Inductor pre-grad pass) no input is added: the keyed
  ops find the states in :mod:`kvarn_compile.ops.keyed`.
* A site is rewritten only when every part matched a row of the tables (``cache_writes.py``,
  ``reads.py``, ``attention_forms.py``) and every check of ``matching.py`` passed;
  otherwise the graph is left exactly as it was for that site and the
  reason is reported. No site is ever half-rewritten.
* After a rewrite, the model's own K/V cache is never written by the graph (in-place
  caches: the write nodes are removed; ``cat`` caches: the graph hands back a tensor of the
  right shape, so the model's bookkeeping of the length stays right, with one element of
  storage per batch row holding the row's index, so a reorder between calls (beam search)
  reaches the next call, which reorders the packed rows). A
  preallocated cache that is a graph input is handed to the append (``kvarn::append_from_``
  or ``kvarn::append_keyed``, as a ``[B, H, S, D]`` view of the rows written), which reads
  it only when something wrote it since its last release, to take over a prompt that a
  non-compiled forward wrote there; then its memory is freed (the tensor stays valid and
  reads zeros: ``ops.buffers.release_storage``).
* An attention operand is traced back to its cache through view steps only
  (``reads.trace_kv``); the cache's layout (``[B, H, S, D]`` or ``[B, S, H, D]``), the
  batch rows and positions read and the GQA expansion come from that trace, and the write
  must append a run of positions along the traced positions axis.
* In-place method calls are never dropped by dead-code elimination (Dynamo records them
  with no users); see ``fx_utils.dce``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from kvarn_compile.passes.cache_writes import CacheWrite
from kvarn_compile.passes.fx_utils import _noop_cast, concrete, dce, example, is_op, is_size_query
from kvarn_compile.passes.matching import _key_len, _Match, _view_path
from kvarn_compile.passes.sites import SiteReport, find_sites, site_name
from kvarn_compile.passes.stacked_caches import LAYER_VIEW, is_layer_view, split_layer_views
from kvarn_compile.state import LayerState

#: ``SiteReport`` lives in :mod:`kvarn_compile.passes.sites`; callers outside the pass import it from here
__all__ = ["RewriteContext", "SiteReport", "CacheLocation", "rewrite_graph"]


@dataclasses.dataclass
class CacheLocation:
    """Where a rewritten site's KV cache lives among the graph's inputs and outputs, so that
    the front-end can key the packed state on the cache itself (the tensor the model owns,
    or the chain of handles a ``cat`` cache passes from call to call), not on a name.

    ``kind``: ``"buffer"`` (a preallocated cache written in place) or ``"chain"`` (a ``cat``
    cache). ``k_input``/``v_input``: graph-input indices of the K/V cache tensors (buffer:
    the tensor written; chain: the past the ``cat`` extends), None when the tensor is not a
    graph input (made inside the graph). ``k_outputs``/``v_outputs``: chain only, the
    positions in the graph's output of the handles standing for the ``cat``. ``perm``: the
    cache axes holding batch, heads, positions, head dim; ``adopts``: the rewritten graph
    hands the buffers to ``kvarn::append_from_``/``adopt_``, which takes over tokens a
    full-precision forward wrote there; ``new_tokens``: the tokens one call appends, when
    the graph fixes it (1: a decode step), else None; ``layer``: for a cache stacked over
    layers (``cache[layer]`` of one ``[L, ...]`` tensor), the layer this site's cache is, and
    ``k_input``/``v_input`` the stacked tensors.
    """

    kind: str
    site: str
    k_input: int | None = None
    v_input: int | None = None
    k_outputs: tuple[int, ...] = ()
    v_outputs: tuple[int, ...] = ()
    perm: tuple[int, int, int, int] = (0, 1, 2, 3)
    batch: int = 1
    adopts: bool = False
    new_tokens: int | None = None
    layer: int | None = None


@dataclasses.dataclass
class RewriteContext:
    """What the pass needs from the backend: states, options, the graph's inputs.

    ``get_state(name, *, batch, kv_heads, head_dim, value_head_dim, max_len, dtype, device[,
    tokens, fresh])`` returns a site's state; ``tokens``/``fresh`` come only for caches the model does not
    preallocate (``cat``): the tokens the site holds after this graph's append (an int, or a
    SymInt of the graph's inputs) and whether the graph starts a new sequence, so that a
    growable state can be sized before each call.
    """

    get_state: Callable[..., LayerState]
    method: str
    iters: int
    recent: int
    hold: int
    check_finite: bool
    max_cache_len: int
    release_buffers: bool
    #: keyed mode (the Inductor pre-grad pass, which cannot add graph inputs): site name ->
    #: registry key; the graph calls the keyed ops and adds no inputs. ``get_state`` then
    #: only sizes the report (a meta-device state).
    state_key: Callable[[str], str] | None = None
    #: inputs mode: adopt a prompt with a separate ``kvarn::adopt_`` before ``kvarn::append_``
    #: (the knob tuner instruments ``append_`` nodes) instead of ``kvarn::append_from_``
    separate_adopt: bool = False
    #: why absorbed multi-head latent attention sites stay unchanged in this compile (a
    #: front-end whose ops have no latent form: context parallelism); None: rewrite them
    latent_refused: str | None = None
    #: why sites whose attention weights are read elsewhere (``output_attentions``) stay
    #: unchanged in this compile (a front-end without ``kvarn::attention_weights`` for its
    #: states); None: rewrite them
    weights_refused: str | None = None
    #: filled by rewrite_graph (inputs mode): (graph input index, site report) of every
    #: model-owned cache tensor the caller must free after each call (see _hand_over)
    released_inputs: list[tuple[int, SiteReport]] = dataclasses.field(default_factory=list)
    #: filled by rewrite_graph: one :class:`CacheLocation` per rewritten site, in the order
    #: of its ``get_state`` calls
    locations: list[CacheLocation] = dataclasses.field(default_factory=list)


def _statically_zero(size: Any) -> bool:
    """``size`` (an int or a SymInt) is 0 whatever the graph's inputs (no guard added)."""
    if isinstance(size, torch.SymInt):
        return size.node.expr == 0
    return size == 0


def _start_node(graph: fx.Graph, w: CacheWrite, batch: int, row: int,
                device: torch.device) -> fx.Node:
    """An int64 [B] tensor with the first written position, built in the graph (``row``:
    elements per position, heads x head dim, for a cat cache's past length)."""
    if w.start_kind == "positions":   # checked to be one contiguous run at run time
        return graph.call_function(torch.ops.kvarn.positions_start.default, (w.start, batch))
    if w.start_kind == "int":
        return graph.call_function(torch.full, ((batch,), w.start),
                                   {"dtype": torch.int64, "device": device})
    # "past_len": a cat cache; its length is numel / (B * H * D) (0 for the empty start)
    numel = graph.call_method("numel", (w.start,))
    length = graph.call_function(operator.floordiv, (numel, batch * row))
    return graph.call_function(torch.full, ((batch,), length), {"dtype": torch.int64, "device": device})


def _past_row_tags(graph: fx.Graph, w: CacheWrite, batch: int) -> fx.Node | None:
    """The batch-row tags of a cat cache's past (the handle an earlier call returned, see
    step 4 of rewrite_graph), read in the graph: ``past[:, 0, 0, 0]``. None for an in-place
    cache, a single batch row or an empty past."""
    past = example(w.start)
    if w.cache is not None or batch == 1:                 # one row: nothing to reorder
        return None
    if past is None or past.dim() != 4 or (isinstance(past.shape[w.axis], int) and past.shape[w.axis] == 0):
        return None
    return graph.call_function(operator.getitem, (w.start, (slice(None), 0, 0, 0)))


def _same_size(a: Any, b: Any) -> bool:
    """``a == b`` known at compile time (ints, or one and the same symbol)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return str(a.node.expr) == str(b.node.expr)
    return False


def _key_length(graph: fx.Graph, m: _Match, w: CacheWrite, row: int) -> Any:
    """The key length the model's attention reads: the positions read of a preallocated
    cache, or past + new tokens of a cat cache (built from the past's numel; the cat itself
    is gone)."""
    if w.cache is not None:
        return m.lk
    past_len = graph.call_function(
        operator.floordiv, (graph.call_method("numel", (w.start,)), m.batch * row))
    return graph.call_function(operator.add, (past_len, graph.call_method("size", (w.new, w.axis))))


def _returned_weights(graph: fx.Graph, m: _Match, q: fx.Node, bufs: list[fx.Node],
                      mask: fx.Node | None, scale: float, row: int) -> None:
    """The attention weights the model also returns (``output_attentions``), computed from the
    packed cache by ``kvarn::attention_weights`` (the same arguments as the attention), laid
    out and cast as the model's own, for every reader of them outside the attention."""
    shared = m.site.weights
    keys = _key_length(graph, m, m.wk, row)
    wts = graph.call_function(torch.ops.kvarn.attention_weights.default,
                              (q, bufs, mask, scale, m.causal, 0, keys))
    wts = _permuted(graph, wts, tuple("bhtk".index(r) for r in m.site.weight_roles))
    want = example(shared)
    if want is not None and want.dtype != torch.float32:
        wts = graph.call_method("to", (wts, want.dtype))
    wts.meta["example_value"] = want
    for user in list(shared.users):
        if user not in m.site.nodes:
            user.replace_input_with(shared, wts)


def _top_left_causal(graph: fx.Graph, m: _Match, q: fx.Node, row: int,
                     device: torch.device) -> fx.Node:
    """``sdpa(is_causal=True)`` with Tq != Lk aligns its mask to the top-left corner (query i
    sees keys 0..i, PyTorch's ``tril(ones(Tq, Lk))``): that mask, [1, 1, Tq, Lk], indexed by
    absolute key position as kvarn::attention reads it. Keys 0..i are always written (query
    i sits at position >= i), so the bottom-right causal flag hides none of them."""
    tq = graph.call_method("size", (q, 2))
    lk = _key_length(graph, m, m.wk, row)
    ones = graph.call_function(torch.ones, ((tq, lk),), {"dtype": torch.bool, "device": device})
    tril = graph.call_method("tril", (ones,))
    return graph.call_function(operator.getitem, (tril, (None, None)))


def _build_mask(graph: fx.Graph, spec: Any) -> fx.Node | None:
    """The mask kvarn::attention takes for a MaskSpec (see attention_forms.MaskSpec)."""
    if spec is None:
        return None
    node = spec.node
    if spec.perm is not None:           # scores in another order (einsum "->bsht")
        dim = example(node).dim()
        if dim < 4:
            node = graph.call_function(operator.getitem, (node, (None,) * (4 - dim) + (Ellipsis,)))
        node = _permuted(graph, node, spec.perm)
    if spec.kind in ("tensor", "bool"):
        return node
    if spec.kind == "add":
        return node if spec.scale == 1.0 else graph.call_function(operator.mul, (node, spec.scale))
    if spec.kind == "not":
        return graph.call_function(operator.invert, (node,))
    zeros = graph.call_function(torch.zeros_like, (node,), {"dtype": torch.float32})
    where = node if spec.kind == "fill" else graph.call_function(operator.invert, (node,))
    return graph.call_method("masked_fill", (zeros, where, spec.value))


def _mask_is_bool(spec: Any) -> bool:
    if spec.kind in ("bool", "not"):
        return True
    if spec.kind == "tensor":
        return example(spec.node).dtype == torch.bool
    return False


def _window_mask(graph: fx.Graph, m: _Match, mask: fx.Node | None, device: torch.device) -> fx.Node:
    """A window read ``cache[..., lo:end]``: kvarn::attention reads positions [0, end), so
    the model's mask (over the ``end - lo`` positions read) gets ``lo`` hidden columns in
    front; without a mask (one query, or non-causal), the positions before ``lo`` are hidden."""
    lo = m.lo
    if mask is None:
        cols = graph.call_function(torch.arange, (m.lk,), {"device": device})
        keep = graph.call_function(operator.ge, (cols, lo))
        return graph.call_function(operator.getitem, (keep, (None, None, None)))
    hidden = False if _mask_is_bool(m.site.mask) else -math.inf
    return graph.call_function(torch.nn.functional.pad, (mask, (lo, 0)), {"value": hidden})


def _as_bhsd(graph: fx.Graph, node: fx.Node, perm: tuple[int, int, int, int],
             ndim: int | None = None) -> fx.Node:
    """A cache (or its new rows) as ``[B, H, S, D]``: permuted by the cache's ``perm``; a
    cache without a heads axis (3-D: a multi-head latent attention latent, ``perm[1] == 3``)
    first gets its virtual trailing heads axis of size one. ``ndim``: the node's number of
    dims, for a node made by the rewrite (no example value)."""
    if (example(node).dim() if ndim is None else ndim) == 3:
        node = graph.call_method("unsqueeze", (node, -1))
    return _permuted(graph, node, perm)


def _bhsd_size(value: torch.Tensor, axis: int) -> Any:
    """Size of ``value``'s cache axis ``axis`` (1 for the virtual heads axis of a 3-D cache)."""
    return 1 if axis >= value.dim() else concrete(value.shape[axis])


def _permuted(graph: fx.Graph, node: fx.Node, perm: tuple[int, ...] | None) -> fx.Node:
    if perm is None or tuple(perm) == tuple(range(len(perm))):
        return node
    if sorted(perm) == list(range(len(perm))) and sum(a != b for a, b in zip(perm, range(len(perm)))) == 2:
        a, b = [i for i, p in enumerate(perm) if p != i]
        return graph.call_method("transpose", (node, a, b))
    return graph.call_method("permute", (node, *perm))


def _shape_queries_on(graph: fx.Graph, reads: list[fx.Node], cat: fx.Node, handle: fx.Node) -> None:
    """Shape queries of the read chain's views of ``cat`` (``b, h, s, d = keys.shape`` in a
    ``repeat_kv``) ask the same views of ``handle`` instead (same shape, copy-free; checked
    by ``_check_readers``), so the cat and its views can go."""
    for node in reads:
        queries = [u for u in node.users if is_size_query(u, node)]
        path = _view_path(node, cat) if queries else None
        if not path:
            continue
        for q in queries:
            with graph.inserting_before(q):
                x = handle
                for step in path:
                    x = graph.node_copy(step, lambda n, prev=step.args[0], new=x: new if n is prev else n)
            q.replace_input_with(node, x)


def _erase_unused(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase the nodes of ``nodes`` left without users, repeatedly (a chain in any order)."""
    todo = [n for n in dict.fromkeys(nodes)]
    changed = True
    while changed:
        changed = False
        for n in list(todo):
            if not getattr(n, "_erased", False) and not n.users:
                graph.erase_node(n)
                n._erased = True
                todo.remove(n)
                changed = True
            elif getattr(n, "_erased", False):
                todo.remove(n)


def _cache_views(root: fx.Node) -> list[fx.Node]:
    """Alias and slice nodes of an in-place cache (no-op casts, ``cache[:B, ...]``)."""
    out, frontier = [], [root]
    while frontier:
        x = frontier.pop()
        for u in x.users:
            if u.op != "output" and u.args and u.args[0] is x and (_noop_cast(u) or is_op(u, "getitem")):
                out.append(u)
                frontier.append(u)
    return out


def rewrite_graph(gm: fx.GraphModule, example_inputs: list[Any], ctx: RewriteContext,
                  graph_id: int = 0) -> tuple[list[torch.Tensor], list[SiteReport]]:
    """Rewrite ``gm`` in place; return (extra inputs to append, per-site reports).

    ``example_inputs`` is not read (model-owned buffers are freed at run time, see
    ``_hand_over``); it stays for callers written against the earlier signature.
    """
    graph = gm.graph
    side_effects = [n for n in graph.nodes if not n.users and n.op not in ("placeholder", "output")]
    undo = split_layer_views(graph)     # caches stacked over layers: one 4-D view per layer
    matches, reports = find_sites(graph)
    if undo is not None and not any(is_layer_view(m.wk.cache) for m in matches):
        undo()                          # no site over a stacked cache: leave Dynamo's graph
    for r in reports:
        r.graph = graph_id
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first_body = placeholders[-1].next if placeholders else next(iter(graph.nodes))
    extra: list[torch.Tensor] = []
    caches: list[tuple[SiteReport, _Match, fx.Node, CacheLocation]] = []
    keyed = ctx.state_key is not None
    stems: set[str] = set()
    for m in matches:
        name = site_name(m.site.out)
        latent = m.site.latent is not None
        refused = ctx.latent_refused or (
            "the Inductor pre-grad pass (inductor_pass) does not rewrite absorbed multi-head "
            "latent attention; compile with backend=kvarn_backend(...) to pack its latent cache"
            if keyed else None)
        if latent and refused:
            reports.append(SiteReport(name, False, m.site.form, reason=refused, graph=graph_id))
            continue
        refused = ctx.weights_refused or (
            "the attention weights are returned (output_attentions), which the Inductor pre-grad "
            "pass (inductor_pass) does not compute from a packed cache; compile with "
            "backend=kvarn_backend(...)" if keyed else None)
        if m.site.weights is not None and refused:
            reports.append(SiteReport(name, False, m.site.form, reason=refused, graph=graph_id))
            continue
        raw = example(m.wk.new)
        batch, heads, _, dim = (_bhsd_size(raw, a) for a in m.perm)
        growth = {}
        if m.wk.cache is not None:
            max_len = int(example(m.wk.cache).shape[m.perm[2]])
        else:
            max_len = ctx.max_cache_len
            # a cat cache: the packed state may grow with the sequence; it must hold the
            # cat's length (past + new, an int or a SymInt of the graph's inputs) after this
            # graph's append, and a past that is statically empty starts a new sequence
            tokens = example(m.wk.full).shape[m.wk.axis]
            past = tokens - example(m.wk.new).shape[m.wk.axis]
            growth = dict(tokens=tokens, fresh=_statically_zero(past))
        dv = concrete(example(m.wv.new).shape[m.perm[3]])   # the values' head dim (MLA: not dim)
        if latent:
            growth["latent"] = True     # the RoPE key (the values) at LATENT_ROPE_BITS
        state = ctx.get_state(name, batch=batch, kv_heads=heads, head_dim=dim,
                              value_head_dim=dv, max_len=max_len,
                              dtype=raw.dtype, device=raw.device, **growth)
        loc = _location(m, name, placeholders)
        new_tokens = _bhsd_size(raw, m.perm[2])
        loc.new_tokens = new_tokens if isinstance(new_tokens, int) else None
        ctx.locations.append(loc)
        # 1. the state's buffers become graph inputs (keyed mode: a constant key instead)
        bufs: list[fx.Node] = []
        if not keyed:
            with graph.inserting_before(first_body):
                stem = f"kvarn_{re.sub(r'[^0-9a-zA-Z_]', '_', name)}"
                while stem in stems:       # two sites named alike (one helper, two caches)
                    stem += "_"
                stems.add(stem)
                for i, t in enumerate(state.buffers):
                    ph = graph.placeholder(f"{stem}_{i}")
                    ph.meta["example_value"] = t
                    bufs.append(ph)
            extra.extend(state.buffers)
        # 2. quantize-on-append where the model wrote its cache (new rows as [B, H, T, D])
        # (a latent's RoPE key is often computed between the two writes: after the last)
        order = list(graph.nodes)
        first_write = (max if latent else min)((n for n in m.wk.write_nodes + m.wv.write_nodes),
                                               key=order.index)
        with graph.inserting_before(first_write):
            start = _start_node(graph, m.wk, batch, heads * dim, raw.device)
            new_k = _as_bhsd(graph, m.wk.new, m.perm)
            new_v = _as_bhsd(graph, m.wv.new, m.perm)
            rows = _past_row_tags(graph, m.wk, batch)
            if rows is not None and keyed:
                new_k = graph.call_function(torch.ops.kvarn.reorder_keyed.default,
                                            (new_k, rows, ctx.state_key(name)))
            elif rows is not None:
                graph.call_function(torch.ops.kvarn.reorder_.default, (bufs, rows, name))
            if keyed:
                append = graph.call_function(
                    torch.ops.kvarn.append_keyed.default,
                    (new_k, new_v, start, None, None, ctx.state_key(name), max_len,
                     ctx.method, ctx.iters, ctx.recent, ctx.hold, ctx.check_finite, False))
            else:
                append = graph.call_function(
                    torch.ops.kvarn.append_.default,
                    (bufs, new_k, new_v, start, ctx.method, ctx.iters, ctx.recent,
                     ctx.hold, ctx.check_finite, name))
        # 3. fused attention in place of the model's attention (see _read_kind for `causal`)
        scale = m.site.scale if m.site.scale is not None else dim ** -0.5
        with graph.inserting_before(m.site.out):
            q = _permuted(graph, m.site.q, m.site.q_perm)
            mask = _build_mask(graph, m.site.mask)
            if m.lo is not None:
                mask = _window_mask(graph, m, mask, raw.device)
            if m.site.is_causal and not _same_size(_key_len(m.site), example(q).shape[2]):
                mask = _top_left_causal(graph, m, q, heads * dim, raw.device)
            if latent:
                q_pe = _permuted(graph, m.site.latent.q_pe, m.site.latent.pe_perm)
                dec = m.site.decompression
                if dec is not None:     # the up-projection folded into the queries
                    w3 = graph.call_method("view", (dec.weight, dec.heads, dec.nope + dec.v_dim, -1))
                    w_k = graph.call_function(operator.getitem, (w3, (slice(None), slice(None, dec.nope))))
                    q = graph.call_function(torch.einsum, ("bhsn,hnc->bhsc", q, w_k))
                att = graph.call_function(torch.ops.kvarn.latent_attention.default,
                                          (q, q_pe, bufs, mask, float(scale), m.causal, 0))
                if dec is not None:     # ... and into the output
                    w_v = graph.call_function(operator.getitem, (w3, (slice(None), slice(dec.nope, None))))
                    att = graph.call_function(torch.einsum, ("bhsc,hvc->bhsv", att, w_v))
            elif keyed:
                att = graph.call_function(torch.ops.kvarn.attention_keyed.default,
                                          (q, append, mask, ctx.state_key(name),
                                           float(scale), m.causal, 0))
            else:
                att = graph.call_function(torch.ops.kvarn.attention.default,
                                          (q, bufs, mask, float(scale), m.causal, 0))
            att = _permuted(graph, att, m.site.out_perm)
            att.meta["example_value"] = example(m.site.out)
            if m.site.weights is not None:
                _returned_weights(graph, m, q, bufs, mask, float(scale), heads * dim)
        m.site.out.replace_all_uses_with(att)
        # 4. the model's cache is no longer written; cat caches get a row-tagged handle
        handles = {}
        for w in (m.wk, m.wv):
            if w.cache is None:
                cat = w.full
                with graph.inserting_before(cat.next):    # before any reader of the cat's shape
                    shape = list(example(cat).shape)
                    # row i of the handle holds i: a reorder of the cache outside the graph
                    # (beam search) reaches the next call as the order of these tags
                    tags = graph.call_function(torch.arange, (batch,),
                                               {"dtype": raw.dtype, "device": raw.device})
                    zero = graph.call_method("view", (tags, batch, 1, 1, 1))
                    shape[w.axis] = _key_length(graph, m, w, heads * (dim if w is m.wk else dv))
                    handle = graph.call_method("expand", (zero, *shape))
                handles[w is m.wk] = handle
                for user in list(cat.users):
                    if user.op == "output" or is_size_query(user, cat):
                        user.replace_input_with(cat, handle)    # same shape as the cat
                _shape_queries_on(graph, m.rk.nodes if w is m.wk else m.rv.nodes, cat, handle)
        _erase_unused(graph, list(m.site.nodes) + m.rk.nodes + m.rv.nodes
                      + m.wk.write_nodes + m.wv.write_nodes)
        for w in (m.wk, m.wv):
            if w.cache is not None:
                for node in w.write_nodes:        # in-place writes have no users left
                    if not getattr(node, "_erased", False):
                        graph.erase_node(node)
                        node._erased = True
                _drop_aliases(graph, w.cache)
        if handles:
            loc.k_outputs, loc.v_outputs = (_output_positions(graph, handles.get(k)) for k in (True, False))
        report = SiteReport(name, True, m.site.form, m.wk.spelling, m.rk.spelling,
                            state_bytes=state.nbytes, graph=graph_id)
        reports.append(report)
        if m.wk.cache is not None:
            caches.append((report, m, append, loc))
    dce(graph, keep=[n for n in side_effects if not getattr(n, "_erased", False)])
    for report, m, append, loc in caches:
        loc.adopts = _hand_over(graph, ctx, report, m, append, placeholders)
    graph.lint()
    gm.recompile()
    return extra, reports


def _location(m: _Match, name: str, placeholders: list[fx.Node]) -> CacheLocation:
    """The :class:`CacheLocation` of match ``m`` (outputs filled in after the rewrite)."""
    def index(node: Any) -> int | None:
        return placeholders.index(node) if isinstance(node, fx.Node) and node in placeholders else None

    if is_layer_view(m.wk.cache) and is_layer_view(m.wv.cache):
        (root_k, layer), (root_v, layer_v) = m.wk.cache.meta[LAYER_VIEW], m.wv.cache.meta[LAYER_VIEW]
        if layer == layer_v:
            return CacheLocation("buffer", name, index(root_k), index(root_v), perm=tuple(m.perm),
                                 batch=m.batch, layer=layer)
    if m.wk.cache is not None:
        return CacheLocation("buffer", name, index(m.wk.cache), index(m.wv.cache),
                             perm=tuple(m.perm), batch=m.batch)
    return CacheLocation("chain", name, index(m.wk.start), index(m.wv.start), perm=tuple(m.perm),
                         batch=m.batch)


def _output_positions(graph: fx.Graph, node: fx.Node | None) -> tuple[int, ...]:
    """Positions of ``node`` in the graph's (flat) output tuple."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    return tuple(i for i, v in enumerate(values) if node is not None and v is node)


def _drop_aliases(graph: fx.Graph, root: fx.Node) -> None:
    """After the rewrite: the outputs that handed back a no-op alias of a cache graph input
    (``self.cache_k = self.cache_k.to(x)``) hand back the input itself; unused views go."""
    views = _cache_views(root)
    if root.op == "placeholder":
        for v in views:
            if _noop_cast(v):
                for user in list(v.users):
                    if user.op == "output":
                        user.replace_input_with(v, root)
    _erase_unused(graph, list(reversed(views)))


def _hand_over(graph: fx.Graph, ctx: RewriteContext, report: SiteReport, m: _Match,
               append: fx.Node, placeholders: list[fx.Node]) -> bool:
    """Give the model's own preallocated K/V tensors (graph inputs the rewritten graph no
    longer reads) to the append: a prompt a non-compiled forward wrote there is adopted
    into the packed state, then their memory is freed (``release_buffers``).

    The append reads them as [B, H, S, D] views (a ``[B, S, H, D]`` cache transposed, a
    larger batch sliced to the rows written). Keyed mode: ``kvarn::append_keyed`` takes them
    and frees whole buffers itself (a view it cannot free is kept). Inputs mode:
    ``kvarn::append_from_`` (``kvarn::adopt_`` + ``kvarn::append_`` with
    ``ctx.separate_adopt``) replaces the append, and the backend's runtime wrapper frees
    the inputs listed in ``ctx.released_inputs`` after each call. Either way a tensor that
    is passed later in their place (a second transformers StaticCache) is freed as well.
    """
    cache_k, cache_v = m.wk.cache, m.wv.cache
    if cache_k not in placeholders or cache_v not in placeholders:
        return False
    if any(u.op != "output" for c in (cache_k, cache_v) for u in c.users):
        return False
    views = []
    with graph.inserting_before(append):
        for c in (cache_k, cache_v):
            v = c
            if m.batch != example(c).shape[m.perm[0]]:
                index = [slice(None)] * example(c).dim()
                index[m.perm[0]] = slice(None, m.batch)
                v = graph.call_function(operator.getitem, (v, tuple(index)))
            views.append(_as_bhsd(graph, v, m.perm, example(c).dim()))
    view_k, view_v = views
    whole = view_k is cache_k and view_v is cache_v
    if ctx.state_key is not None:
        args = list(append.args)
        args[3], args[4], args[12] = view_k, view_v, bool(ctx.release_buffers) and whole
        append.args = tuple(args)
        return True
    fresh = bool(ctx.release_buffers)
    if ctx.separate_adopt:
        bufs, _, _, start = append.args[:4]
        with graph.inserting_before(append):
            graph.call_function(torch.ops.kvarn.adopt_.default,
                                (bufs, view_k, view_v, start, ctx.method, ctx.iters, ctx.recent,
                                 ctx.hold, ctx.check_finite, append.args[9], fresh))
    else:
        with graph.inserting_before(append):
            merged = graph.call_function(torch.ops.kvarn.append_from_.default,
                                         (*append.args, view_k, view_v, fresh))
        append.replace_all_uses_with(merged)
        graph.erase_node(append)
    if ctx.release_buffers:
        ctx.released_inputs.extend((placeholders.index(c), report) for c in (cache_k, cache_v))
    return True
