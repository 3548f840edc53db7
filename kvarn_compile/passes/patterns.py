"""The table of model spellings the KVarN pass recognizes, on Dynamo (torch-IR) graphs.

Four tables, each a list of ``(name, matcher)`` rows; a matcher takes one node and returns
a description of what it found or ``None``. Every row says which model code it covers.

* ``CACHE_WRITES``: how a layer appends its new K or V rows to a cache.
* ``KV_READS``: how the attention reads the cache (optionally expanding KV heads for GQA).
* ``ATTENTIONS``: the attention computation itself.
* ``WINDOW_CACHES``: caches that keep only the newest tokens (sliding-window layers); an
  attention over one is refused with a reason (it stays in full precision).

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
           "WINDOW_CACHES", "Unsupported"]


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


def _written_tokens(cache: fx.Node) -> set[Any]:
    """Token counts T of the in-place writes (index_copy_ / setitem) into ``cache``."""
    counts = set()
    for user in cache.users:
        if is_op(user, "index_copy_") and user.args[0] is cache:
            new = user.args[3]
        elif is_op(user, "setitem") and user.args[0] is cache:
            new = user.args[2]
        else:
            continue
        val = example(new)
        if val is not None and val.dim() == 4:
            counts.add(val.shape[2])
    return counts


def _position_slice(n: fx.Node) -> Any:
    """The index on the position axis when ``n`` is ``x[:, :, i]`` or ``x[:, :, i, :]``
    (every other axis whole); else None."""
    if not is_op(n, "getitem"):
        return None
    index = n.args[1]
    if not (isinstance(index, tuple) and len(index) in (3, 4) and _full_slices(index, 2)
            and (len(index) == 3 or index[3] == slice(None))):
        return None
    return index[2]


def _prefix_slice(n: fx.Node) -> KVRead | None:
    # transformers sdpa_attention_forward, prefill of an empty StaticCache (Qwen2, Qwen3):
    #   key = key[:, :, :q_length, :]     (after repeat_kv when it ran)
    #   sdpa(q, key, value, attn_mask=None, is_causal=True)
    # transformers only emits it when the mask was skipped because the cache is empty
    # (q_offset == 0, a Python int Dynamo guards on); then the first q_length slots are
    # exactly the tokens this step wrote, so attending the whole packed cache is the same.
    # Matched only in that exact form: the slice length equals the token count (> 1) written
    # into that cache, and its one user is a causal, mask-free sdpa.
    sl = _position_slice(n) if single_user(n) else None
    if not (isinstance(sl, slice) and sl.start in (None, 0) and sl.step in (None, 1)
            and isinstance(sl.stop, int) and sl.stop > 1):
        return None
    att = next(iter(n.users))
    if not (is_op(att, "sdpa") and arg(att, 5, "is_causal", False) is True
            and arg(att, 3, "attn_mask") is None):
        return None
    src, inner = n.args[0], None
    if isinstance(src, fx.Node):
        inner = _repeat_kv(src)
        if inner is not None and not single_user(src):
            return None
    cache = inner.source if inner is not None else src
    if not isinstance(cache, fx.Node) or _written_tokens(cache) != {sl.stop}:
        return None
    if inner is None:
        return KVRead(f"prefix slice [:, :, :{sl.stop}]", cache, [n])
    return KVRead(f"repeat_kv + prefix slice [:, :, :{sl.stop}]", cache, [n, *inner.nodes])


#: How attention reads the cache, outermost first; a direct read needs no row.
KV_READS: list[tuple[str, Callable[[fx.Node], KVRead | None]]] = [
    ("repeat_kv", _repeat_kv),
    ("repeat_interleave", _repeat_interleave),
    ("prefix_slice", _prefix_slice),   # transformers sdpa, empty-StaticCache prefill: k[:, :, :T]
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


def _last_rows(n: fx.Node) -> int | None:
    """N when ``n`` is ``x[:, :, -N:]`` / ``x[:, :, -N:, :]`` (keep the newest N positions)."""
    sl = _position_slice(n)
    if isinstance(sl, slice) and isinstance(sl.start, int) and sl.start < 0 \
            and sl.stop is None and sl.step in (None, 1):
        return -sl.start
    return None


def _window_slice(keys: fx.Node) -> str | None:
    # transformers DynamicSlidingWindowLayer:  self.keys = cat([past, k])[:, :, -W + 1:]
    # transformers StaticSlidingWindowLayer, prefill past the window:
    #   self.keys.copy_(k[:, :, -W:])   /   self.keys.copy_(cat((keys[:, :, 1:], k))[:, :, -W:])
    for user in keys.users:
        rows = _last_rows(user)
        if rows is not None:
            return f"keeps only the newest {rows} positions (keys[:, :, -{rows}:])"
    return None


def _window_roll(keys: fx.Node) -> str | None:
    # transformers StaticSlidingWindowLayer, window full:
    #   new = self.keys.roll(-1, dims=-2); new[:, :, tensor([-1])] = k; self.keys.copy_(new)
    for user in keys.users:
        if user.op == "call_method" and user.target == "roll":
            val = example(keys)
            length = val.shape[2] if val is not None and val.dim() == 4 else "?"
            return f"rolls a {length}-slot window (keys.roll(-1, dims=-2) + copy_)"
    return None


#: Caches that keep only a window of the newest tokens (matched on the attention's K, reads
#: stripped). Such a site is refused: see ``_refuse_sliding_window``.
WINDOW_CACHES: list[tuple[str, Callable[[fx.Node], str | None]]] = [
    ("window_slice", _window_slice),   # transformers Dynamic/StaticSlidingWindowLayer: k[:, :, -W:]
    ("window_roll", _window_roll),     # transformers StaticSlidingWindowLayer: roll + copy_
]


def _refuse_sliding_window(k: Any) -> None:
    # A sliding-window cache forgets old tokens and its attention mask counts positions inside
    # the window, not from the start of the sequence; the KVarN cache keeps every token and
    # its attention takes absolute positions. Rewriting would attend outside the window.
    if not isinstance(k, fx.Node):
        return
    src = k
    for _, matcher in KV_READS:
        read = matcher(k)
        if read is not None:
            src = read.source
            break
    if not isinstance(src, fx.Node):
        return
    for _, matcher in WINDOW_CACHES:
        spelling = matcher(src)
        if spelling is not None:
            raise Unsupported(f"sliding-window attention: its cache {spelling}; "
                              "KVarN compresses full-attention caches only, so this layer keeps "
                              "its full-precision cache and attention")


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
    _refuse_sliding_window(k)
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
    _refuse_sliding_window(kt.args[0])
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
