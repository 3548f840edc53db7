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
from kvarn_compile.passes.fx_utils import Unsupported, module_path
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
