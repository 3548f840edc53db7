"""The attention computations the pass can replace: the ``ATTENTIONS`` table.

``scaled_dot_product_attention``, or the eager ``q·kᵀ -> scale -> mask -> softmax -> ·v``
chain with matmul or einsum; each row says which model code it covers. A matcher returns an
:class:`AttentionSite` (the q, k and v operands with the axis labels of k and v, the
:class:`MaskSpec`, the scale, the nodes to replace), or None; a form it recognizes but cannot
rewrite faithfully (dropout in training, a scale computed at run time, attention weights used
elsewhere) raises :class:`~kvarn_compile.passes.fx_utils.Unsupported`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch
import torch.fx as fx

from kvarn_compile.passes.fx_utils import Unsupported, arg, example, is_op, single_user

__all__ = ["AttentionSite", "MaskSpec", "ATTENTIONS"]


@dataclasses.dataclass
class MaskSpec:
    """The attention mask, as the rewrite passes it to ``kvarn::attention``.

    kind: ``"tensor"`` (sdpa's ``attn_mask`` as given: bool, True = attend, or additive
    float), ``"add"`` (an additive float mask, ``scores + mask``), ``"bool"`` (True = attend:
    ``where(node, scores, -inf)``), ``"not"`` (``~node``: ``masked_fill(node, -inf)``),
    ``"fill"`` (additive ``value`` where ``node`` is True: ``masked_fill(node, value)``),
    ``"keep"`` (additive ``value`` where ``node`` is False: ``where(node, scores, value)``);
    ``scale``: the factor an additive mask is multiplied by (a scaling after the mask)."""

    kind: str
    node: fx.Node
    value: float = 0.0
    scale: float = 1.0
    #: scores not in [B, H, Tq, Lk] order (einsum ``->bsht``): the mask, broadcast to 4-D,
    #: permuted by this
    perm: tuple[int, ...] | None = None

    def shape(self) -> tuple | None:
        """The mask's shape as kvarn::attention reads it ([.., Tq, Lk] order)."""
        val = example(self.node)
        if val is None:
            return None
        shape = tuple(val.shape)
        if self.perm is None:
            return shape
        shape = (1,) * (4 - len(shape)) + shape
        return tuple(shape[p] for p in self.perm)


@dataclasses.dataclass
class AttentionSite:
    form: str
    out: fx.Node               # node whose value is the attention output
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: MaskSpec | None
    scale: float | None
    is_causal: bool
    nodes: list[fx.Node]       # nodes replaced
    #: axis labels of the K and V operands (see trace_kv); q is [B, Hq, Tq, D] after q_perm
    k_labels: list[str] = dataclasses.field(default_factory=lambda: ["b", "q", "s", "d"])
    v_labels: list[str] = dataclasses.field(default_factory=lambda: ["b", "q", "s", "d"])
    q_perm: tuple[int, ...] | None = None    # permute q by this to get [B, Hq, Tq, D]
    out_perm: tuple[int, ...] | None = None  # permute kvarn's [B, Hq, Tq, D] output by this
    enable_gqa: bool = False


def _sdpa(n: fx.Node) -> AttentionSite | None:
    # F.scaled_dot_product_attention(q, k, v, attn_mask=None|bool|float, dropout_p=0.0,
    #                                is_causal=False, scale=None, enable_gqa=False)
    if not is_op(n, "sdpa"):
        return None
    q, k, v = n.args[:3]
    dropout = arg(n, 4, "dropout_p", 0.0)
    if dropout not in (0, 0.0):
        raise Unsupported(f"scaled_dot_product_attention with dropout_p={dropout} (training)")
    scale = arg(n, 6, "scale")
    if isinstance(scale, fx.Node):
        raise Unsupported("a scale computed at run time")
    mask = arg(n, 3, "attn_mask")
    return AttentionSite("scaled_dot_product_attention", n, q, k, v,
                         MaskSpec("tensor", mask) if isinstance(mask, fx.Node) else None,
                         scale, bool(arg(n, 5, "is_causal", False)), [n],
                         enable_gqa=bool(arg(n, 7, "enable_gqa", False)))


# -------- the eager chain: PV product <- [casts, dropout] <- softmax <- [casts, scale, mask] <- QK
_CASTS = ("to", "type", "type_as", "float", "double", "half", "bfloat16")


def _einsum(n: fx.Node) -> tuple[str, list[fx.Node]] | None:
    if not is_op(n, "einsum") or not isinstance(n.args[0], str):
        return None
    ops = list(n.args[1]) if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else list(n.args[1:])
    eq = n.args[0].replace(" ", "")
    if "..." in eq:
        free = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in eq]
        eq = eq.replace("...", free[0] + free[1])
    if "->" not in eq or len(ops) != 2:
        return None
    return eq, ops


#: the roles of the score axes in kvarn's order: batch, heads, queries, keys
_ROLES = ("b", "h", "t", "k")


def _einsum_roles(a: str, b: str, out: str, a_only: str, b_only: str):
    """The letters of a two-operand 4-D einsum ``a,b->out`` by role: (batch, heads, the
    letter only ``a`` and ``out`` share, the letter only ``b`` and ``out`` share, the letter
    only ``a`` and ``b`` share (contracted)), or None. Batch and heads are the two letters
    all three share; batch is the one written first in ``out``."""
    if not (len(a) == len(b) == len(out) == 4 and len(set(a)) == len(set(b)) == len(set(out)) == 4):
        return None
    shared = [c for c in out if c in a and c in b]
    x = [c for c in out if c in a and c not in b]
    y = [c for c in out if c in b and c not in a]
    z = [c for c in a if c in b and c not in out]
    if len(shared) != 2 or len(x) != 1 or len(y) != 1 or len(z) != 1:
        return None
    return shared[0], shared[1], x[0], y[0], z[0]


def _qk_product(s: fx.Node) -> tuple[fx.Node, fx.Node, list[str], tuple | None, tuple] | None:
    """(q, k operand, its labels, q permutation, the roles of the score axes) of a q·kᵀ
    product: ``matmul`` [B, H, Tq, Lk], or an einsum with scores in any order of batch,
    heads, queries and keys (``bhqd,bhkd->bhqk``; ``bshd,bthd->bsht``, DeepSeek-V3)."""
    if is_op(s, "matmul"):
        q, kt = s.args[:2]
        return q, kt, ["b", "q", "d", "s"], None, _ROLES   # kᵀ: its transpose is the first read step
    spec = _einsum(s)
    if spec is None:
        return None
    eq, (q, k) = spec
    ins, out = eq.split("->")
    qs, ks = ins.split(",")
    roles = _einsum_roles(qs, ks, out, "q", "k")
    if roles is None:
        return None
    b, h, tq, key, d = roles
    names = {b: "b", h: "q", key: "s", d: "d"}
    q_perm = tuple(qs.index(c) for c in (b, h, tq, d))
    score_roles = tuple({b: "b", h: "h", tq: "t", key: "k"}[c] for c in out)
    return q, k, [names[c] for c in ks], None if q_perm == (0, 1, 2, 3) else q_perm, score_roles


def _pv_product(n: fx.Node) -> tuple[fx.Node, fx.Node, list[str], tuple | None, tuple] | None:
    """(weights, v operand, its labels, output permutation, the roles of the weights' axes)
    of a weights·v product (``matmul``, or an einsum in any order of batch, heads, queries
    and keys: ``bhqk,bhkd->bhqd``; ``bsht,bthd->bshd``, DeepSeek-V3)."""
    if is_op(n, "matmul"):
        w, v = n.args[:2]
        return w, v, ["b", "q", "s", "d"], None, _ROLES
    spec = _einsum(n)
    if spec is None:
        return None
    eq, (w, v) = spec
    ins, out = eq.split("->")
    ws, vs = ins.split(",")
    roles = _einsum_roles(ws, vs, out, "w", "v")
    if roles is None:
        return None
    b, h, tq, dd, key = roles
    names = {b: "b", h: "q", key: "s", dd: "d"}
    order = (b, h, tq, dd)                  # kvarn's output order
    out_perm = tuple(order.index(c) for c in out)
    weight_roles = tuple({b: "b", h: "h", tq: "t", key: "k"}[c] for c in ws)
    return w, v, [names[c] for c in vs], None if out_perm == (0, 1, 2, 3) else out_perm, weight_roles


def _swaps_last_two(n: fx.Node) -> bool:
    if is_op(n, "transpose", "swapaxes") and len(n.args) >= 3:
        return sorted(int(d) % 4 for d in n.args[1:3]) == [2, 3]
    return n.op == "call_function" and n.target is getattr and n.args[1] == "mT"


def _const(x: Any) -> float | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    return None


def _softmax_dim_ok(w: fx.Node) -> bool:
    dim = arg(w, 1, "dim")
    val = example(w.args[0])
    return isinstance(dim, int) and val is not None and val.dim() == 4 and dim % 4 == 3



def _fill_mask(cond: fx.Node, value: float, scale_after: float, hide: str, fill: str) -> MaskSpec | None:
    """The mask of ``masked_fill(cond, value)`` / ``where(cond, s, value)``: -inf hides the
    positions (kind ``hide``); another constant is a ``fill`` mask, only where no scale
    follows it (the fill value would be scaled too)."""
    if value == -math.inf:
        return MaskSpec(hide, cond)
    if scale_after == 1.0:
        return MaskSpec(fill, cond, value)
    return None

def _row_max_shift(s: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """``x - x.max(dim=-1, keepdim=True).values`` (or ``torch.amax(x, -1, keepdim=True)``,
    ``.detach()`` optional): the softmax's own stabilization, which does not change it. Returns
    (x, the shift's nodes) when ``s`` is one over the last axis of x, read by nothing else."""
    if not is_op(s, "sub") or len(s.args) != 2 or s.kwargs:
        return None
    x, m = s.args
    if not isinstance(x, fx.Node):
        return None
    nodes = [s]
    while is_op(m, "detach") and single_user(m):
        nodes.append(m)
        m = m.args[0]
    if is_op(m, "getitem") and single_user(m) and len(m.args) == 2 and m.args[1] == 0 \
            and is_op(m.args[0], "max"):
        nodes.append(m)
        m = m.args[0]
    elif not is_op(m, "amax"):
        return None
    dim, keep = arg(m, 1, "dim"), arg(m, 2, "keepdim", False)
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    xv = example(x)
    if not isinstance(m, fx.Node) or m.args[0] is not x or keep is not True \
            or not isinstance(dim, int) or isinstance(dim, bool) or xv is None \
            or dim % xv.dim() != xv.dim() - 1 or not single_user(m) or set(x.users) != {s, m}:
        return None
    return x, nodes + [m]


def _eager_chain(n: fx.Node) -> AttentionSite | None:
    # transformers eager_attention_forward / nanoGPT / llama reference code:
    #   w = matmul(q, k.transpose(2, 3)) * scale      [or / sqrt(d), scale * s, q @ k.mT,
    #                                                  einsum("bhqd,bhkd->bhqk", q, k)]
    #   w = w + mask   |  w.masked_fill(mask == 0, -inf)  |  torch.where(mask, w, -inf)  (optional)
    #   w = w - w.max(dim=-1, keepdim=True).values    [torch.amax; optional: MiMo-V2-Flash]
    #   w = softmax(w.float(), dim=-1).type_as(q)     [softmax(w, -1), dtype=torch.float32,
    #                                                  .to(q.dtype); casts optional]
    #   w = dropout(w, p=0.0, training=False)         (optional)
    #   out = matmul(w, v)                            [w @ v, einsum("bhqk,bhkd->bhqd", w, v)]
    pv = _pv_product(n)
    if pv is None:
        return None
    w, v, v_labels, out_perm, weight_roles = pv
    chain = [n]
    while isinstance(w, fx.Node) and not is_op(w, "softmax"):
        if is_op(w, "dropout"):
            if arg(w, 1, "p", 0.5) not in (0, 0.0) and arg(w, 2, "training", True):
                raise Unsupported("attention dropout in training mode")
        elif not (w.op == "call_method" and w.target in _CASTS + ("contiguous",)):
            return None
        if not single_user(w):
            raise Unsupported("the attention weights (after the softmax) are also used elsewhere")
        chain.append(w)
        w = w.args[0]
    if not is_op(w, "softmax") or not _softmax_dim_ok(w):
        return None
    if not single_user(w):
        raise Unsupported("the attention weights (softmax output) are also used elsewhere")
    chain.append(w)
    s = w.args[0]
    mask: MaskSpec | None = None
    scale_after, scale_before = 1.0, 1.0
    shifted: fx.Node | None = None        # the scores a row-max shift read (two readers)
    while isinstance(s, fx.Node) and (single_user(s) or s is shifted):
        shift = _row_max_shift(s) if shifted is None else None
        if shift is not None:
            shifted, nodes = shift
            chain.extend(nodes)
            s = shifted
            continue
        if s.op == "call_method" and s.target in _CASTS:
            sv, src = example(s), example(s.args[0])
            if sv is None or src is None or (sv.dtype != src.dtype
                                             and sv.dtype not in (torch.float32, torch.float64)):
                return None            # only upcasts (or no-ops) of the scores
            chain.append(s)
            s = s.args[0]
            continue
        if is_op(s, "mul", "truediv"):
            a, b = s.args[:2]
            factor, other = (_const(b), a) if isinstance(a, fx.Node) else (_const(a), b)
            if factor is None:
                if isinstance(a, fx.Node) and isinstance(b, fx.Node):
                    return None
                raise Unsupported("a scale computed at run time")
            if is_op(s, "truediv"):
                if not isinstance(a, fx.Node):
                    return None        # c / scores
                factor = 1.0 / factor
            if mask is None:
                scale_after *= factor
            else:
                scale_before *= factor
            chain.append(s)
            s = other
            continue
        if mask is None and is_op(s, "add", "iadd") and isinstance(s.args[1], fx.Node) \
                and isinstance(s.args[0], fx.Node):
            a, b = s.args[:2]
            scores, m = (a, b) if _leads_to_qk(a) else (b, a)
            mv = example(m)
            if mv is None or not mv.is_floating_point():
                return None                         # scores + a bool tensor: not a mask
            mask = MaskSpec("add", m, scale=scale_after)
            chain.append(s)
            s = scores
            continue
        if mask is None and is_op(s, "masked_fill"):
            cond, value = arg(s, 1, "mask"), arg(s, 2, "value")
            if not isinstance(cond, fx.Node) or _const(value) is None:
                return None
            mask = _fill_mask(cond, _const(value), scale_after, "not", "fill")
            if mask is None:
                return None
            chain.append(s)
            s = s.args[0]
            continue
        if mask is None and is_op(s, "where") and len(s.args) == 3 and isinstance(s.args[0], fx.Node):
            cond, x, value = s.args
            if not isinstance(x, fx.Node) or _const(value) is None:
                return None
            mask = _fill_mask(cond, _const(value), scale_after, "bool", "keep")
            if mask is None:
                return None
            chain.append(s)
            s = x
            continue
        break
    if not isinstance(s, fx.Node) or not (single_user(s) or s is shifted):
        return None
    qk = _qk_product(s)
    if qk is None:
        return None
    q, k, k_labels, q_perm, score_roles = qk
    if score_roles != weight_roles or score_roles[3] != "k":
        return None         # the softmax is not over the keys, or ·v reads another layout
    if mask is not None and score_roles != _ROLES:
        mask.perm = tuple(score_roles.index(r) for r in _ROLES)
    chain.append(s)
    if k_labels == ["b", "q", "d", "s"] and isinstance(k, fx.Node) and single_user(k) \
            and _swaps_last_two(k):
        chain.append(k)                 # k.transpose(-2, -1) / k.transpose(2, 3) / k.mT
        k, k_labels = k.args[0], ["b", "q", "s", "d"]
    scale = scale_before * scale_after      # (qk * c1 + m) * c2 = c1 c2 qk + c2 m
    if scale <= 0 or not math.isfinite(scale):
        return None
    return AttentionSite("matmul-softmax-matmul" if is_op(n, "matmul") else "einsum-softmax-einsum",
                         n, q, k, v, mask, scale, False, chain, k_labels=k_labels,
                         v_labels=v_labels, q_perm=q_perm, out_perm=out_perm)


def _leads_to_qk(node: Any) -> bool:
    cur = node
    for _ in range(8):
        if not isinstance(cur, fx.Node):
            return False
        if _qk_product(cur) is not None:
            return True
        if cur.op == "call_method" and cur.target in _CASTS or is_op(cur, "mul", "truediv"):
            cur = cur.args[0] if isinstance(cur.args[0], fx.Node) else cur.args[1]
            continue
        return False
    return False


#: The attention computations the pass can replace.
ATTENTIONS: list[tuple[str, Callable[[fx.Node], AttentionSite | None]]] = [
    ("sdpa", _sdpa),     # F.scaled_dot_product_attention (transformers sdpa, gpt-fast, litgpt)
    ("eager", _eager_chain),   # matmul/einsum -> scale -> mask -> softmax -> matmul/einsum
]
