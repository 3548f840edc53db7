"""How a layer writes its new K or V rows into its cache: the ``CACHE_WRITES`` table.

Each row is ``(name, matcher)`` and says which model code it covers: in place into a
preallocated buffer (``index_copy_``, ``index_put_``, slice or positions assignment,
``narrow().copy_``), or ``torch.cat`` onto the past. A matcher returns a :class:`CacheWrite`
that records the write per axis of the cache; which axis holds the positions is decided by the
read (:func:`kvarn_compile.passes.reads.trace_kv`: ``[B, H, S, D]`` or ``[B, S, H, D]``
caches), and then :func:`resolve_write` checks that the write appends a run of positions along
that axis and records where it starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx as fx

from kvarn_compile.passes.stacked_caches import is_layer_view
from kvarn_compile.passes.fx_utils import (
    _expand_index, _noop_cast, _shape, arg, describe, example, is_op, same_size, single_user,
)

__all__ = ["CacheWrite", "CACHE_WRITES", "resolve_write"]


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
        elif is_op(cur, "getitem") and isinstance(example(cur.args[0]), torch.Tensor) \
                and not is_layer_view(cur):     # a layer of a stacked cache is the root
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
    # torchtune KVCache:        k_out[:, :, self.cache_pos[:T]] = k_val (then cache_pos.add_(T))
    # a stacked cache:          cache_k[layer, :bsz, a:b] = xk         (stacked_caches.py)
    # nanoGPT-style caches:     k_cache[:, :, start:start + T] = k
    # llama reference code:     self.cache_k[:bsz, start_pos:start_pos + seqlen] = xk
    # [B, S, H, D] caches:      k_cache[:, input_pos] = k,  k_cache[..., pos, :, :] = k
    # [B, S, C] caches (multi-head latent attention, absorbed: no heads axis):
    #                           self.kv_cache[:bsz, start_pos:end_pos] = self.kv_norm(kv)
    if not is_op(n, "setitem"):
        return None
    target, index, new = n.args
    root, root_index = _write_root(target)
    val = example(target)
    if root is None or val is None or val.dim() not in (3, 4):
        return None
    entries = _expand_index(index, val.dim())
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
    ndim = len(_shape(w.full) or ())
    if new is None or len(new) != ndim or ndim not in (3, 4):
        return "the new keys/values do not have the cache's axes"
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
    for axis in range(ndim):
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
