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
  or ``kvarn::append_keyed``, as a ``[B, H, S, D]`` view of the rows written), which reads
  it only when something wrote it since its last release, to take over a prompt that a
  non-compiled forward wrote there; then its memory is freed (the tensor stays valid and
  reads zeros: ``registry.release_storage``).
* An attention operand is traced back to its cache through view steps only
  (``patterns.trace_kv``); the cache's layout (``[B, H, S, D]`` or ``[B, S, H, D]``), the
  batch rows and positions read and the GQA expansion come from that trace, and the write
  must append a run of positions along the traced positions axis.
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

from kvarn_compile.passes.fx_utils import dce, describe, example, is_op, is_size_query, module_path
from kvarn_compile.passes.patterns import (
    ATTENTIONS, CACHE_WRITES, AttentionSite, CacheWrite, ChainBroken, KVRead, Unsupported,
    refuse_sliding_window, resolve_write, same_size, trace_kv,
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
    rk: KVRead
    rv: KVRead
    #: the cache axes holding batch, heads, positions, head dim (identity: [B, H, S, D])
    perm: tuple[int, int, int, int] = (0, 1, 2, 3)
    batch: int = 1
    #: how the attention reads the positions: "full" (the whole preallocated cache), "exact"
    #: (exactly the positions written so far), "prefix" (positions [0, lk) of a longer cache)
    read_kind: str = "full"
    lk: Any = None              # the key length the model's attention sees (int, SymInt or node)
    causal: bool = True         # kvarn::attention's causal flag (see _pair)


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


def _find_writes(graph: fx.Graph) -> dict[fx.Node, list[CacheWrite]]:
    writes: dict[fx.Node, list[CacheWrite]] = {}
    for node in graph.nodes:
        for _, matcher in CACHE_WRITES:
            w = matcher(node)
            if w is not None:
                writes.setdefault(w.full, []).append(w)
                break
    return writes


def _inplace_writes(node: fx.Node) -> list[fx.Node]:
    """Users of ``node`` (or of views of it) that write it in place."""
    out, frontier, seen = [], [node], {node}
    while frontier:
        x = frontier.pop()
        for u in x.users:
            if u in seen:
                continue
            seen.add(u)
            if u.args and u.args[0] is x and (
                    is_op(u, "setitem", "index_put_") or (u.op == "call_method" and str(u.target).endswith("_"))):
                out.append(u)
            elif u.args and u.args[0] is x and (is_op(u, "getitem", "narrow") or _is_noop_cast(u)):
                frontier.append(u)
    return out


def _is_noop_cast(n: fx.Node) -> bool:
    from kvarn_compile.passes.patterns import _noop_cast

    return _noop_cast(n)


def _cache_upstream(node: fx.Node, writes: dict[fx.Node, list[CacheWrite]]) -> fx.Node | None:
    """A cache write that ``node`` is computed from (a recognized write's cache, or a tensor
    written in place), searched through ``node``'s inputs; None when there is none."""
    frontier, seen = [node], {node}
    while frontier and len(seen) < 400:
        x = frontier.pop(0)
        if x in writes:
            return writes[x][0].write_nodes[0]
        if x.op in ("placeholder", "call_function", "call_method"):
            found = _inplace_writes(x)
            if found:
                return found[0]
        for a in x.all_input_nodes:
            if a not in seen:
                seen.add(a)
                frontier.append(a)
    return None


_NO_CACHE = ("its keys/values do not come from a recognized KV-cache update "
             "(attention without a cache, e.g. an encoder or a cache-less forward)")


def _trace(operand: Any, labels: list[str], which: str,
           writes: dict[fx.Node, list[CacheWrite]]) -> tuple[KVRead, CacheWrite]:
    """The read of ``operand`` back to its cache and the one write into that cache, or
    Unsupported with a reason that names the node where the chain from the cache broke."""
    try:
        read = trace_kv(operand, labels)
    except ChainBroken as err:
        refuse_sliding_window(err.node)     # keys a window cache keeps the newest W of
        write = _cache_upstream(err.node, writes)
        if write is None:
            raise Unsupported(_NO_CACHE) from None
        raise Unsupported(f"its {which} come from the KV cache written by {describe(write)}, but "
                          f"reach the attention through {describe(err.node)}, which {err.why}; "
                          "the pass does not follow that step") from None
    src = read.source
    refuse_sliding_window(src)              # a window cache (slice of the newest W, or roll)
    found = writes.get(src)
    if found:
        if len(found) > 1:
            raise Unsupported("the cache is written more than once in one step")
        return read, found[0]
    unknown = _inplace_writes(src)
    if unknown:
        raise Unsupported(f"its {which[:-2] if which == 'values' else which[:-1]} cache is written by "
                          f"{describe(unknown[0])}, which the pass does not recognize as a KV-cache "
                          "update")
    write = _cache_upstream(src, writes) if src.op != "placeholder" else None
    if write is not None:
        raise Unsupported(f"its {which} come from the KV cache written by {describe(write)}, but "
                          f"reach the attention through {describe(src)}, which is not a view the "
                          "pass follows (transpose, slice, GQA expand/repeat, no-op cast)")
    raise Unsupported(_NO_CACHE)


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
    skipped.extend(_attention_in_subgraphs(graph))
    return matches, skipped


#: Higher-order ops whose first argument is a subgraph the graph calls (regional compilation)
_SUBGRAPH_CALLS = {"invoke_subgraph": "torch.compiler.nested_compile_region"}


def _attention_in_subgraphs(graph: fx.Graph) -> list[SiteReport]:
    """Attention inside a subgraph the graph calls through a higher-order op (the body of a
    ``torch.compiler.nested_compile_region``): the pass rewrites only the graph itself, so
    each such attention is reported as left unchanged (its cache stays in full precision)."""
    owner = graph.owning_module
    out: list[SiteReport] = []
    found: dict[str, list[SiteReport]] = {}     # body -> its attention (a body is called per layer)
    for node in graph.nodes:
        kind = _SUBGRAPH_CALLS.get(getattr(node.target, "_name", None)) if node.op == "call_function" else None
        body = node.args[0] if kind and node.args else None
        sub = getattr(owner, body.target, None) if isinstance(body, fx.Node) and body.op == "get_attr" else None
        if not isinstance(sub, fx.GraphModule):
            continue
        if body.target not in found:
            inner, inner_skipped = find_sites(sub.graph)
            found[body.target] = [SiteReport(site_name(m.site.out), False, m.site.form)
                                  for m in inner] + inner_skipped
        for site in found[body.target]:
            out.append(SiteReport(
                f"{site_name(node)} (in {body.target})", False, site.attention,
                reason=(f"inside a {kind} body ({body.target}), which the pass does not rewrite: "
                        "this attention keeps its cache in full precision. Compile without the "
                        "region marker, or compile each layer on its own "
                        "(layer.compile(backend=...))")))
    return out


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
                    "q·kᵀ (matmul or einsum) [* or / scale] [+ mask | masked_fill | where] -> "
                    "softmax [fp32 and back] -> ·v and scaled_dot_product_attention only, so this "
                    "attention keeps its full-precision cache")
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
    rk, wk = _trace(site.k, site.k_labels, "keys", writes)
    rv, wv = _trace(site.v, site.v_labels, "values", writes)
    refuse_sliding_window(rk.source)
    if (wk.cache is None) != (wv.cache is None):
        raise Unsupported(f"keys and values use different cache updates ({wk.spelling} / {wv.spelling})")
    if rk.source is rv.source:
        raise Unsupported("keys and values share one cache tensor")
    if rk.axes != rv.axes:
        raise Unsupported("the key and value caches have different layouts")
    axes = rk.axes
    perm = (axes["b"], axes["h"], axes["s"], axes["d"])
    for w in (wk, wv):
        reason = resolve_write(w, axes["s"], axes["b"])
        if reason is not None:
            raise Unsupported(reason)
    if wk.cache is None and axes["b"] != 0:
        raise Unsupported("a torch.cat cache whose batch axis is not the first")
    if wk.start_kind != wv.start_kind or (
            wk.start_kind == "positions" and wk.start is not wv.start) or (
            wk.start_kind == "int" and not same_size(wk.start, wv.start)):
        raise Unsupported("keys and values are written at positions the pass cannot prove equal")
    qv, kraw, vraw = example(site.q), example(wk.new), example(wv.new)
    if qv is None or kraw is None or vraw is None or kraw.dim() != 4 or qv.dim() != 4 \
            or tuple(kraw.shape) != tuple(vraw.shape):
        raise Unsupported("the new keys/values are not [batch, kv_heads, tokens, head_dim] of one shape")
    kn = [kraw.shape[a] for a in perm]                  # [B, H, T, D]
    qs = [qv.shape[a] for a in site.q_perm] if site.q_perm else list(qv.shape)
    if any(not isinstance(x, int) for x in (kn[0], kn[1], kn[3], qs[1])):
        raise Unsupported("dynamic batch, head or head_dim sizes (e.g. the same compiled model ran "
                          "with a second batch size); this graph runs in full precision - compile "
                          "a fresh model per batch size to keep the cache compressed")
    if qs[-1] != kn[-1] or qs[1] % kn[1]:
        raise Unsupported(f"query heads {qs[1]} / head_dim {qs[-1]} do not fit "
                          f"kv heads {kn[1]} / head_dim {kn[-1]}")
    if rk.repeat != rv.repeat or qs[1] % (kn[1] * rk.repeat):
        raise Unsupported(f"the keys are expanded to {kn[1] * rk.repeat} heads and the values to "
                          f"{kn[1] * rv.repeat}, for {qs[1]} query heads")
    if kn[-1] % 16:
        raise Unsupported(f"head_dim {kn[-1]} is not a multiple of 16")
    out = example(site.out)
    if out is None or out.dtype != qv.dtype:
        raise Unsupported(f"the attention output is {getattr(out, 'dtype', None)}, the queries "
                          f"{qv.dtype} (kvarn::attention returns the queries' dtype)")
    batch = kn[0]
    if not same_size(qs[0], batch):
        raise Unsupported(f"the queries have batch {qs[0]} and the new keys {batch}")
    for w, read in ((wk, rk), (wv, rv)):
        rows = read.batch if read.batch is not None else example(read.source).shape[axes["b"]]
        if not same_size(rows, batch):
            raise Unsupported(f"the attention reads {rows} batch rows of the cache and the update "
                              f"writes {batch}")
        _check_readers(site, w, read)
    tq = qs[2]
    if _known_different(kn[2], tq):
        raise Unsupported(f"the cache update writes {kn[2]} tokens for {tq} queries: not a "
                          "self-attention cache that grows with the queries (e.g. cross-attention "
                          "over an encoder's K/V, written once); it keeps its full-precision cache")
    m = _Match(site, wk, wv, rk, rv, perm, batch)
    _read_kind(m, tq, kn[2])
    if site.mask is not None:
        mv = example(site.mask.node)
        if mv is None or not 2 <= mv.dim() <= 4 or not same_size(mv.shape[-1], m.lk) \
                or not (same_size(mv.shape[-2], tq) or same_size(mv.shape[-2], 1)):
            raise Unsupported("the attention mask is not [batch|1, heads|1, queries, cache length]")
    return m


def _read_kind(m: _Match, tq: Any, t: Any) -> None:
    """Which positions the model's attention reads, and kvarn::attention's causal flag:

    * a cat cache, read whole: exactly the positions written; the model's own semantics;
    * the whole preallocated cache ("full"): unwritten slots are read too, so the model
      must hide them with a mask or is_causal; it is read causally, which hides nothing a
      causal mask shows;
    * positions [0, start + T) of a preallocated cache, the same end as the write
      (``cache[:bsz, :start_pos + seqlen]``, llama): exactly the positions written ("exact");
    * another prefix [0, n) (``k[..., :input_pos_maxp1, :]``, litgpt): like "full" with n
      slots; a mask is required (kvarn::attention raises if its n columns do not cover the
      positions held), unwritten slots are hidden causally.
    """
    site, w, r = m.site, m.wk, m.rk
    stop = r.stop
    if not same_size(stop, m.rv.stop) and not (stop is None and m.rv.stop is None):
        raise Unsupported("the keys and values are read up to different positions")
    if w.cache is None:
        if stop is not None:
            raise Unsupported("the attention reads part of a torch.cat cache")
        m.read_kind, m.causal, m.lk = "exact", site.is_causal, _key_len(site)
        return
    cap = example(w.cache).shape[m.perm[2]]
    if stop is None or same_size(stop, cap):
        m.read_kind, m.lk = "full", cap
    elif w.end is not None and same_size(stop, w.end):
        m.read_kind, m.lk = "exact", stop
    elif (w.start_kind == "positions" and isinstance(stop, int) and stop > 1 and same_size(stop, t)
          and site.is_causal and site.mask is None and same_size(tq, t)
          and site.form == "scaled_dot_product_attention"):
        # transformers sdpa_attention_forward, prefill of an empty StaticCache (Qwen2, Qwen3):
        #   key = key[:, :, :q_length, :]; sdpa(q, key, value, attn_mask=None, is_causal=True)
        # transformers only emits it when the mask was skipped because the cache is empty
        # (q_offset == 0, a Python int Dynamo guards on); then the first q_length slots are
        # exactly the tokens this step wrote, so attending the whole packed cache is the same.
        m.read_kind, m.lk = "full", stop
    else:
        m.read_kind, m.lk = "prefix", stop
    if m.read_kind == "exact":
        m.causal = site.is_causal
        return
    if m.read_kind == "prefix" and site.mask is None:
        raise Unsupported(f"the attention reads positions [0, {getattr(stop, 'name', stop)}) of the "
                          "cache without a mask; the pass cannot tell which of them are written")
    if site.mask is None and not site.is_causal:
        raise Unsupported("no mask over a preallocated cache: the model attends unwritten slots")
    m.causal = True


#: View steps that never copy, even on the stride-0 handle a cat cache becomes: a shape
#: query on the end of a chain of these is answered from the handle (or the kept buffer).
_SHAPE_VIEWS = ("transpose", "permute", "getitem", "unsqueeze", "expand", "mT")


def _view_path(node: fx.Node, root: fx.Node) -> list[fx.Node] | None:
    """The view steps from ``root`` (excluded) to ``node`` (included) when each takes the
    previous one as its first argument and is a copy-free view (:data:`_SHAPE_VIEWS`, no-op
    casts); None otherwise."""
    path = []
    while node is not root:
        if not (isinstance(node, fx.Node) and node.args and isinstance(node.args[0], fx.Node)
                and (is_op(node, *_SHAPE_VIEWS) or _is_noop_cast(node)
                     or (node.op == "call_function" and node.target is getattr
                         and node.args[1] == "mT"))):
            return None
        path.append(node)
        node = node.args[0]
    return path[::-1]


def _check_readers(site: AttentionSite, w: CacheWrite, read: KVRead) -> None:
    """The cache is used by this write and this read only (and, for a graph input, handed
    back unchanged as an output, e.g. ``self.cache_k = self.cache_k.to(x)``); the read's
    intermediate values (expanded heads, transposes) are used by the read only."""
    allowed = set(w.write_nodes) | set(read.nodes) | set(site.nodes)
    handed_back = w.cache is not None and w.cache.op == "placeholder"
    root = w.cache if w.cache is not None else w.full
    for node in read.nodes + [n for n in w.write_nodes if n.users and w.cache is not None]:
        for u in node.users:
            if u.op == "output" and handed_back and _is_noop_cast(node):
                continue                        # self.cache_k = self.cache_k.to(x): the input itself
            if is_size_query(u, node) and _view_path(node, root) is not None:
                continue                        # b, s, h, d = keys.shape: answered without the data
            if u not in allowed:
                raise Unsupported(f"the cache as the attention reads it ({describe(node)}) is also "
                                  f"used by {u.name} ({describe(u)})")
    frontier, seen = [root], {root}
    while frontier:
        x = frontier.pop()
        for u in x.users:
            if u in seen:
                continue
            if u in allowed:
                if u.args and u.args[0] is x and (_is_noop_cast(u) or is_op(u, "getitem")):
                    seen.add(u)
                    frontier.append(u)          # a view in the read: check its other users
                continue
            if u.op == "output":
                if w.cache is None or (root.op == "placeholder" and (x is root or _is_noop_cast(x))):
                    continue
                raise Unsupported("the graph returns the cache tensor itself")
            if is_size_query(u, x):
                continue                        # the shape only: the handle or buffer keeps it
            if u.args and u.args[0] is x and (_is_noop_cast(u) or is_op(u, "getitem")) \
                    and w.cache is not None:
                seen.add(u)
                frontier.append(u)
                continue
            raise Unsupported(f"the cache is also read by {u.name} ({describe(u)}); "
                              "rewriting would change what that reader sees")


# ------------------------------------------------------------------------------ rewrite
@dataclasses.dataclass
class RewriteContext:
    """What the pass needs from the backend: states, options, the graph's inputs.

    ``get_state(name, *, batch, kv_heads, head_dim, max_len, dtype, device[, tokens, fresh])``
    returns a site's state; ``tokens``/``fresh`` come only for caches the model does not
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
    #: filled by rewrite_graph (inputs mode): (graph input index, site report) of every
    #: model-owned cache tensor the caller must free after each call (see _hand_over)
    released_inputs: list[tuple[int, SiteReport]] = dataclasses.field(default_factory=list)


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


def _key_len(site: AttentionSite) -> Any:
    """The number of keys of the attention's K operand (its positions axis)."""
    return example(site.k).shape[site.k_labels.index("s")]


def _same_size(a: Any, b: Any) -> bool:
    """``a == b`` known at compile time (ints, or one and the same symbol)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return str(a.node.expr) == str(b.node.expr)
    return False


def _known_different(a: Any, b: Any) -> bool:
    """``a != b`` provable at compile time (ints, or symbols whose value ranges exclude it:
    Dynamo specializes sizes 0 and 1, so a symbolic size is never 1)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a != b))
    except Exception:  # noqa: BLE001 - unknown: not provably different
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
    """The mask kvarn::attention takes for a MaskSpec (see patterns.MaskSpec)."""
    if spec is None:
        return None
    node = spec.node
    if spec.kind in ("tensor", "bool"):
        return node
    if spec.kind == "add":
        return node if spec.scale == 1.0 else graph.call_function(operator.mul, (node, spec.scale))
    if spec.kind == "not":
        return graph.call_function(operator.invert, (node,))
    zeros = graph.call_function(torch.zeros_like, (node,), {"dtype": torch.float32})
    where = node if spec.kind == "fill" else graph.call_function(operator.invert, (node,))
    return graph.call_method("masked_fill", (zeros, where, spec.value))


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
            if u.op != "output" and u.args and u.args[0] is x and (_is_noop_cast(u) or is_op(u, "getitem")):
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
    matches, reports = find_sites(graph)
    for r in reports:
        r.graph = graph_id
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first_body = placeholders[-1].next if placeholders else next(iter(graph.nodes))
    extra: list[torch.Tensor] = []
    caches: list[tuple[SiteReport, _Match, fx.Node]] = []
    keyed = ctx.state_key is not None
    for m in matches:
        name = site_name(m.site.out)
        raw = example(m.wk.new)
        batch, heads, _, dim = (raw.shape[a] for a in m.perm)
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
        state = ctx.get_state(name, batch=batch, kv_heads=heads, head_dim=dim, max_len=max_len,
                              dtype=raw.dtype, device=raw.device, **growth)
        # 1. the state's buffers become graph inputs (keyed mode: a constant key instead)
        bufs: list[fx.Node] = []
        if not keyed:
            with graph.inserting_before(first_body):
                for i, t in enumerate(state.buffers):
                    ph = graph.placeholder(f"kvarn_{re.sub(r'[^0-9a-zA-Z_]', '_', name)}_{i}")
                    ph.meta["example_value"] = t
                    bufs.append(ph)
            extra.extend(state.buffers)
        # 2. quantize-on-append where the model wrote its cache (new rows as [B, H, T, D])
        first_write = min((n for n in m.wk.write_nodes + m.wv.write_nodes),
                          key=lambda n: list(graph.nodes).index(n))
        with graph.inserting_before(first_write):
            start = _start_node(graph, m.wk, batch, heads * dim, raw.device)
            new_k = _permuted(graph, m.wk.new, m.perm)
            new_v = _permuted(graph, m.wv.new, m.perm)
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
            if m.site.is_causal and not _same_size(_key_len(m.site), example(q).shape[2]):
                mask = _top_left_causal(graph, m, q, heads * dim, raw.device)
            if keyed:
                att = graph.call_function(torch.ops.kvarn.attention_keyed.default,
                                          (q, append, mask, ctx.state_key(name),
                                           float(scale), m.causal, 0))
            else:
                att = graph.call_function(torch.ops.kvarn.attention.default,
                                          (q, bufs, mask, float(scale), m.causal, 0))
            att = _permuted(graph, att, m.site.out_perm)
            att.meta["example_value"] = example(m.site.out)
        m.site.out.replace_all_uses_with(att)
        # 4. the model's cache is no longer written; cat caches get a row-tagged handle
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
                    shape[w.axis] = _key_length(graph, m, w, heads * dim)
                    handle = graph.call_method("expand", (zero, *shape))
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
        report = SiteReport(name, True, m.site.form, m.wk.spelling, m.rk.spelling,
                            state_bytes=state.nbytes, graph=graph_id)
        reports.append(report)
        if m.wk.cache is not None:
            caches.append((report, m, append))
    dce(graph, keep=[n for n in side_effects if not getattr(n, "_erased", False)])
    for report, m, append in caches:
        _hand_over(graph, ctx, report, m, append, placeholders)
    graph.lint()
    gm.recompile()
    return extra, reports


def _drop_aliases(graph: fx.Graph, root: fx.Node) -> None:
    """After the rewrite: the outputs that handed back a no-op alias of a cache graph input
    (``self.cache_k = self.cache_k.to(x)``) hand back the input itself; unused views go."""
    views = _cache_views(root)
    if root.op == "placeholder":
        for v in views:
            if _is_noop_cast(v):
                for user in list(v.users):
                    if user.op == "output":
                        user.replace_input_with(v, root)
    _erase_unused(graph, list(reversed(views)))


def _hand_over(graph: fx.Graph, ctx: RewriteContext, report: SiteReport, m: _Match,
               append: fx.Node, placeholders: list[fx.Node]) -> None:
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
        return
    if any(u.op != "output" for c in (cache_k, cache_v) for u in c.users):
        return
    views = []
    with graph.inserting_before(append):
        for c in (cache_k, cache_v):
            v = c
            if m.batch != example(c).shape[m.perm[0]]:
                index = [slice(None)] * 4
                index[m.perm[0]] = slice(None, m.batch)
                v = graph.call_function(operator.getitem, (v, tuple(index)))
            views.append(_permuted(graph, v, m.perm))
    view_k, view_v = views
    whole = view_k is cache_k and view_v is cache_v
    if ctx.state_key is not None:
        args = list(append.args)
        args[3], args[4], args[12] = view_k, view_v, bool(ctx.release_buffers) and whole
        append.args = tuple(args)
        return
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
