"""The tables of model spellings the KVarN pass recognizes, on Dynamo (torch-IR) graphs.

Each table is a list of ``(name, matcher)`` rows; every row says which model code it covers.

* ``CACHE_WRITES``: how a layer writes its new K or V rows into a cache (in place into a
  preallocated buffer, or ``torch.cat`` onto the past). A matcher returns a
  :class:`CacheWrite` that records the write per axis of the cache; which axis holds the
  positions is decided by the read (``[B, H, S, D]`` or ``[B, S, H, D]`` caches).
* ``KV_STEPS``: the view operations between a cache and the attention (transposes, batch and
  position prefixes, GQA head expansion, aliases). :func:`trace_kv` walks them backwards
  from the attention's K or V operand to the cache and tells which cache axis is batch,
  heads, positions and head dim; the first node no row covers is named in the report.
* ``ATTENTIONS``: the attention computation itself (``scaled_dot_product_attention``, or the
  eager ``q·kᵀ -> scale -> mask -> softmax -> ·v`` chain with matmul or einsum).
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

from kvarn_compile.passes.fx_utils import arg, describe, example, is_op, single_user

__all__ = ["CacheWrite", "KVRead", "AttentionSite", "MaskSpec", "CACHE_WRITES", "KV_STEPS",
           "ATTENTIONS", "WINDOW_CACHES", "Unsupported", "ChainBroken", "trace_kv",
           "same_size", "sizes_equal"]


class Unsupported(Exception):
    """A matched site that cannot be rewritten faithfully; the message is the reason."""


class ChainBroken(Unsupported):
    """The walk from an attention operand to its cache stopped at ``node``."""

    def __init__(self, node: fx.Node, why: str):
        super().__init__(why)
        self.node = node
        self.why = why


# ------------------------------------------------------------------------------ helpers
def same_size(a: Any, b: Any) -> bool:
    """``a == b`` known at compile time: ints, or SymInts (or the nodes producing them)
    with one and the same expression."""
    a, b = example(a), example(b)
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        try:
            return bool(statically_known_true(a == b))
        except Exception:  # noqa: BLE001 - not provable
            return str(getattr(a, "node", a)) == str(getattr(b, "node", b))
    return False


def sizes_equal(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def _shape(node: Any) -> tuple | None:
    val = example(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _expand_index(index: Any, ndim: int) -> list | None:
    """A getitem/setitem index as one entry per axis, ``None`` entries for inserted axes and
    Ellipsis expanded to whole slices; None when it is not a plain basic index."""
    entries = list(index) if isinstance(index, tuple) else [index]
    if sum(e is Ellipsis for e in entries) > 1:
        return None
    used = sum(e is not None and e is not Ellipsis for e in entries)
    if used > ndim:
        return None
    out = []
    for e in entries:
        if e is Ellipsis:
            out.extend([slice(None)] * (ndim - used))
            used = ndim
        else:
            out.append(e)
    return out + [slice(None)] * (ndim - sum(e is not None for e in out))


def _full(sl: slice, size: Any) -> bool:
    """``sl`` covers a whole axis of ``size``."""
    return isinstance(sl, slice) and sl.step in (None, 1) and sl.start in (None, 0) \
        and (sl.stop is None or same_size(sl.stop, size)
             or (isinstance(sl.stop, int) and isinstance(size, int) and sl.stop >= size))


def _noop_cast(n: fx.Node) -> bool:
    """``x.to(...)``, ``x.float()``, ``x.type_as(y)``... that changes neither dtype nor device:
    PyTorch returns ``x`` itself (an alias)."""
    if n.op != "call_method" or n.target not in ("to", "type", "type_as", "float", "double",
                                                 "half", "bfloat16", "contiguous"):
        return False
    src, out = example(n.args[0]), example(n)
    if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    if n.target == "contiguous":
        return src.is_contiguous()
    return src.dtype == out.dtype and src.device == out.device


# ------------------------------------------------------------------------------ writes
@dataclasses.dataclass
class CacheWrite:
    spelling: str
    full: fx.Node                 # the cache value readers see: the cat node, or the written root
    new: fx.Node                  # the new rows, axes in the cache's order
    write_nodes: list[fx.Node]    # nodes that perform the write; removed by the rewrite
    cache: fx.Node | None = None  # in-place spellings: the tensor written (a graph input, usually)
    #: per cache axis: ``slice(None)`` (whole axis), a ``slice`` (a prefix or a run of
    #: positions) or a positions tensor node. ``cat``: None (see ``axis``).
    index: list[Any] | None = None
    axis: int | None = None       # ``cat``: the concatenation axis
    #: filled when paired (``resolve_write``): the positions axis and how the write starts
    start_kind: str = ""          # "positions" (tensor of positions), "int" (int/SymInt), "past_len"
    start: Any = None
    end: Any = None               # slice writes: the position after the last one written


def _write_root(target: Any) -> tuple[fx.Node | None, list[Any]]:
    """The tensor an in-place write goes to, through no-op casts (``self.cache_k =
    self.cache_k.to(x)``, llama reference code) and batch/position slices of it
    (``self.k[:B, ...]``, litgpt): (root, per-root-axis slices of the view written)."""
    chain = []
    cur = target
    while isinstance(cur, fx.Node):
        if _noop_cast(cur):
            cur = cur.args[0]
        elif is_op(cur, "getitem") and isinstance(example(cur.args[0]), torch.Tensor):
            chain.append(cur)
            cur = cur.args[0]
        else:
            break
    val = example(cur)
    if not isinstance(cur, fx.Node) or not isinstance(val, torch.Tensor):
        return None, []
    index = [slice(None)] * val.dim()
    for view in reversed(chain):        # root first
        entries = _expand_index(view.args[1], example(view.args[0]).dim())
        if entries is None or any(not isinstance(e, slice) for e in entries):
            return None, []
        for axis, e in enumerate(entries):
            if e != slice(None):
                if index[axis] != slice(None) or e.step not in (None, 1):
                    return None, []
                index[axis] = e
    return cur, index


def _merge_index(root_index: list[Any], axis: int, entry: Any) -> list[Any] | None:
    out = list(root_index)
    if out[axis] != slice(None) and entry != slice(None):
        return None
    if entry != slice(None):
        out[axis] = entry
    return out


def _index_copy(n: fx.Node) -> CacheWrite | None:
    # transformers StaticCache:  self.keys.index_copy_(2, cache_position, key_states)
    # litgpt KVCache:            k = self.k[:bs, ...].index_copy_(-2, input_pos, k)
    #                            (the return value, a batch slice of the buffer, is read)
    if not is_op(n, "index_copy_") or len(n.args) < 4:
        return None
    target, dim, pos, new = n.args[:4]
    root, index = _write_root(target)
    val = example(target)
    if root is None or not isinstance(dim, int) or val is None or val.dim() != 4:
        return None
    index = _merge_index(index, dim % 4, pos)
    if index is None:
        return None
    return CacheWrite("index_copy_", root, new, [n], root, index)


def _index_put(n: fx.Node) -> CacheWrite | None:
    # torchchat / ExecuTorch KVCache:
    #   k_out = torch.ops.aten.index_put_(self.k_cache, [None, None, input_pos], k_val)
    #   torch.ops.aten.index_put_(self.k_cache, [None, input_pos], k_val)     ([B, S, H, D])
    if not is_op(n, "index_put_") or len(n.args) < 3:
        return None
    target, indices, new = n.args[:3]
    accumulate = arg(n, 3, "accumulate", False)
    root, index = _write_root(target)
    val = example(target)
    if root is None or accumulate or val is None or val.dim() != 4 \
            or not isinstance(indices, (list, tuple)) or len(indices) > 4:
        return None
    tensors = [i for i, e in enumerate(indices) if e is not None]
    if len(tensors) != 1 or not isinstance(indices[tensors[0]], fx.Node):
        return None
    index = _merge_index(index, tensors[0], indices[tensors[0]])
    if index is None:
        return None
    return CacheWrite("index_put_", root, new, [n], root, index)


def _setitem(n: fx.Node) -> CacheWrite | None:
    # gpt-fast KVCache:         k_out[:, :, input_pos] = k_val         (index_put_ in aten)
    # nanoGPT-style caches:     k_cache[:, :, start:start + T] = k
    # llama reference code:     self.cache_k[:bsz, start_pos:start_pos + seqlen] = xk
    # [B, S, H, D] caches:      k_cache[:, input_pos] = k,  k_cache[..., pos, :, :] = k
    if not is_op(n, "setitem"):
        return None
    target, index, new = n.args
    root, root_index = _write_root(target)
    val = example(target)
    if root is None or val is None or val.dim() != 4:
        return None
    entries = _expand_index(index, 4)
    if entries is None or any(e is None or isinstance(e, (int, bool)) for e in entries):
        return None
    out = list(root_index)
    for axis, e in enumerate(entries):
        if isinstance(e, fx.Node) or e != slice(None):
            merged = _merge_index(out, axis, e)
            if merged is None:
                return None
            out = merged
    if not any(isinstance(e, fx.Node) or e != slice(None) for e in out):
        return None                     # k_cache[...] = k: overwrites the whole cache
    tensor_axes = [e for e in out if isinstance(e, fx.Node)]
    spelling = "setitem[positions]" if tensor_axes else "setitem[a:b]"
    return CacheWrite(spelling, root, new, [n], root, out)


@dataclasses.dataclass(frozen=True)
class _Narrowed:
    """The stop of a ``narrow(dim, start, length)`` slice: ``start + length``."""

    length: Any


def _narrow_copy(n: fx.Node) -> CacheWrite | None:
    # k_cache.narrow(2, start, T).copy_(k)        (also on a [B, S, H, D] cache: narrow(1, ...))
    if not is_op(n, "copy_"):
        return None
    view, new = n.args[:2]
    if not (is_op(view, "narrow") and single_user(view)):
        return None
    target, dim, start, length = (list(view.args) + [None] * 4)[:4]
    root, index = _write_root(target)
    val = example(target)
    if root is None or val is None or val.dim() != 4 or not isinstance(dim, int) or length is None:
        return None
    index = _merge_index(index, dim % 4, slice(start, _Narrowed(length)))
    if index is None:
        return None
    return CacheWrite("narrow().copy_", root, new, [n, view], root, index)


def _cat(n: fx.Node) -> CacheWrite | None:
    # transformers DynamicCache:  self.keys = torch.cat([self.keys, key_states], dim=-2)
    # [B, S, H, D] caches:        k = torch.cat([past_k, k], dim=1)
    if not is_op(n, "cat"):
        return None
    tensors = arg(n, 0, "tensors")
    dim = arg(n, 1, "dim", 0)
    if not (isinstance(tensors, (list, tuple)) and len(tensors) == 2 and isinstance(dim, int)):
        return None
    past, new = tensors
    val = example(n)
    if val is None or val.dim() != 4 or dim % 4 not in (1, 2):
        return None         # batch or head-dim concatenation (rotate_half's cat), not a cache
    return CacheWrite(f"torch.cat([past, new], dim={dim})", n, new, [n], axis=dim % 4,
                      start_kind="past_len", start=past)


#: How a layer writes its new K/V rows. Order matters only for speed.
CACHE_WRITES: list[tuple[str, Callable[[fx.Node], CacheWrite | None]]] = [
    ("index_copy_", _index_copy),    # transformers StaticCache; litgpt (on a batch slice, return value read)
    ("index_put_", _index_put),      # torchchat / ExecuTorch: aten.index_put_(cache, [None, None, pos], k)
    ("setitem", _setitem),           # gpt-fast k_cache[:, :, pos] = k; llama cache_k[:bsz, a:b] = xk
    ("narrow_copy", _narrow_copy),   # k_cache.narrow(2, s, T).copy_(k)
    ("cat", _cat),                   # transformers DynamicCache; cat([past, k], dim=1) for [B, S, H, D]
]


def resolve_write(w: CacheWrite, seq_axis: int, batch_axis: int) -> str | None:
    """Fill ``w.start_kind/start/end`` for a cache whose positions are on ``seq_axis``; a
    reason when the write does not append a run of positions along that axis only (batch:
    a prefix of ``batch_axis`` at most)."""
    new = _shape(w.new)
    if new is None or len(new) != 4:
        return "the new keys/values are not 4-D"
    if w.cache is None:                           # cat
        if w.axis != seq_axis:
            return (f"torch.cat joins axis {w.axis} of the cache, but the attention reads positions "
                    f"along axis {seq_axis}")
        return None
    for axis, e in enumerate(w.index):
        if axis in (seq_axis, batch_axis) or e == slice(None):
            continue
        return (f"its cache write {describe(w.write_nodes[0])} indexes axis {axis}, which the attention "
                "reads as heads or head dim (not one cache row per head)")
    b = w.index[batch_axis]
    if isinstance(b, fx.Node) or not (b == slice(None) or (b.start in (None, 0) and b.step in (None, 1))):
        return f"its cache write {describe(w.write_nodes[0])} writes batch rows that are not a prefix"
    cache = _shape(w.cache)
    rows = cache[batch_axis] if b == slice(None) or b.stop is None else b.stop
    for axis in range(4):
        want = rows if axis == batch_axis else cache[axis]
        if axis != seq_axis and not same_size(new[axis], want):
            return (f"its cache write {describe(w.write_nodes[0])} broadcasts new rows of shape "
                    f"{list(new)} over axis {axis} of the cache")
    e = w.index[seq_axis]
    t = new[seq_axis]
    if isinstance(e, fx.Node):
        pos = example(e)
        if pos is None or pos.dim() != 1 or not _one_row_per_position(pos.shape[0], t):
            return (f"its cache write {describe(w.write_nodes[0])} writes {t} rows at positions "
                    f"shaped {None if pos is None else tuple(pos.shape)} (expected one position per row)")
        w.start_kind, w.start = "positions", e
        return None
    if e == slice(None):
        return (f"its cache write {describe(w.write_nodes[0])} overwrites every position "
                f"of axis {seq_axis}")
    if e.step not in (None, 1):
        return f"its cache write {describe(w.write_nodes[0])} writes every {e.step}th position"
    start = 0 if e.start is None else e.start
    stop = e.stop
    cap = _shape(w.cache)[seq_axis]
    if isinstance(stop, _Narrowed):          # narrow(dim, start, length): end = start + length
        length = stop.length
        if not same_size(length, t):
            return f"its cache write {describe(w.write_nodes[0])} writes {length} positions for {t} rows"
        w.start_kind, w.start, w.end = "int", start, None
        return None
    width = None
    if stop is None:
        width = cap - example(start) if isinstance(example(start), (int, torch.SymInt)) else None
    elif isinstance(example(start), (int, torch.SymInt)) and isinstance(example(stop), (int, torch.SymInt)):
        width = example(stop) - example(start)
    if width is None or not same_size(width, t):
        return (f"its cache write {describe(w.write_nodes[0])} writes the slice {_fmt_slice(e)} "
                f"with {t} rows; cannot tell it writes exactly one position per row")
    w.start_kind, w.start, w.end = "int", start, stop
    return None


def _one_row_per_position(positions: Any, rows: Any) -> bool:
    """A write of ``rows`` new rows at ``positions`` positions writes one row per position:
    the counts are equal, or (symbolic sizes) the write would fail otherwise. Indexed writes
    broadcast only a count of 1, and Dynamo specializes sizes of 1, so two counts that are
    not the int 1 must be equal for the write to have run."""
    if isinstance(positions, int) and isinstance(rows, int):
        return positions == rows
    return not (isinstance(positions, int) and positions == 1) and not (isinstance(rows, int) and rows == 1)


def _fmt_slice(sl: slice) -> str:
    def f(x):
        if isinstance(x, _Narrowed):
            return f"+{f(x.length)}"
        return "" if x is None else (x.name if isinstance(x, fx.Node) else str(x))
    return f"{f(sl.start)}:{f(sl.stop)}"


# ------------------------------------------------------------------------------ reads
@dataclasses.dataclass
class KVRead:
    spelling: str               # e.g. "repeat_kv", "transpose(1, 2) + repeat_interleave"
    source: fx.Node             # the cache value: an in-place cache's root, or a cat node
    nodes: list[fx.Node]        # the read chain, attention side first (removed when unused)
    axes: dict[str, int]        # the source axis holding 'b' (batch), 'h', 's' (positions), 'd'
    batch: Any = None           # rows of the batch axis read (None: the whole axis)
    stop: Any = None            # positions [0, stop) read (None: the whole axis)
    repeat: int = 1             # query heads per KV head the read expands to (head-major)


@dataclasses.dataclass
class _Trace:
    batch: Any = None
    stop: Any = None
    repeat: int = 1
    parts: list[str] = dataclasses.field(default_factory=list)


# Labels of the axes of a tensor on the way from the attention back to the cache:
#   b batch, s positions, d head dim, h KV heads, q the attention's heads (KV heads times
#   repeats, head-major, not yet split), r a repeat axis, 1 a broadcast axis of size one.
_Step = Callable[[fx.Node, list, _Trace], "tuple[Any, list] | None"]


def _alias(n: fx.Node, labels: list, tr: _Trace):
    # value-preserving: .contiguous(), .clone(), .detach(), a no-op .to()/.float()/.type_as(),
    # and the return value of an in-place cache write (index_copy_ / index_put_ / copy_
    # return the tensor they wrote: litgpt and torchchat read it)
    if _noop_cast(n) or (n.op == "call_method" and n.target in ("clone", "detach", "contiguous")) \
            or is_op(n, "index_copy_", "index_put_") or (is_op(n, "copy_") and not is_op(n.args[0], "narrow")):
        return n.args[0], labels
    return None


def _transpose(n: fx.Node, labels: list, tr: _Trace):
    # k.transpose(1, 2) ([B, S, H, D] caches, llama), torch.transpose, .swapaxes, .mT,
    # k.permute(0, 2, 1, 3)
    if is_op(n, "transpose", "swapaxes") and len(n.args) >= 3:
        a, b = (int(d) % len(labels) for d in n.args[1:3])
        out = list(labels)
        out[a], out[b] = labels[b], labels[a]
        tr.parts.append(f"transpose({n.args[1]}, {n.args[2]})")
        return n.args[0], out
    if n.op == "call_function" and n.target is getattr and n.args[1] == "mT":
        out = list(labels)
        out[-1], out[-2] = labels[-2], labels[-1]
        return n.args[0], out
    if is_op(n, "permute"):
        dims = n.args[1:] if n.op == "call_method" else n.args[1:2]
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
        dims = [int(d) % len(labels) for d in dims]
        if sorted(dims) != list(range(len(labels))):
            return None
        out = [None] * len(labels)
        for i, d in enumerate(dims):
            out[d] = labels[i]
        tr.parts.append(f"permute{tuple(dims)}")
        return n.args[0], out
    return None


def _getitem(n: fx.Node, labels: list, tr: _Trace):
    # k[:, :, None, :, :] (transformers repeat_kv), keys[:bsz, :start_pos + seqlen] (llama),
    # k[..., :input_pos_maxp1, :] (litgpt), key[:, :, :q_len] (transformers sdpa prefill)
    if not is_op(n, "getitem") or not isinstance(example(n.args[0]), torch.Tensor):
        return None
    src_shape = _shape(n.args[0])
    entries = _expand_index(n.args[1], len(src_shape))
    if entries is None:
        raise ChainBroken(n, "indexes it in a way the pass does not follow")
    src_labels, x_axis = [], 0
    for e in entries:
        if e is None:                                # an inserted axis of size 1
            if labels[x_axis] not in ("1", "r"):
                raise ChainBroken(n, "inserts an axis the attention uses")
            x_axis += 1
            continue
        axis = len(src_labels)
        if not isinstance(e, slice):
            raise ChainBroken(n, "selects single entries of an axis (an int or tensor index, e.g. "
                                 "a cache stacked over layers)")
        label = labels[x_axis]
        size = src_shape[axis]
        if not _full(e, size):
            if e.step not in (None, 1) or e.start not in (None, 0):
                what = "the newest positions" if isinstance(e.start, int) and e.start < 0 else "a slice"
                raise ChainBroken(n, f"reads {what} ({_fmt_slice(e)}) of an axis, not a prefix")
            if label == "b" and tr.batch is None:
                tr.batch = e.stop
            elif label == "s" and tr.stop is None:
                tr.stop = e.stop
                tr.parts.append(f"positions [:{e.stop if isinstance(e.stop, int) else 'n'}]")
            else:
                raise ChainBroken(n, "reads part of the heads or head dim, or slices an axis twice")
        src_labels.append(label)
        x_axis += 1
    return n.args[0], src_labels


def _unsqueeze(n: fx.Node, labels: list, tr: _Trace):
    # k.unsqueeze(2).expand(B, Hkv, n_rep, S, D).flatten(1, 2)
    if not is_op(n, "unsqueeze"):
        return None
    dim = int(arg(n, 1, "dim")) % len(labels)
    if labels[dim] not in ("1", "r"):
        raise ChainBroken(n, "inserts an axis the attention uses")
    return n.args[0], labels[:dim] + labels[dim + 1:]


def _expand(n: fx.Node, labels: list, tr: _Trace):
    # x[:, :, None].expand(b, h, n_rep, s, d) (repeat_kv), k.expand(B, Hq, S, D) (MQA broadcast)
    if not (n.op == "call_method" and n.target in ("expand", "expand_as")):
        return None
    src, out = _shape(n.args[0]), _shape(n)
    if src is None or out is None or len(src) != len(out):
        raise ChainBroken(n, "expands to a different number of axes")
    new = list(labels)
    for i, (a, b) in enumerate(zip(src, out)):
        if same_size(a, b):
            continue
        if not same_size(a, 1):
            raise ChainBroken(n, f"expands an axis of size {a}")
        if labels[i] == "r":
            new[i] = "1"
            tr.repeat *= int(b)
        elif labels[i] == "q":                  # MQA: one KV head broadcast to every query head
            new[i] = "h"
            tr.repeat *= int(b)
        else:
            raise ChainBroken(n, "broadcasts the batch, positions or head dim")
    return n.args[0], new


def _merge_heads(n: fx.Node, labels: list, tr: _Trace, src: tuple, out: tuple):
    """``out`` merges two adjacent axes of ``src`` into the attention's head axis
    (kv heads x repeats, head-major)."""
    if len(src) != len(out) + 1:
        return None
    fits = [i for i in range(len(out))
            if sizes_equal(src[:i], out[:i]) and sizes_equal(src[i + 2:], out[i + 1:])
            and isinstance(src[i], int) and isinstance(src[i + 1], int)
            and same_size(out[i], src[i] * src[i + 1])]
    for i in fits:                  # (with axes of size 1 several merges fit the shapes)
        if labels[i] == "q":
            tr.parts.append("repeat_kv")
            return n.args[0], labels[:i] + ["h", "r"] + labels[i + 1:]
    if fits:
        raise ChainBroken(n, "merges axes other than KV heads x repeats")
    return None


def _reshape(n: fx.Node, labels: list, tr: _Trace):
    # transformers repeat_kv: ....reshape(b, h * n_rep, s, d); gpt-style .view(...); .flatten(1, 2)
    if not (is_op(n, "reshape") or is_op(n, "flatten") or (n.op == "call_method" and n.target == "view")):
        return None
    src, out = _shape(n.args[0]), _shape(n)
    if src is None or out is None:
        return None
    if sizes_equal(src, out):
        return n.args[0], labels
    merged = _merge_heads(n, labels, tr, src, out)
    if merged is None:
        raise ChainBroken(n, f"reshapes {list(src)} to {list(out)}")
    return merged


def _repeat_interleave(n: fx.Node, labels: list, tr: _Trace):
    # gpt-fast / litgpt: k.repeat_interleave(n_head // n_local_heads, dim=1),
    # torch.repeat_interleave(k, n_rep, 1), repeats= keyword, a 0-d tensor count
    if not is_op(n, "repeat_interleave"):
        return None
    repeats = arg(n, 1, "repeats")
    dim = arg(n, 2, "dim")
    src, out = _shape(n.args[0]), _shape(n)
    if not isinstance(dim, int) or src is None or out is None:
        raise ChainBroken(n, "repeats without an axis (it flattens)")
    dim %= len(labels)
    if labels[dim] != "q" or not (isinstance(src[dim], int) and isinstance(out[dim], int)):
        raise ChainBroken(n, "repeats an axis other than the KV heads")
    factor = out[dim] // src[dim]
    count = example(repeats)
    scalar = isinstance(count, int) or (isinstance(count, torch.Tensor) and count.dim() == 0)
    if not scalar or (isinstance(count, int) and count != factor) or out[dim] != factor * src[dim]:
        raise ChainBroken(n, "repeats the heads by per-head counts")
    tr.repeat *= factor
    tr.parts.append(f"repeat_interleave({factor}, dim={dim})")
    new = list(labels)
    new[dim] = "h"
    return n.args[0], new


#: The view operations a read may apply between the cache and the attention, tried in order.
KV_STEPS: list[tuple[str, _Step]] = [
    ("alias", _alias),                    # .contiguous(), no-op .to(q), index_copy_/index_put_ return value
    ("transpose", _transpose),            # [B, S, H, D] caches: keys.transpose(1, 2); .permute; .mT
    ("getitem", _getitem),                # x[:, :, None], keys[:bsz, :start + T], k[..., :maxp1, :]
    ("unsqueeze", _unsqueeze),            # k.unsqueeze(2).expand(...).flatten(1, 2)
    ("expand", _expand),                  # repeat_kv's expand; MQA k.expand(B, Hq, S, D)
    ("reshape", _reshape),                # repeat_kv's reshape(b, h * n, s, d), .view, .flatten(1, 2)
    ("repeat_interleave", _repeat_interleave),   # gpt-fast / litgpt GQA
]


def trace_kv(node: Any, labels: list[str]) -> KVRead:
    """Walk back from an attention operand (whose axes are ``labels``, e.g. ``['b', 'q', 's',
    'd']``) through ``KV_STEPS`` to the first node that is not a view: the cache value (or,
    when none is there, whatever computed the operand). Raises :class:`ChainBroken` at an
    operation a step recognizes but cannot follow."""
    tr = _Trace()
    nodes: list[fx.Node] = []
    cur, lab = node, list(labels)
    while isinstance(cur, fx.Node) and cur.op in ("call_function", "call_method"):
        for _, step in KV_STEPS:
            res = step(cur, lab, tr)
            if res is not None:
                break
        else:
            break
        nodes.append(cur)
        cur, lab = res
        if not isinstance(cur, fx.Node):
            raise ChainBroken(nodes[-1], "is not applied to a tensor")
    if not isinstance(cur, fx.Node):
        raise ChainBroken(node, "is not a tensor computed in the graph")
    lab = ["h" if x == "q" else x for x in lab]
    if sorted(lab) != ["b", "d", "h", "s"]:
        raise ChainBroken(cur, f"ends in a tensor whose axes the pass cannot map ({lab})")
    spelling = " + ".join(reversed(list(dict.fromkeys(tr.parts))))     # in the model's order
    return KVRead(spelling, cur, nodes, {x: i for i, x in enumerate(lab)}, tr.batch, tr.stop,
                  tr.repeat)


# ------------------------------------------------------------------------------ attention
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


def _last_rows(n: fx.Node) -> int | None:
    """N when ``n`` is ``x[:, :, -N:]`` / ``x[:, :, -N:, :]`` (keep the newest N positions)."""
    if not is_op(n, "getitem") or not isinstance(n.args[1], tuple):
        return None
    index = n.args[1]
    if not (len(index) in (3, 4) and all(s == slice(None) for s in index[:2])
            and (len(index) == 3 or index[3] == slice(None))):
        return None
    sl = index[2]
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


#: Caches that keep only a window of the newest tokens (matched on the cache the attention's
#: K is read from). Such a site is refused: see ``refuse_sliding_window``.
WINDOW_CACHES: list[tuple[str, Callable[[fx.Node], str | None]]] = [
    ("window_slice", _window_slice),   # transformers Dynamic/StaticSlidingWindowLayer: k[:, :, -W:]
    ("window_roll", _window_roll),     # transformers StaticSlidingWindowLayer: roll + copy_
]


def refuse_sliding_window(source: Any) -> None:
    # A sliding-window cache forgets old tokens and its attention mask counts positions inside
    # the window, not from the start of the sequence; the KVarN cache keeps every token and
    # its attention takes absolute positions. Rewriting would attend outside the window.
    if not isinstance(source, fx.Node):
        return
    for _, matcher in WINDOW_CACHES:
        spelling = matcher(source)
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


def _qk_product(s: fx.Node) -> tuple[fx.Node, fx.Node, list[str], tuple | None] | None:
    """(q, k operand, its labels, q permutation) of a q·kᵀ product [B, H, Tq, Lk]."""
    if is_op(s, "matmul"):
        q, kt = s.args[:2]
        return q, kt, ["b", "q", "d", "s"], None   # kᵀ: its transpose is the first read step
    spec = _einsum(s)
    if spec is None:
        return None
    eq, (q, k) = spec
    ins, out = eq.split("->")
    qs, ks = ins.split(",")
    if not (len(qs) == len(ks) == len(out) == 4 and len(set(qs)) == len(set(ks)) == 4):
        return None
    d = [c for c in qs if c in ks and c not in out]
    if len(d) != 1 or out[3] not in ks or out[3] in qs or out[2] not in qs or out[2] in ks \
            or out[0] not in qs + ks or out[1] not in qs + ks:
        return None            # scores must be [batch, heads, queries, keys]
    names = {out[0]: "b", out[1]: "q", out[3]: "s", d[0]: "d"}
    if any(c not in names for c in ks) or set(qs) != {out[0], out[1], out[2], d[0]}:
        return None
    q_order = (out[0], out[1], out[2], d[0])
    q_perm = tuple(qs.index(c) for c in q_order)
    return q, k, [names[c] for c in ks], None if q_perm == (0, 1, 2, 3) else q_perm


def _pv_product(n: fx.Node) -> tuple[fx.Node, fx.Node, list[str], tuple | None] | None:
    """(weights, v operand, its labels, output permutation) of a weights·v product."""
    if is_op(n, "matmul"):
        w, v = n.args[:2]
        return w, v, ["b", "q", "s", "d"], None
    spec = _einsum(n)
    if spec is None:
        return None
    eq, (w, v) = spec
    ins, out = eq.split("->")
    ws, vs = ins.split(",")
    if not (len(ws) == len(vs) == len(out) == 4 and len(set(vs)) == 4):
        return None
    b, h, tq, key = ws
    dd = [c for c in vs if c not in ws]
    if len(dd) != 1 or key not in vs or key in out or set(out) != {b, h, tq, dd[0]} \
            or not set(vs) <= {b, h, key, dd[0]}:
        return None
    names = {b: "b", h: "q", key: "s", dd[0]: "d"}
    order = (b, h, tq, dd[0])                  # kvarn's output order
    out_perm = tuple(order.index(c) for c in out)
    return w, v, [names[c] for c in vs], None if out_perm == (0, 1, 2, 3) else out_perm


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

def _eager_chain(n: fx.Node) -> AttentionSite | None:
    # transformers eager_attention_forward / nanoGPT / llama reference code:
    #   w = matmul(q, k.transpose(2, 3)) * scale      [or / sqrt(d), scale * s, q @ k.mT,
    #                                                  einsum("bhqd,bhkd->bhqk", q, k)]
    #   w = w + mask   |  w.masked_fill(mask == 0, -inf)  |  torch.where(mask, w, -inf)  (optional)
    #   w = softmax(w.float(), dim=-1).type_as(q)     [softmax(w, -1), dtype=torch.float32,
    #                                                  .to(q.dtype); casts optional]
    #   w = dropout(w, p=0.0, training=False)         (optional)
    #   out = matmul(w, v)                            [w @ v, einsum("bhqk,bhkd->bhqd", w, v)]
    pv = _pv_product(n)
    if pv is None:
        return None
    w, v, v_labels, out_perm = pv
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
    while isinstance(s, fx.Node) and single_user(s):
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
        if mask is None and is_op(s, "add") and isinstance(s.args[1], fx.Node) \
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
    if not isinstance(s, fx.Node) or not single_user(s):
        return None
    qk = _qk_product(s)
    if qk is None:
        return None
    q, k, k_labels, q_perm = qk
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


def kv_dtype_ok(node: fx.Node) -> bool:
    val = example(node)
    return val is not None and val.is_floating_point() and val.dim() == 4

