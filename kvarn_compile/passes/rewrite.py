"""The KVarN graph pass: pair each attention with the cache writes feeding it, rewrite both.

Scope and invariants:

* Input: a Dynamo (torch-IR) ``GraphModule``; the pass runs on a *copy* owned by the
  backend. Output: the rewritten graph plus extra graph inputs (the packed states' buffers),
  appended after Dynamo's inputs, that the backend passes on every call. In keyed mode
  (``RewriteContext.state_key``, the Inductor pre-grad pass) no input is added: the keyed
  ops find the states in :mod:`kvarn_compile.registry`.
* A site is rewritten only when every part matched a row of ``patterns.py`` and every
  check below passed; otherwise the graph is left exactly as it was for that site and the
  reason is reported. No site is ever half-rewritten.
* After a rewrite, the model's own K/V cache is never written by the graph (in-place
  caches: the write nodes are removed; ``cat`` caches: the graph hands back a tensor of the
  right shape, so the model's bookkeeping of the length stays right, with one element of
  storage per batch row holding the row's index, so a reorder between calls (beam search)
  reaches the next call, which reorders the packed rows). A
  preallocated cache that is a graph input is handed to the append (``kvarn::append_from_``
  or ``kvarn::append_keyed``), which reads it only while it still holds storage, to take
  over a prompt that a non-compiled forward wrote there; then its storage is freed.
* In-place method calls are never dropped by dead-code elimination (Dynamo records them
  with no users); see ``fx_utils.dce``.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from kvarn_compile.passes.fx_utils import dce, example, module_path
from kvarn_compile.passes.patterns import (
    ATTENTIONS, CACHE_WRITES, KV_READS, AttentionSite, CacheWrite, KVRead, Unsupported,
)
from kvarn_compile.state import LayerState

__all__ = ["SiteReport", "rewrite_graph", "find_sites"]


@dataclasses.dataclass
class SiteReport:
    """What happened to one attention site of one compiled graph."""

    name: str
    rewritten: bool
    attention: str = ""
    cache: str = ""
    read: str = ""
    reason: str = ""
    state_bytes: int = 0
    released_bytes: int = 0
    graph: int = 0

    def line(self) -> str:
        if self.rewritten:
            return (f"  [rewritten] {self.name}: {self.attention} over {self.cache}"
                    f"{' via ' + self.read if self.read else ''}")
        return f"  [unchanged] {self.name}: {self.attention or 'attention'} - {self.reason}"


@dataclasses.dataclass
class _Match:
    site: AttentionSite
    wk: CacheWrite
    wv: CacheWrite
    rk: KVRead | None
    rv: KVRead | None


def site_name(node: fx.Node) -> str:
    """Stable name of an attention site: its module path, else its source line.

    Graphs compiled for one model (prefill, decode, recompiles) name a site identically,
    so they share one packed state; two different sites never share a name.
    """
    path = module_path(node)
    if path:
        return path
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [line.strip() for line in trace if line.strip().startswith("File ")]
    if frames:
        loc = frames[-1].split(",")
        file = loc[0].split('"')[1].rsplit("/", 1)[-1] if '"' in loc[0] else loc[0]
        line = loc[1].strip().replace("line ", "") if len(loc) > 1 else "?"
        func = loc[2].strip().replace("in ", "") if len(loc) > 2 else ""
        return f"{func or node.name}@{file}:{line}"
    return node.name


def _strip_read(node: Any) -> tuple[Any, KVRead | None]:
    for _, matcher in KV_READS:
        read = matcher(node) if isinstance(node, fx.Node) else None
        if read is not None:
            return read.source, read
    return node, None


def _find_writes(graph: fx.Graph) -> dict[fx.Node, list[CacheWrite]]:
    writes: dict[fx.Node, list[CacheWrite]] = {}
    for node in graph.nodes:
        for _, matcher in CACHE_WRITES:
            w = matcher(node)
            if w is not None:
                writes.setdefault(w.full, []).append(w)
                break
    return writes


def find_sites(graph: fx.Graph) -> tuple[list[_Match], list[SiteReport]]:
    """Every attention of the graph: the rewritable ones, and reports for the others
    (including attention-like softmaxes no row of ``ATTENTIONS`` recognizes)."""
    writes = _find_writes(graph)
    matches, skipped = [], []
    seen: set[fx.Node] = set()          # outputs of recognized (matched or refused) forms
    covered: set[fx.Node] = set()       # nodes of recognized forms
    for node in list(graph.nodes):
        for form, matcher in ATTENTIONS:
            try:
                site = matcher(node)
            except Unsupported as err:
                skipped.append(SiteReport(site_name(node), False, form, reason=str(err)))
                seen.add(node)
                break
            if site is None:
                continue
            seen.add(node)
            covered.update(site.nodes)
            name = site_name(node)
            try:
                matches.append(_pair(site, writes))
            except Unsupported as err:
                skipped.append(SiteReport(name, False, site.form, reason=str(err)))
            break
    for node in graph.nodes:
        reason = _unrecognized_attention(node, seen, covered)
        if reason is not None:
            skipped.append(SiteReport(site_name(node), False, "attention-like softmax",
                                      reason=reason))
    return matches, skipped


#: ops an unrecognized attention may put between the q·kᵀ product and the softmax
_SCORE_OPS = {"add", "add_", "iadd", "sub", "mul", "truediv", "div", "tanh", "to", "float",
              "type", "type_as", "half", "bfloat16", "masked_fill", "masked_fill_", "where",
              "view", "reshape", "contiguous", "clamp", "getitem", "neg", "exp", "sigmoid"}
_PRODUCTS = {"matmul", "bmm", "baddbmm", "einsum"}
_WEIGHT_OPS = {"to", "float", "type", "type_as", "half", "bfloat16", "dropout", "contiguous"}


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    name = getattr(node.target, "__name__", "") or ""
    return {"_scaled_dot_product_attention": "sdpa"}.get(name, name)


def _unrecognized_attention(node: fx.Node, seen: set[fx.Node], covered: set[fx.Node]) -> str | None:
    """A reason when ``node`` is a softmax over a q·kᵀ product (through elementwise score
    ops: soft-capping, ALiBi, masks built from the scores, casts) that no attention form
    covered; else None."""
    if node.op not in ("call_function", "call_method") or _op_name(node) not in ("softmax", "_softmax") \
            or node in covered:
        return None
    # the weights' consumers (through casts/dropout): a recognized (refused) form's output?
    frontier, steps = [node], 0
    while frontier and steps < 8:
        nxt = []
        for n in frontier:
            for user in n.users:
                if user in seen:
                    return None
                if user.op in ("call_function", "call_method") and _op_name(user) in _WEIGHT_OPS:
                    nxt.append(user)
        frontier, steps = nxt, steps + 1
    path, cur = [], node.args[0] if node.args else None
    for _ in range(12):
        if not isinstance(cur, fx.Node) or cur.op not in ("call_function", "call_method"):
            return None
        name = _op_name(cur)
        if name in _PRODUCTS:
            chain = " -> ".join([name, *reversed(path), "softmax"])
            return (f"not recognized: softmax over a q·kᵀ product ({chain}); the pass rewrites "
                    "matmul [* or / scale] [+ mask] -> softmax -> matmul and scaled_dot_product_"
                    "attention only, so this attention keeps its full-precision cache")
        if name not in _SCORE_OPS:
            return None
        path.append(name)
        tensors = [a for a in cur.args if isinstance(a, fx.Node)]
        # follow the operand that leads to a product (the scores, not a mask or a bias)
        cur = next((a for a in tensors if _leads_to_product(a)), tensors[0] if tensors else None)
    return None


def _leads_to_product(node: fx.Node, depth: int = 12) -> bool:
    cur = node
    for _ in range(depth):
        if not isinstance(cur, fx.Node) or cur.op not in ("call_function", "call_method"):
            return False
        name = _op_name(cur)
        if name in _PRODUCTS:
            return True
        if name not in _SCORE_OPS:
            return False
        tensors = [a for a in cur.args if isinstance(a, fx.Node)]
        if not tensors:
            return False
        if len(tensors) > 1:
            return any(_leads_to_product(a, depth - 1) for a in tensors)
        cur = tensors[0]
    return False


def _pair(site: AttentionSite, writes: dict[fx.Node, list[CacheWrite]]) -> _Match:
    k_src, rk = _strip_read(site.k)
    v_src, rv = _strip_read(site.v)
    wk_list, wv_list = writes.get(k_src), writes.get(v_src)
    if not wk_list or not wv_list:
        raise Unsupported("its keys/values do not come from a recognized KV-cache update "
                          "(attention without a cache, e.g. an encoder or a cache-less forward)")
    if len(wk_list) > 1 or len(wv_list) > 1:
        raise Unsupported("the cache is written more than once in one step")
    wk, wv = wk_list[0], wv_list[0]
    if wk.spelling != wv.spelling:
        raise Unsupported(f"keys and values use different cache updates ({wk.spelling} / {wv.spelling})")
    if k_src is v_src:
        raise Unsupported("keys and values share one cache tensor")
    qv, kn, vn = example(site.q), example(wk.new), example(wv.new)
    if qv is None or kn is None or vn is None or kn.dim() != 4 or tuple(kn.shape) != tuple(vn.shape):
        raise Unsupported("the new keys/values are not [batch, kv_heads, tokens, head_dim] of one shape")
    if any(not isinstance(s, int) for s in (*kn.shape[:2], kn.shape[3], qv.shape[1])):
        raise Unsupported("dynamic batch, head or head_dim sizes (e.g. the same compiled model ran "
                          "with a second batch size); this graph runs in full precision - compile "
                          "a fresh model per batch size to keep the cache compressed")
    if qv.shape[-1] != kn.shape[-1] or qv.shape[1] % kn.shape[1]:
        raise Unsupported(f"query heads {qv.shape[1]} / head_dim {qv.shape[-1]} do not fit "
                          f"kv heads {kn.shape[1]} / head_dim {kn.shape[-1]}")
    if kn.shape[-1] % 16:
        raise Unsupported(f"head_dim {kn.shape[-1]} is not a multiple of 16")
    # the cache must be used by this write and this read only
    for w, read in ((wk, rk), (wv, rv)):
        allowed = set(w.write_nodes) | ({read.nodes[-1]} if read else {site.k, site.v} | set(site.nodes))
        holder = w.cache if w.cache is not None else w.full
        others = [u for u in holder.users if u not in allowed and u.op != "output"]
        if others:
            raise Unsupported(f"the cache is also read by {others[0].name} ({others[0].target}); "
                              "rewriting would change what that reader sees")
        if w.cache is not None and any(u.op == "output" for u in holder.users):
            raise Unsupported("the graph returns the cache tensor itself")
    tq = qv.shape[2]
    lk = example(site.k).shape[2]
    if _known_different(kn.shape[2], tq):
        raise Unsupported(f"the cache update writes {kn.shape[2]} tokens for {tq} queries: not a "
                          "self-attention cache that grows with the queries (e.g. cross-attention "
                          "over an encoder's K/V, written once); it keeps its full-precision cache")
    if wk.cache is not None and site.mask is None and not site.is_causal:
        raise Unsupported("no mask over a preallocated cache: the model attends unwritten slots")
    if site.mask is not None:
        mv = example(site.mask)
        if mv is None or mv.dim() != 4 or mv.shape[-1] != lk:
            raise Unsupported("the attention mask is not [batch|1, heads|1, queries, cache length]")
    return _Match(site, wk, wv, rk, rv)


# ------------------------------------------------------------------------------ rewrite
@dataclasses.dataclass
class RewriteContext:
    """What the pass needs from the backend: states, options, the graph's inputs."""

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
    #: filled by rewrite_graph (inputs mode): (graph input index, site report) of every
    #: model-owned cache tensor the caller must free after each call (see _hand_over)
    released_inputs: list[tuple[int, SiteReport]] = dataclasses.field(default_factory=list)


def _start_node(graph: fx.Graph, w: CacheWrite, batch: int, device: torch.device) -> fx.Node:
    """An int64 [B] tensor with the first written position, built in the graph."""
    if w.start_kind == "positions":   # checked to be one contiguous run at run time
        return graph.call_function(torch.ops.kvarn.positions_start.default, (w.start, batch))
    if w.start_kind == "int":
        return graph.call_function(torch.full, ((batch,), w.start),
                                   {"dtype": torch.int64, "device": device})
    # "past_len": a cat cache; its length is numel / (B * H * D) (0 for the empty start)
    kn = example(w.new)
    numel = graph.call_method("numel", (w.start,))
    length = graph.call_function(operator.floordiv, (numel, kn.shape[0] * kn.shape[1] * kn.shape[3]))
    return graph.call_function(torch.full, ((batch,), length), {"dtype": torch.int64, "device": device})


def _past_row_tags(graph: fx.Graph, w: CacheWrite) -> fx.Node | None:
    """The batch-row tags of a cat cache's past (the handle an earlier call returned, see
    step 4 of rewrite_graph), read in the graph: ``past[:, 0, 0, 0]``. None for an in-place
    cache, a single batch row or an empty past."""
    past = example(w.start)
    if w.cache is not None or example(w.new).shape[0] == 1:    # one row: nothing to reorder
        return None
    if past is None or past.dim() != 4 or (isinstance(past.shape[2], int) and past.shape[2] == 0):
        return None
    return graph.call_function(operator.getitem, (w.start, (slice(None), 0, 0, 0)))


def _known_different(a: Any, b: Any) -> bool:
    """``a != b`` provable at compile time (ints, or symbols whose value ranges exclude it:
    Dynamo specializes sizes 0 and 1, so a symbolic size is never 1)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a != b))
    except Exception:  # noqa: BLE001 - unknown: not provably different
        return False


def _same_size(a: Any, b: Any) -> bool:
    """``a == b`` known at compile time (ints, or one and the same symbol)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return str(a.node.expr) == str(b.node.expr)
    return False


def _key_length(graph: fx.Graph, w: CacheWrite, batch: int, heads: int, dim: int) -> Any:
    """The key length the model's attention reads: the capacity of a preallocated cache, or
    past + new tokens of a cat cache (built from the past's numel; the cat itself is gone)."""
    if w.cache is not None:
        return int(example(w.cache).shape[2])
    past_len = graph.call_function(
        operator.floordiv, (graph.call_method("numel", (w.start,)), batch * heads * dim))
    return graph.call_function(operator.add, (past_len, graph.call_method("size", (w.new, 2))))


def _top_left_causal(graph: fx.Graph, m: _Match, batch: int, heads: int, dim: int,
                     device: torch.device) -> fx.Node:
    """``sdpa(is_causal=True)`` with Tq != Lk aligns its mask to the top-left corner (query i
    sees keys 0..i, PyTorch's ``tril(ones(Tq, Lk))``): that mask, [1, 1, Tq, Lk], indexed by
    absolute key position as kvarn::attention reads it. Keys 0..i are always written (query
    i sits at position >= i), so the bottom-right causal flag hides none of them."""
    tq = graph.call_method("size", (m.site.q, 2))
    lk = _key_length(graph, m.wk, batch, heads, dim)
    ones = graph.call_function(torch.ones, ((tq, lk),), {"dtype": torch.bool, "device": device})
    tril = graph.call_method("tril", (ones,))
    return graph.call_function(operator.getitem, (tril, (None, None)))


def rewrite_graph(gm: fx.GraphModule, example_inputs: list[Any], ctx: RewriteContext,
                  graph_id: int = 0) -> tuple[list[torch.Tensor], list[SiteReport]]:
    """Rewrite ``gm`` in place; return (extra inputs to append, per-site reports).

    ``example_inputs`` is not read (model-owned buffers are freed at run time, see
    ``_hand_over``); it stays for callers written against the earlier signature.
    """
    graph = gm.graph
    side_effects = [n for n in graph.nodes if not n.users and n.op not in ("placeholder", "output")]
    matches, reports = find_sites(graph)
    for r in reports:
        r.graph = graph_id
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first_body = placeholders[-1].next if placeholders else next(iter(graph.nodes))
    extra: list[torch.Tensor] = []
    caches: list[tuple[SiteReport, fx.Node, fx.Node, fx.Node]] = []
    keyed = ctx.state_key is not None
    for m in matches:
        name = site_name(m.site.out)
        kn = example(m.wk.new)
        batch, heads, _, dim = kn.shape
        lk = example(m.site.k).shape[2]
        if m.wk.cache is not None:
            max_len = int(example(m.wk.cache).shape[2])
        else:
            max_len = ctx.max_cache_len
        state = ctx.get_state(name, batch=batch, kv_heads=heads, head_dim=dim, max_len=max_len,
                              dtype=kn.dtype, device=kn.device)
        # 1. the state's buffers become graph inputs (keyed mode: a constant key instead)
        bufs: list[fx.Node] = []
        if not keyed:
            with graph.inserting_before(first_body):
                for i, t in enumerate(state.buffers):
                    ph = graph.placeholder(f"kvarn_{re.sub(r'[^0-9a-zA-Z_]', '_', name)}_{i}")
                    ph.meta["example_value"] = t
                    bufs.append(ph)
            extra.extend(state.buffers)
        # 2. quantize-on-append where the model wrote its cache
        first_write = min((n for n in m.wk.write_nodes + m.wv.write_nodes),
                          key=lambda n: list(graph.nodes).index(n))
        with graph.inserting_before(first_write):
            start = _start_node(graph, m.wk, batch, kn.device)
            new_k = m.wk.new
            rows = _past_row_tags(graph, m.wk)
            if rows is not None and keyed:
                new_k = graph.call_function(torch.ops.kvarn.reorder_keyed.default,
                                            (new_k, rows, ctx.state_key(name)))
            elif rows is not None:
                graph.call_function(torch.ops.kvarn.reorder_.default, (bufs, rows, name))
            if keyed:
                append = graph.call_function(
                    torch.ops.kvarn.append_keyed.default,
                    (new_k, m.wv.new, start, None, None, ctx.state_key(name), max_len,
                     ctx.method, ctx.iters, ctx.recent, ctx.hold, ctx.check_finite, False))
            else:
                append = graph.call_function(
                    torch.ops.kvarn.append_.default,
                    (bufs, m.wk.new, m.wv.new, start, ctx.method, ctx.iters, ctx.recent,
                     ctx.hold, ctx.check_finite, name))
        # 3. fused attention in place of the model's attention
        scale = m.site.scale if m.site.scale is not None else dim ** -0.5
        # The model's own semantics, exactly: a mask-free, non-causal attention attends every
        # key (a cat cache holds written keys only; a preallocated cache needs a mask or
        # is_causal, see _pair); a preallocated cache is read causally, which hides nothing
        # a causal mask shows.
        causal = bool(m.site.is_causal or m.wk.cache is not None)
        mask = m.site.mask
        with graph.inserting_before(m.site.out):
            if m.site.is_causal and not _same_size(lk, example(m.site.q).shape[2]):
                mask = _top_left_causal(graph, m, batch, heads, dim, kn.device)
            if keyed:
                att = graph.call_function(torch.ops.kvarn.attention_keyed.default,
                                          (m.site.q, append, mask, ctx.state_key(name),
                                           float(scale), causal, 0))
            else:
                att = graph.call_function(torch.ops.kvarn.attention.default,
                                          (m.site.q, bufs, mask, float(scale), causal, 0))
            att.meta["example_value"] = example(m.site.out)
        m.site.out.replace_all_uses_with(att)
        # 4. the model's cache is no longer written; cat caches get a row-tagged handle
        for w in (m.wk, m.wv):
            if w.cache is None:
                cat = w.full
                with graph.inserting_before(att):
                    shape = example(cat).shape
                    # row i of the handle holds i: a reorder of the cache outside the graph
                    # (beam search) reaches the next call as the order of these tags
                    tags = graph.call_function(torch.arange, (batch,),
                                               {"dtype": kn.dtype, "device": kn.device})
                    zero = graph.call_method("view", (tags, batch, 1, 1, 1))
                    length = _key_length(graph, w, batch, heads, dim)
                    handle = graph.call_method("expand", (zero, shape[0], shape[1], length, shape[3]))
                for user in list(cat.users):
                    if user.op == "output":
                        user.replace_input_with(cat, handle)
            else:
                for node in w.write_nodes:
                    graph.erase_node(node)
        for node in m.site.nodes:
            if not node.users:
                graph.erase_node(node)
        report = SiteReport(name, True, m.site.form, m.wk.spelling,
                            m.rk.spelling if m.rk else "", state_bytes=state.nbytes, graph=graph_id)
        reports.append(report)
        if m.wk.cache is not None:
            caches.append((report, m.wk.cache, m.wv.cache, append))
    dce(graph, keep=[n for n in side_effects if not getattr(n, "_erased", False)])
    for report, cache_k, cache_v, append in caches:
        _hand_over(graph, ctx, report, cache_k, cache_v, append, placeholders)
    graph.lint()
    gm.recompile()
    return extra, reports


def _hand_over(graph: fx.Graph, ctx: RewriteContext, report: SiteReport, cache_k: fx.Node,
               cache_v: fx.Node, append: fx.Node, placeholders: list[fx.Node]) -> None:
    """Give the model's own preallocated K/V tensors (graph inputs the rewritten graph no
    longer reads) to the append: a prompt a non-compiled forward wrote there is adopted
    into the packed state, then their storage is freed (``release_buffers``).

    Keyed mode: ``kvarn::append_keyed`` takes them and frees them itself. Inputs mode:
    ``kvarn::append_from_`` (``kvarn::adopt_`` + ``kvarn::append_`` with
    ``ctx.separate_adopt``) replaces the append, and the backend's runtime wrapper frees
    the inputs listed in ``ctx.released_inputs`` after each call. Either way a tensor that
    is passed later in their place (a second transformers StaticCache) is freed as well.
    """
    if cache_k.users or cache_v.users or cache_k not in placeholders or cache_v not in placeholders:
        return
    if ctx.state_key is not None:
        args = list(append.args)
        args[3], args[4], args[12] = cache_k, cache_v, bool(ctx.release_buffers)
        append.args = tuple(args)
        return
    fresh = bool(ctx.release_buffers)
    if ctx.separate_adopt:
        bufs, _, _, start = append.args[:4]
        with graph.inserting_before(append):
            graph.call_function(torch.ops.kvarn.adopt_.default,
                                (bufs, cache_k, cache_v, start, ctx.method, ctx.iters, ctx.recent,
                                 ctx.hold, ctx.check_finite, append.args[9], fresh))
    else:
        with graph.inserting_before(append):
            merged = graph.call_function(torch.ops.kvarn.append_from_.default,
                                         (*append.args, cache_k, cache_v, fresh))
        append.replace_all_uses_with(merged)
        graph.erase_node(append)
    if ctx.release_buffers:
        ctx.released_inputs.extend((placeholders.index(c), report) for c in (cache_k, cache_v))
