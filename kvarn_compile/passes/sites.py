"""Every attention site of a graph: the ones the pass can rewrite, and a report for the rest.

:func:`find_sites` runs the ``ATTENTIONS`` matchers over the graph and pairs each attention
with the cache writes feeding it (:mod:`kvarn_compile.passes.matching`); a site that is refused
becomes a :class:`SiteReport` with the reason. It also reports softmaxes over a q·kᵀ product
that no form recognizes, and attention inside a subgraph the graph calls
(``torch.compiler.nested_compile_region``), which the pass does not rewrite.
:func:`site_name` names a site stably across the graphs of one model.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from kvarn_compile.passes.attention_forms import ATTENTIONS
from kvarn_compile.passes.cache_writes import CACHE_WRITES, CacheWrite
from kvarn_compile.passes.fx_utils import Unsupported, model_frames, module_path
from kvarn_compile.passes.matching import _Match, _pair

__all__ = ["SiteReport", "find_sites", "site_name"]


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


def site_name(node: fx.Node) -> str:
    """Stable name of an attention site: its module path, else its source line.

    Graphs compiled for one model (prefill, decode, recompiles) name a site identically,
    so they share one packed state; two different sites never share a name.
    """
    path = module_path(node)
    if path:
        return path
    frames = model_frames(node)
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
    path, nodes, cur = [], [], node.args[0] if node.args else None
    for _ in range(12):
        if not isinstance(cur, fx.Node) or cur.op not in ("call_function", "call_method"):
            return None
        name = _op_name(cur)
        if name in _PRODUCTS:
            chain = " -> ".join([name, *reversed(path), "softmax"])
            blocker = _blocker(node, cur, list(reversed(nodes)))
            return (f"not recognized: softmax over a q·kᵀ product ({chain}){': ' + blocker if blocker else ''}"
                    "; the pass rewrites "
                    "q·kᵀ (matmul or einsum) [* or / scale] [+ mask | masked_fill | where] "
                    "[- row max] -> softmax [fp32 and back] -> ·v and scaled_dot_product_attention "
                    "only, so this "
                    "attention keeps its full-precision cache")
        if name not in _SCORE_OPS:
            return None
        path.append(name)
        nodes.append(cur)
        tensors = [a for a in cur.args if isinstance(a, fx.Node)]
        # follow the operand that leads to a product (the scores, not a mask or a bias)
        cur = next((a for a in tensors if _leads_to_product(a)), tensors[0] if tensors else None)
    return None


_FOLLOWED = {"mul", "truediv", "div", "add", "iadd", "sub", "masked_fill", "where", "to", "float",
             "type", "type_as", "half", "bfloat16", "contiguous"}
_CASTS = {"to", "float", "type", "type_as", "half", "bfloat16"}
_ROLE_NAMES = {"b": "batch", "h": "heads", "t": "queries", "k": "keys"}


def _blocker(softmax: fx.Node, product: fx.Node, steps: list[fx.Node]) -> str:
    """What keeps the eager form from matching a softmax over a q·kᵀ ``product`` reached
    through ``steps`` (product side first): the first step or check that fails, named;
    "" when none of the checks below finds it."""
    import torch

    from kvarn_compile.passes.attention_forms import (_pv_product, _qk_product, _row_max_shift,
                                                      _softmax_dim_ok)
    from kvarn_compile.passes.fx_utils import arg, example, describe

    for n in steps:
        if _op_name(n) in ("add", "iadd") and len(n.args) >= 2 \
                and all(isinstance(a, fx.Node) and _leads_to_product(a) for a in n.args[:2]):
            return (f"the scores add two q·kᵀ products ({describe(n)}) in a way the pass does not "
                    "follow; it rewrites multi-head latent attention in its absorbed form as "
                    "(q_lat·latentᵀ + q_pe·peᵀ) [* scale] [+ mask] -> softmax -> ·latent, each "
                    "product an einsum or matmul of its own, over one-head caches")
    other = [n for n in steps if _op_name(n) not in _FOLLOWED]
    if other:
        n = other[0]
        return (f"{describe(n)} between the product and the softmax is not one of the steps "
                "the pass follows")
    shifted = set()
    for n in steps:
        if _op_name(n) == "sub":
            shift = _row_max_shift(n)
            if shift is None:
                return (f"{describe(n)} subtracts from the scores something other than their own "
                        "max over the keys (x - x.max(dim=-1, keepdim=True)), which changes the "
                        "softmax")
            shifted.add(shift[0])
    qk = _qk_product(product)
    if qk is None:
        return (f"its q·kᵀ product ({_describe_product(product)}) is not 4-D queries x keys over one contracted head "
                "dim with batch and heads shared")
    roles = qk[4]
    if roles[3] != "k":
        return (f"the softmax runs over the {_ROLE_NAMES[roles[3]]} axis of the scores "
                f"({_describe_product(product)}), not over the keys")
    if not _softmax_dim_ok(softmax):
        return f"the softmax is not over the last (keys) axis (dim={arg(softmax, 1, 'dim')})"
    for n in [product, *steps]:
        if len(n.users) != 1 and n not in shifted:
            return f"the scores ({describe(n)}) are also used elsewhere"
    adds, fills = 0, 0
    for n in steps:
        name = _op_name(n)
        if name in ("mul", "truediv", "div"):
            a, b = n.args[:2]
            if isinstance(a, fx.Node) and isinstance(b, fx.Node):
                return f"the scores are scaled by a tensor ({describe(n)}), not by a constant"
        elif name in ("add", "iadd"):
            adds += 1
            mv = example(n.args[1] if n.args[0] in [product, *steps] else n.args[0])
            if not isinstance(mv, torch.Tensor) or not mv.is_floating_point():
                return f"the term added to the scores ({describe(n)}) is not a float mask"
        elif name in ("masked_fill", "where"):
            fills += 1
            value = arg(n, 2, "value")
            if isinstance(value, fx.Node) or isinstance(value, bool) or not isinstance(value, (int, float)):
                return f"the {name} value ({describe(n)}) is computed at run time, not a constant"
        elif name in _CASTS:
            sv, src = example(n), example(n.args[0])
            if sv is not None and src is not None and sv.dtype != src.dtype \
                    and sv.dtype not in (torch.float32, torch.float64):
                return f"the scores are cast down to {sv.dtype} ({describe(n)}) before the softmax"
    if adds + fills > 1:
        return "more than one mask or bias is applied to the scores"
    consumer, cur = None, softmax
    for _ in range(6):
        users = list(cur.users)
        if len(users) != 1:
            return "the attention weights (softmax output) are also used elsewhere"
        cur = users[0]
        if _op_name(cur) in _PRODUCTS:
            consumer = cur
            break
        if _op_name(cur) not in _WEIGHT_OPS:
            break
    if consumer is None:
        return f"the attention weights reach {describe(cur)}, not a ·v product (matmul or einsum)"
    pv = _pv_product(consumer)
    if pv is None or pv[0] is not softmax and pv[0] not in _ancestors(consumer, softmax):
        return (f"its ·v product ({_describe_product(consumer)}) is not weights x values over "
                "the keys with batch and heads shared")
    if pv[4] != roles:
        return (f"its ·v product ({_describe_product(consumer)}) reads the weights in another "
                f"axis order than the scores ({_describe_product(product)}) give them")
    return ""


def _ancestors(node: fx.Node, stop: fx.Node) -> list[fx.Node]:
    out, cur = [], node.args[0] if node.args else None
    while isinstance(cur, fx.Node) and cur is not stop and len(out) < 8:
        out.append(cur)
        cur = cur.args[0] if cur.args else None
    return out


def _describe_product(n: fx.Node) -> str:
    from kvarn_compile.passes.attention_forms import _einsum

    spec = _einsum(n)
    return f"einsum '{spec[0]}'" if spec else _op_name(n)


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
