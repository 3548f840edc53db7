"""The table of model spellings the KVarN pass recognizes, on Dynamo (torch-IR) graphs.

Three tables, each a list of ``(name, matcher)`` rows; a matcher takes one node and returns
a description of what it found or ``None``. Every row says which model code it covers.

* ``CACHE_WRITES``: how a layer appends its new K or V rows to a cache.
* ``KV_READS``: how the attention reads the cache (optionally expanding KV heads for GQA).
* ``ATTENTIONS``: the attention computation itself.

The rewrite (``rewrite.py``) pairs an attention with the writes that feed its K and V and
replaces them with ``kvarn::append_`` + ``kvarn::attention``. Anything that does not match
exactly is left alone and reported with a reason.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch
import torch.fx as fx

from kvarn_compile.passes.fx_utils import arg, example, is_op, single_user

__all__ = ["CacheWrite", "KVRead", "AttentionSite", "CACHE_WRITES", "KV_READS", "ATTENTIONS",
           "Unsupported"]


class Unsupported(Exception):
    """A matched site that cannot be rewritten faithfully; the message is the reason."""


# ------------------------------------------------------------------------------ writes
@dataclasses.dataclass
class CacheWrite:
    spelling: str
    full: fx.Node                 # value of the whole cache after the write (what attention reads)
    new: fx.Node                  # the new rows [B, H, T, D]
    start_kind: str               # "positions" (tensor of positions), "int" (int/SymInt), "past_len"
    start: Any                    # positions node / int or SymInt node / past cache node
    write_nodes: list[fx.Node]    # nodes that perform the write; removed by the rewrite
    cache: fx.Node | None = None  # in-place spellings: the cache tensor (a graph input)


def _seq_dim_ok(cache: fx.Node, dim: Any) -> bool:
    val = example(cache)
    return val is not None and val.dim() == 4 and dim in (2, -2)


def _index_copy(n: fx.Node) -> CacheWrite | None:
    # HF StaticCache:  self.keys.index_copy_(2, cache_position, key_states)
    if not is_op(n, "index_copy_"):
        return None
    cache, dim, pos, new = n.args[:4]
    if not _seq_dim_ok(cache, dim):
        return None
    return CacheWrite("index_copy_", cache, new, "positions", pos, [n], cache)


def _full_slices(index: Any, upto: int) -> bool:
    return all(isinstance(s, slice) and s == slice(None) for s in index[:upto])


def _setitem_positions(n: fx.Node) -> CacheWrite | None:
    # gpt-fast KVCache.update:  k_cache[:, :, input_pos] = k_val   (input_pos: LongTensor [T])
    if not is_op(n, "setitem"):
        return None
    cache, index, new = n.args
    if not (isinstance(index, tuple) and len(index) == 3 and _full_slices(index, 2)
            and isinstance(index[2], fx.Node) and _seq_dim_ok(cache, 2)):
        return None
    return CacheWrite("setitem[:, :, positions]", cache, new, "positions", index[2], [n], cache)


def _setitem_slice(n: fx.Node) -> CacheWrite | None:
    # nanoGPT-style caches:  k_cache[:, :, start:start + T] = k   (int or SymInt start)
    if not is_op(n, "setitem"):
        return None
    cache, index, new = n.args
    if not (isinstance(index, tuple) and len(index) == 3 and _full_slices(index, 2)
            and isinstance(index[2], slice) and index[2].step in (None, 1)
            and _seq_dim_ok(cache, 2)):
        return None
    start = 0 if index[2].start is None else index[2].start
    return CacheWrite("setitem[:, :, a:b]", cache, new, "int", start, [n], cache)


def _narrow_copy(n: fx.Node) -> CacheWrite | None:
    # k_cache.narrow(2, start, T).copy_(k)
    if not is_op(n, "copy_"):
        return None
    view, new = n.args[:2]
    if not (is_op(view, "narrow") and single_user(view)):
        return None
    cache, dim, start = view.args[:3]
    if not _seq_dim_ok(cache, dim):
        return None
    return CacheWrite("narrow(2, a, T).copy_", cache, new, "int", start, [n, view], cache)


def _cat(n: fx.Node) -> CacheWrite | None:
    # HF DynamicCache:  self.keys = torch.cat([self.keys, key_states], dim=-2)
    if not is_op(n, "cat"):
        return None
    tensors = arg(n, 0, "tensors")
    dim = arg(n, 1, "dim", 0)
    if not (isinstance(tensors, (list, tuple)) and len(tensors) == 2 and dim in (2, -2)):
        return None
    past, new = tensors
    val = example(n)
    if val is None or val.dim() != 4:
        return None
    return CacheWrite("torch.cat([past, new], dim=-2)", n, new, "past_len", past, [n])


#: How a layer writes its new K/V rows. Order matters only for speed.
CACHE_WRITES: list[tuple[str, Callable[[fx.Node], CacheWrite | None]]] = [
    ("index_copy_", _index_copy),            # transformers StaticCache
    ("setitem_positions", _setitem_positions),  # gpt-fast KVCache, k_cache[:, :, pos] = k
    ("setitem_slice", _setitem_slice),       # k_cache[:, :, s:s+T] = k
    ("narrow_copy", _narrow_copy),           # k_cache.narrow(2, s, T).copy_(k)
    ("cat", _cat),                           # transformers DynamicCache
]


# ------------------------------------------------------------------------------ reads
@dataclasses.dataclass
class KVRead:
    spelling: str
    source: fx.Node            # the cache value read (a CacheWrite.full)
    nodes: list[fx.Node]       # the read chain (removed when unused after the rewrite)


def _repeat_kv(n: fx.Node) -> KVRead | None:
    # transformers repeat_kv: x[:, :, None, :, :].expand(b, h, n, t, d).reshape(b, h*n, t, d)
    if not is_op(n, "reshape", "view"):
        return None
    exp = n.args[0]
    if not (is_op(exp, "expand") and single_user(exp)):
        return None
    ins = exp.args[0]
    if not (is_op(ins, "getitem") and single_user(ins)):
        return None
    index = ins.args[1]
    if not (isinstance(index, tuple) and len(index) == 5 and index[2] is None
            and all(isinstance(s, slice) and s == slice(None) for i, s in enumerate(index) if i != 2)):
        return None
    return KVRead("repeat_kv", ins.args[0], [n, exp, ins])


def _repeat_interleave(n: fx.Node) -> KVRead | None:
    # gpt-fast: k.repeat_interleave(n_head // n_local_heads, dim=1)
    if not is_op(n, "repeat_interleave"):
        return None
    dim = arg(n, 2, "dim")
    if dim != 1 or not isinstance(n.args[1], int):
        return None
    return KVRead(f"repeat_interleave({n.args[1]}, dim=1)", n.args[0], [n])


#: How attention reads the cache, outermost first; a direct read needs no row.
KV_READS: list[tuple[str, Callable[[fx.Node], KVRead | None]]] = [
    ("repeat_kv", _repeat_kv),
    ("repeat_interleave", _repeat_interleave),
]


# ------------------------------------------------------------------------------ attention
@dataclasses.dataclass
class AttentionSite:
    form: str
    out: fx.Node               # node whose value is the attention output [B, Hq, Tq, D]
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node | None
    scale: float | None
    is_causal: bool
    nodes: list[fx.Node]       # nodes replaced


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
    return AttentionSite("scaled_dot_product_attention", n, q, k, v, arg(n, 3, "attn_mask"),
                         scale, bool(arg(n, 5, "is_causal", False)), [n])


def _eager_chain(n: fx.Node) -> AttentionSite | None:
    # transformers eager_attention_forward / nanoGPT:
    #   w = matmul(q, k.transpose(2, 3)) * scale   [or / sqrt(d)]
    #   w = w + mask                                (optional)
    #   w = softmax(w, dim=-1[, dtype=float32]).to(q.dtype)   (cast optional)
    #   w = dropout(w, p=0.0, training=False)       (optional)
    #   out = matmul(w, v)
    if not is_op(n, "matmul"):
        return None
    w, v = n.args[:2]
    chain = [n]
    if is_op(w, "dropout"):
        if arg(w, 1, "p", 0.5) not in (0, 0.0) and arg(w, 2, "training", True):
            raise Unsupported("attention dropout in training mode")
        chain.append(w)
        w = w.args[0]
    while w.op == "call_method" and w.target in ("to", "type", "float", "half", "bfloat16") \
            and single_user(w):
        chain.append(w)
        w = w.args[0]
    if not is_op(w, "softmax"):
        return None
    if arg(w, 1, "dim") not in (-1, 3):
        return None
    if not single_user(w):
        raise Unsupported("the attention weights (softmax output) are also used elsewhere")
    chain.append(w)
    s = w.args[0]
    mask = None
    if is_op(s, "add") and single_user(s):
        chain.append(s)
        s, mask = s.args[:2]
        if not isinstance(mask, fx.Node):
            return None
    scale = None
    if is_op(s, "mul", "truediv") and single_user(s):
        factor = s.args[1]
        if isinstance(factor, fx.Node):
            raise Unsupported("a scale computed at run time")
        scale = float(factor) if is_op(s, "mul") else 1.0 / float(factor)
        chain.append(s)
        s = s.args[0]
    if not (is_op(s, "matmul") and single_user(s)):
        return None
    chain.append(s)
    q, kt = s.args[:2]
    if not (is_op(kt, "transpose") and single_user(kt)
            and sorted(int(d) % 4 for d in kt.args[1:3]) == [2, 3]):
        return None
    chain.append(kt)
    qv = example(q)
    if scale is None:
        scale = 1.0                   # no scaling op in the chain: the scores are q·k
    if qv is not None and not math.isfinite(scale):
        return None
    return AttentionSite("matmul-softmax-matmul", n, q, kt.args[0], v, mask, scale, False, chain)


#: The attention computations the pass can replace.
ATTENTIONS: list[tuple[str, Callable[[fx.Node], AttentionSite | None]]] = [
    ("sdpa", _sdpa),
    ("eager", _eager_chain),
]


def kv_dtype_ok(node: fx.Node) -> bool:
    val = example(node)
    return val is not None and val.is_floating_point() and val.dim() == 4


def check_no_cast(node: fx.Node) -> bool:
    return not (node.op == "call_method" and node.target in ("to", "float", "half"))


_ = torch  # keep import for type references in docs
