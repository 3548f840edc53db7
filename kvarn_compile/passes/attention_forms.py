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

__all__ = ["AttentionSite", "LatentParts", "Decompression", "MaskSpec", "ATTENTIONS", "decompressed_latent"]


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
    #: multi-head latent attention in its absorbed form (:class:`LatentParts`): ``q``/``k``
    #: are one of its two score products, ``v`` the latent the ·v product reads
    latent: "LatentParts | None" = None
    #: multi-head latent attention decompressed on read (:class:`Decompression`): the
    #: up-projection the rewrite folds into the queries and the output
    decompression: "Decompression | None" = None
    #: the attention weights are also read elsewhere (returned: ``output_attentions``): the
    #: node of the chain whose other readers get ``kvarn::attention_weights``, and its axes'
    #: roles (batch, heads, queries, keys: ``"b"``, ``"h"``, ``"t"``, ``"k"``)
    weights: fx.Node | None = None
    weight_roles: tuple[str, ...] = ("b", "h", "t", "k")


@dataclasses.dataclass
class Decompression:
    """The up-projection of a latent cache decompressed on read (transformers' DeepSeek-V2/V3
    family: ``kv_b_proj(latent)`` split into per-head no-RoPE keys and values): ``weight``
    [heads * (nope + v_dim), C] (no bias). The rewrite absorbs it: the queries' no-RoPE part
    times each head's key block becomes the latent-space query, and the attention's latent
    output times each head's value block the output."""

    weight: fx.Node
    heads: int
    nope: int
    v_dim: int
    #: the attention reads positions [0, stop) of the decompressed keys and values
    #: (transformers' sdpa prefill over an empty StaticCache), None: all of them
    stop: Any = None


@dataclasses.dataclass
class LatentParts:
    """The absorbed form of multi-head latent attention (DeepSeek-V2/V3 ``attn_impl="absorb"``)::

        scores = (einsum("bshc,btc->bsht", q_lat, kv) + einsum("bshr,btr->bsht", q_pe, pe)) * scale
        out = einsum("bsht,btc->bshc", softmax(scores + mask), kv)

    Two q·kᵀ products over caches without a heads axis (one latent and one RoPE key for
    every query head), the values being the latent itself. The site's ``q``/``k`` are the
    first product's operands, ``q_pe``/``k_pe`` the second's; which one reads the latent
    (the cache the ·v product reads too) is decided when the site is paired with its cache
    writes. Roles of the axes: ``b`` batch, ``k`` key positions, ``d`` head dim, and ``x``,
    ``y`` the two axes that are query heads and queries, in the scores' order; which is
    which only the sizes can tell (:meth:`resolve`, when paired)."""

    q_pe: fx.Node
    k_pe: fx.Node
    k_pe_labels: list[str]
    q_roles: tuple[str, ...]        # the first product's query axes
    pe_roles: tuple[str, ...]       # the second product's query axes
    score_roles: tuple[str, ...]    # the scores (and the softmax weights)
    out_roles: tuple[str, ...]      # the ·v product's output
    #: the role ("x" or "y") of the heads axis where a product says it (a 4-D matmul /
    #: einsum product over a cache with a heads axis of one); else sizes tell (when paired)
    heads: str | None = None
    pe_perm: tuple[int, ...] | None = None   # filled when paired: q_pe to [B, Hq, Tq, Dv]

    def resolve(self, heads: str) -> dict[str, Any]:
        """The permutations once ``heads`` ("x" or "y") is known: q_perm, pe_perm (to
        [B, Hq, Tq, D]), out_perm (kvarn's [B, Hq, Tq, D] output to the model's order) and
        the mask's (the scores' axes to [B, Hq, Tq, Lk])."""
        name = {heads: "h", ("y" if heads == "x" else "x"): "t", "b": "b", "k": "k", "d": "d"}

        def named(roles):
            return tuple(name[r] for r in roles)

        order = ("b", "h", "t", "d")
        scores = named(self.score_roles)
        return {"q_perm": tuple(named(self.q_roles).index(r) for r in order),
                "pe_perm": tuple(named(self.pe_roles).index(r) for r in order),
                "out_perm": tuple(order.index(r) for r in named(self.out_roles)),
                "mask_perm": tuple(scores.index(r) for r in _ROLES)}


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


def _einsum_parts(n: fx.Node) -> tuple[fx.Node, fx.Node, str, str, str] | None:
    """(first operand, second operand, their letters, the result's letters) of a two-operand
    einsum (:func:`_einsum`), or None."""
    spec = _einsum(n)
    if spec is None:
        return None
    eq, (a, b) = spec
    ins, out = eq.split("->")
    xs, ys = ins.split(",")
    return a, b, xs, ys, out


#: the roles of the score axes in kvarn's order: batch, heads, queries, keys
_ROLES = ("b", "h", "t", "k")


def _einsum_roles(a: str, b: str, out: str, a_only: str, b_only: str):
    """The letters of a two-operand 4-D einsum ``a,b->out`` by role: (batch, heads, the
    letter only ``a`` and ``out`` share, the letter only ``b`` and ``out`` share, the letter
    only ``a`` and ``b`` share (contracted)), or None. Batch and heads are the two letters
    all three share; batch is the one written first in ``out``."""
    letters = _letters(a, b, out, 4)
    if letters is None:
        return None
    shared, x, y, z = letters
    if len(shared) != 2 or len(x) != 1 or len(y) != 1 or len(z) != 1:
        return None
    return shared[0], shared[1], x[0], y[0], z[0]


def _letters(a: str, b: str, out: str, b_dims: int) -> tuple[list, list, list, list] | None:
    """The letters of an einsum ``a,b->out`` (``a`` and ``out`` 4-D, ``b`` ``b_dims``-D, no
    repeated letter) by where they occur: in all three (in ``out``'s order), in ``a`` and
    ``out`` only, in ``b`` and ``out`` only, in ``a`` and ``b`` only (contracted); or None."""
    if not (len(a) == len(out) == 4 and len(b) == b_dims and len(set(a)) == 4
            and len(set(b)) == b_dims and len(set(out)) == 4):
        return None
    return ([c for c in out if c in a and c in b], [c for c in out if c in a and c not in b],
            [c for c in out if c in b and c not in a], [c for c in a if c in b and c not in out])


def _qk_product(s: fx.Node) -> tuple[fx.Node, fx.Node, list[str], tuple | None, tuple] | None:
    """(q, k operand, its labels, q permutation, the roles of the score axes) of a q·kᵀ
    product: ``matmul`` [B, H, Tq, Lk], or an einsum with scores in any order of batch,
    heads, queries and keys (``bhqd,bhkd->bhqk``; ``bshd,bthd->bsht``, DeepSeek-V3)."""
    if is_op(s, "matmul"):
        q, kt = s.args[:2]
        return q, kt, ["b", "q", "d", "s"], None, _ROLES   # kᵀ: its transpose is the first read step
    spec = _einsum_parts(s)
    if spec is None:
        return None
    q, k, qs, ks, out = spec
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
    spec = _einsum_parts(n)
    if spec is None:
        return None
    w, v, ws, vs, out = spec
    roles = _einsum_roles(ws, vs, out, "w", "v")
    if roles is None:
        return None
    b, h, tq, dd, key = roles
    names = {b: "b", h: "q", key: "s", dd: "d"}
    order = (b, h, tq, dd)                  # kvarn's output order
    out_perm = tuple(order.index(c) for c in out)
    weight_roles = tuple({b: "b", h: "h", tq: "t", key: "k"}[c] for c in ws)
    return w, v, [names[c] for c in vs], None if out_perm == (0, 1, 2, 3) else out_perm, weight_roles


def _headless_einsum(n: fx.Node) -> tuple | None:
    """A two-operand einsum of a 4-D operand and a 3-D one without a heads axis into a 4-D
    result (``bshc,btc->bsht``, ``bsht,btc->bshc``): (4-D operand, 3-D operand, their letters,
    the result's, and by role the letters: batch (in all three), the 3-D operand's own one
    (in the result), the contracted one, the two of the 4-D operand's in the result), or
    None."""
    spec = _einsum_parts(n)
    if spec is None:
        return None
    a, b, xs, ys, out = spec
    letters = _letters(xs, ys, out, 3)
    if letters is None:
        return None
    batch, free, own, contracted = letters
    if len(batch) != 1 or len(own) != 1 or len(contracted) != 1 or len(free) != 2:
        return None
    return a, b, xs, ys, out, batch[0], own[0], contracted[0], free


def _headless_product(s: fx.Node) -> tuple[fx.Node, fx.Node, list[str], tuple, tuple] | None:
    """(q, k, k's labels, q's axis roles, the scores' axis roles) of a q·kᵀ einsum over keys
    without a heads axis (``bshc,btc->bsht``: 4-D queries, 3-D keys shared by every query
    head). Roles as in :class:`LatentParts`."""
    spec = _headless_einsum(s)
    if spec is None:
        return None
    q, k, qs, ks, out, b, key, d, free = spec
    role = {b: "b", key: "k", d: "d", free[0]: "x", free[1]: "y"}
    return (q, k, [{"b": "b", "k": "s", "d": "d"}[role[c]] for c in ks],
            tuple(role[c] for c in qs), tuple(role[c] for c in out))


def _score_product(s: Any) -> tuple[fx.Node, fx.Node, list[str], tuple, tuple, str | None] | None:
    """One product of absorbed multi-head latent attention's scores: a q·kᵀ product over
    keys without a heads axis (:func:`_headless_product`) or with one (:func:`_qk_product`:
    ``matmul(q_pe, k_pe.mT)`` of an HF-style [B, 1, T, R] cache); (q, k, k's labels, q's axis
    roles, the scores' axis roles, the role of the heads axis where the product says it)."""
    if not isinstance(s, fx.Node):
        return None
    qk = _qk_product(s)
    if qk is not None:
        q, k, labels, q_perm, roles = qk
        free = [r for r in roles if r in "ht"]                  # in the scores' order
        name = {free[0]: "x", free[1]: "y", "b": "b", "k": "k", "d": "d"}
        q_roles = [""] * 4
        for role, axis in zip(("b", "h", "t", "d"), q_perm or (0, 1, 2, 3)):
            q_roles[axis] = name[role]
        return q, k, labels, tuple(q_roles), tuple(name[r] for r in roles), name["h"]
    headless = _headless_product(s)
    return None if headless is None else (*headless, None)


def _scaled_product(x: Any) -> tuple[Any, float, list[fx.Node]]:
    """``product * c`` / ``product / c`` (a constant): (product, c or 1/c, the scaling node);
    anything else: (x, 1.0, [])."""
    if isinstance(x, fx.Node) and is_op(x, "mul", "truediv") and len(x.args) == 2 \
            and single_user(x) and not x.kwargs:
        a, b = x.args
        node, factor = (a, _const(b)) if isinstance(a, fx.Node) else (b, _const(a))
        if isinstance(node, fx.Node) and factor is not None and (is_op(x, "mul") or node is a):
            return node, (1.0 / factor if is_op(x, "truediv") else factor), [x]
    return x, 1.0, []


def _latent_scores(s: Any) -> tuple[tuple, tuple, float, list[fx.Node]] | None:
    """The two products of absorbed multi-head latent attention's scores, ``q_lat·latentᵀ +
    q_pe·peᵀ`` (:func:`_score_product` each, scores in one order; each may carry the same
    constant scale), with that scale and the nodes of the scalings and the products, or
    None. (Pairing checks that
    both caches have one head and that the ·v product reads one of them.)"""
    if not (isinstance(s, fx.Node) and is_op(s, "add") and len(s.args) == 2 and not s.kwargs
            and all(isinstance(a, fx.Node) and single_user(a) for a in s.args)):
        return None
    (x, fa, na), (y, fb, nb) = (_scaled_product(arg) for arg in s.args)
    if fa != fb or not all(isinstance(p, fx.Node) and single_user(p) for p in (x, y)):
        return None                 # the two parts scaled differently: not one softmax scale
    a, b = _score_product(x), _score_product(y)
    if a is None or b is None or a[4] != b[4] or a[4][-1] != "k" \
            or (a[5] is not None and b[5] is not None and a[5] != b[5]):
        return None
    return a, b, fa, na + nb + [x, y]


def _headless_pv(n: fx.Node) -> tuple[fx.Node, fx.Node, list[str], tuple, tuple] | None:
    """(weights, v, v's labels, the weights' axis roles, the output's axis roles) of a
    weights·v einsum over values without a heads axis (``bsht,btc->bshc``); the two axes
    of heads and queries keep their letters (matched to the scores' by position)."""
    spec = _headless_einsum(n)
    if spec is None:
        return None
    w, v, ws, vs, out, b, d, key, _ = spec
    role = {b: "b", key: "k", d: "d"}
    return (w, v, [{"b": "b", "k": "s", "d": "d"}[role[c]] for c in vs],
            tuple(role.get(c, c) for c in ws), tuple(role.get(c, c) for c in out))


def _latent_site(n: fx.Node, s: fx.Node, pv: tuple, mask: MaskSpec | None, scale: float,
                 chain: list[fx.Node]) -> AttentionSite | None:
    """The :class:`AttentionSite` of an absorbed multi-head latent attention whose scores
    ``s`` are :func:`_latent_scores` and whose ·v product is ``pv`` (:func:`_headless_pv`)."""
    first, second, factor, scalings = _latent_scores(s)
    scale *= factor
    if scale <= 0 or not math.isfinite(scale):
        return None
    w, v, v_labels, w_letters, out_letters = pv
    scores = first[4]
    # the weights are the scores' axes, position by position: their free letters are x / y
    if len(w_letters) != 4 or any((a in "bkd") != (b in "bkd") or (a in "bkd" and a != b)
                                  for a, b in zip(w_letters, scores)):
        return None
    free = {c: r for c, r in zip(w_letters, scores) if c not in "bkd"}
    out_roles = tuple(free.get(c, c) for c in out_letters)
    q, k, k_labels, q_roles, _, heads = first
    q_pe, k_pe, pe_labels, pe_roles, _, pe_heads = second
    chain.extend([s, *scalings])            # the sum, its scalings and its two products
    parts = LatentParts(q_pe, k_pe, pe_labels, q_roles, pe_roles, scores, out_roles,
                        heads=heads or pe_heads)
    return AttentionSite("absorbed multi-head latent attention", n, q, k, v, mask, scale, False,
                         list(dict.fromkeys(chain)), k_labels=k_labels, v_labels=v_labels,
                         latent=parts)


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
    headless = _headless_pv(n) if pv is None else None   # absorbed multi-head latent attention
    if pv is None and headless is None:
        return None
    if pv is not None:
        w, v, v_labels, out_perm, weight_roles = pv
    else:
        w = headless[0]
    chain = [n]
    # the weights may be read elsewhere at one point of the chain (returned to the caller:
    # output_attentions), which then reads kvarn::attention_weights instead
    shared: fx.Node | None = None
    while isinstance(w, fx.Node) and not is_op(w, "softmax"):
        if is_op(w, "dropout"):
            if arg(w, 1, "p", 0.5) not in (0, 0.0) and arg(w, 2, "training", True):
                raise Unsupported("attention dropout in training mode")
        elif not (w.op == "call_method" and w.target in _CASTS + ("contiguous",)):
            return None
        shared = _weights_reader(w, shared, headless)
        chain.append(w)
        w = w.args[0]
    if not is_op(w, "softmax") or not _softmax_dim_ok(w):
        return None
    shared = _weights_reader(w, shared, headless)
    chain.append(w)
    if shared is not None and not _read_after(shared, n, chain):
        raise Unsupported("the attention weights (softmax output) are also read before the "
                          "attention output is computed")
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
                and isinstance(s.args[0], fx.Node) and _latent_scores(s) is None:
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
    scale = scale_before * scale_after      # (qk * c1 + m) * c2 = c1 c2 qk + c2 m
    if headless is not None:
        if scale <= 0 or not math.isfinite(scale) or _latent_scores(s) is None:
            return None
        return _latent_site(n, s, headless, mask, scale, chain)
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
    if scale <= 0 or not math.isfinite(scale):
        return None
    return AttentionSite("matmul-softmax-matmul" if is_op(n, "matmul") else "einsum-softmax-einsum",
                         n, q, k, v, mask, scale, False, chain, k_labels=k_labels,
                         v_labels=v_labels, q_perm=q_perm, out_perm=out_perm, weights=shared,
                         weight_roles=weight_roles)


def _read_after(x: fx.Node, n: fx.Node, chain: list[fx.Node]) -> bool:
    """Every reader of ``x`` outside ``chain`` comes after ``n`` in the graph."""
    later, node = set(), n.next
    while node.op != "root":
        later.add(node)
        node = node.next
    return all(u in later for u in x.users if u not in chain)


def _weights_reader(w: fx.Node, shared: fx.Node | None, headless: Any) -> fx.Node | None:
    """``w``, a node of the chain from the softmax to the ·v product, when something outside
    the chain reads it too (the weights returned), else ``shared`` (the one found so far):
    one such node per chain, and none in the absorbed latent form."""
    if single_user(w):
        return shared
    if shared is not None or headless is not None:
        raise Unsupported("the attention weights (softmax output) are also used elsewhere"
                          + (" in an absorbed latent attention" if headless is not None
                             else ", at two points of the chain"))
    return w


def _slice_last(index: Any) -> slice | None:
    """The slice of ``x[..., a:b]`` (Ellipsis then one slice), else None."""
    if isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis \
            and isinstance(index[1], slice) and index[1].step in (None, 1):
        return index[1]
    return None


def decompressed_latent(site: AttentionSite) -> AttentionSite | None:
    """The absorbed form of an attention over keys and values decompressed from a latent
    cache on read (transformers' DeepseekV3Attention / expand_kv)::

        kv = linear(latent, W).view(B, T, H, nope + vd).transpose(1, 2)
        k_nope, v = torch.split(kv, [nope, vd], dim=-1)
        k = kv.new_empty(B, H, T, nope + rope); k[..., :nope].copy_(k_nope)
        k[..., nope:].copy_(k_pe.expand(-1, H, -1, -1))
        attention(torch.cat((q_nope, q_pe), dim=-1), k, v)

    as an :class:`AttentionSite` over the latent (keys and values) and the RoPE key with
    :class:`LatentParts` and a :class:`Decompression`, or None when ``site`` is not that
    (the caches themselves are traced when the site is paired)."""
    k, v, q = site.k, site.v, site.q
    sliced, stop = _position_prefix(k, v)
    if sliced:                  # transformers' sdpa prefill: key[:, :, :q_len], value[:, :, :q_len]
        k, v = k.args[0], v.args[0]
    if site.latent is not None or not is_op(k, "new_empty") or site.k_labels != ["b", "q", "s", "d"] \
            or site.v_labels != ["b", "q", "s", "d"] or site.q_perm is not None \
            or not is_op(q, "cat") or site.enable_gqa:
        return None
    fills = {}
    for view in k.users:
        if view in site.nodes:
            continue
        sl = _slice_last(view.args[1]) if is_op(view, "getitem") and len(view.args) == 2 else None
        writes = list(view.users)
        if sl is None or len(writes) != 1 or not is_op(writes[0], "copy_") \
                or writes[0].args[0] is not view or writes[0].users:
            return None
        fills[(sl.start, sl.stop)] = (view, writes[0], writes[0].args[1])
    kv_val = example(k)
    if kv_val is None or kv_val.dim() != 4 or len(fills) != 2:
        return None
    width = kv_val.shape[-1]
    nope = next((b for a, b in fills if a in (None, 0) and isinstance(b, int)), None)
    if nope is None or (nope, None) not in fills or not 0 < nope < width:
        return None
    (v0, c0, k_nope), (v1, c1, k_pe) = fills.get((None, nope)) or fills[(0, nope)], fills[(nope, None)]
    # the no-RoPE keys and the values: the two parts of one split of the up-projection
    if not (is_op(k_nope, "getitem") and k_nope.args[1] == 0 and is_op(v, "getitem")
            and v.args[1] == 1 and k_nope.args[0] is v.args[0] and is_op(v.args[0], "split")):
        return None
    split = v.args[0]
    sizes, dim = arg(split, 1, "split_size_or_sections"), arg(split, 2, "dim", 0)
    if not (isinstance(sizes, (list, tuple)) and len(sizes) == 2 and sizes[0] == nope
            and dim in (-1, 3)):
        return None
    vd = sizes[1]
    tr = split.args[0]
    if not (is_op(tr, "transpose") and sorted(int(d) % 4 for d in tr.args[1:3]) == [1, 2]):
        return None
    view = tr.args[0]
    lin = view.args[0] if view.op == "call_method" and view.target in ("view", "reshape") else None
    if not (is_op(lin, "linear") and len(lin.args) >= 2 and arg(lin, 2, "bias") is None):
        return None
    latent, weight = lin.args[:2]
    wv, lv = example(weight), example(latent)
    heads = kv_val.shape[1]
    if wv is None or lv is None or wv.dim() != 2 or lv.dim() != 4 or not isinstance(heads, int) \
            or wv.shape[0] != heads * (nope + vd) or wv.shape[1] != lv.shape[-1]:
        return None
    # the RoPE key: one head broadcast to every query head
    if not (k_pe.op == "call_method" and k_pe.target == "expand"):
        return None
    parts = q.args[0] if q.args and isinstance(q.args[0], (list, tuple)) else None
    if parts is None or len(parts) != 2 or arg(q, 1, "dim", 0) not in (-1, 3):
        return None
    q_nope, q_pe = parts
    qn, qp = example(q_nope), example(q_pe)
    if qn is None or qp is None or qn.shape[-1] != nope or qp.shape[-1] != width - nope:
        return None
    roles = ("b", "x", "y", "d")
    latent_parts = LatentParts(q_pe, k_pe, ["b", "q", "s", "d"], roles, roles,
                               ("b", "x", "y", "k"), roles, heads="x")
    nodes = list(dict.fromkeys(site.nodes + sliced + [c0, c1, v0, v1, k, k_nope, v, split, tr,
                                                     view, lin, q]))
    return dataclasses.replace(
        site, form=f"multi-head latent attention decompressed on read ({site.form}), absorbed",
        q=q_nope, k=latent, v=latent, nodes=nodes, latent=latent_parts,
        decompression=Decompression(weight, heads, nope, vd, stop))


def _position_prefix(k: Any, v: Any) -> tuple[list[fx.Node], Any]:
    """``k[:, :, :n]`` and ``v[:, :, :n]`` (one prefix of the positions of both, [B, H, S, D]):
    (the two slicing nodes, n); else ([], None)."""
    if not (is_op(k, "getitem") and is_op(v, "getitem") and len(k.args) == len(v.args) == 2):
        return [], None
    ik, iv = k.args[1], v.args[1]
    if not (isinstance(ik, tuple) and isinstance(iv, tuple) and len(ik) == len(iv) == 4):
        return [], None
    full = slice(None)
    for a, b in zip(ik, iv):
        if not (isinstance(a, slice) and isinstance(b, slice)) or a != b and not (
                a.start == b.start and a.stop is b.stop and a.step == b.step):
            return [], None
    if ik[0] != full or ik[1] != full or ik[3] != full or ik[2].start not in (None, 0) \
            or ik[2].step not in (None, 1) or ik[2].stop is None:
        return [], None
    return [k, v], ik[2].stop


def _leads_to_qk(node: Any) -> bool:
    cur = node
    for _ in range(8):
        if not isinstance(cur, fx.Node):
            return False
        if _qk_product(cur) is not None or _latent_scores(cur) is not None:
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
