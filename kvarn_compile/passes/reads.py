"""The view steps from an attention's K or V operand back to its cache: ``KV_STEPS``, :func:`trace_kv`.

``KV_STEPS`` lists the view operations a read may apply between a cache and the attention
(aliases and no-op casts, transposes, batch and position prefixes, GQA head expansion); each
row says which model code it covers. :func:`trace_kv` walks them backwards from the attention's
K or V operand to the cache and tells which cache axis is batch, heads, positions and head dim
(the cache's layout), which batch rows and positions the attention reads and how the heads are
expanded. The walk ends at the first node no row covers; an operation a row recognizes but
cannot follow raises :class:`ChainBroken`, which names that node in the report.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx as fx

from kvarn_compile.passes.cache_writes import _fmt_slice
from kvarn_compile.passes.stacked_caches import is_layer_view
from kvarn_compile.passes.fx_utils import (
    Unsupported, _expand_index, _full, _noop_cast, _shape, arg, example, is_op, same_size, sizes_equal,
)

__all__ = ["KVRead", "KV_STEPS", "ChainBroken", "trace_kv"]


class ChainBroken(Unsupported):
    """The walk from an attention operand to its cache stopped at ``node``."""

    def __init__(self, node: fx.Node, why: str):
        super().__init__(why)
        self.node = node
        self.why = why


@dataclasses.dataclass
class KVRead:
    spelling: str               # e.g. "repeat_kv", "transpose(1, 2) + repeat_interleave"
    source: fx.Node             # the cache value: an in-place cache's root, or a cat node
    nodes: list[fx.Node]        # the read chain, attention side first (removed when unused)
    axes: dict[str, int]        # the source axis holding 'b' (batch), 'h', 's' (positions), 'd'
    batch: Any = None           # rows of the batch axis read (None: the whole axis)
    stop: Any = None            # positions [0, stop) read (None: the whole axis)
    repeat: int = 1             # query heads per KV head the read expands to (head-major)
    start: Any = None           # a window [start, stop) read (None: from position 0)


@dataclasses.dataclass
class _Trace:
    batch: Any = None
    stop: Any = None
    repeat: int = 1
    start: Any = None
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
            newest = isinstance(e.start, int) and e.start < 0
            # a window of the positions: k_cache[:, :, max(0, end - W):end] (per-layer
            # windows; the lower end an int or an expression of the graph's inputs)
            window = label == "s" and not newest and e.start not in (None, 0) \
                and isinstance(example(e.start), (int, torch.SymInt))
            if e.step not in (None, 1):
                raise ChainBroken(n, f"reads the entries {_fmt_slice(e)}:{e.step} of an axis (a step "
                                     f"of {e.step}), not a run of positions")
            if e.start not in (None, 0) and not window:
                what = "the newest positions" if newest else "a slice"
                raise ChainBroken(n, f"reads {what} ({_fmt_slice(e)}) of an axis, not a prefix")
            if label == "b" and tr.batch is None:
                tr.batch = e.stop
            elif label == "s" and tr.stop is None and tr.start is None:
                tr.stop, tr.start = e.stop, None if e.start in (None, 0) else e.start
                lo = "" if tr.start is None else (str(e.start) if isinstance(e.start, int) else "lo")
                tr.parts.append(f"positions [{lo}:{e.stop if isinstance(e.stop, int) else 'n'}]")
            else:
                raise ChainBroken(n, "reads part of the heads or head dim, or slices an axis twice")
        src_labels.append(label)
        x_axis += 1
    return n.args[0], src_labels


def _unsqueeze(n: fx.Node, labels: list, tr: _Trace):
    # k.unsqueeze(2).expand(B, Hkv, n_rep, S, D).flatten(1, 2); a cache without a heads axis
    # broadcast to every query head (absorbed multi-head latent attention:
    # compressed_kv.unsqueeze(-3).mT against [B, H, S, C] queries)
    if not is_op(n, "unsqueeze"):
        return None
    dim = int(arg(n, 1, "dim")) % len(labels)
    if labels[dim] == "q" and "h" not in labels and len(labels) == 4:
        tr.parts.append(f"unsqueeze({arg(n, 1, 'dim')})")
        return n.args[0], labels[:dim] + labels[dim + 1:]       # one head for all: no heads axis
    if labels[dim] not in ("1", "r"):
        raise ChainBroken(n, "inserts an axis the attention uses")
    return n.args[0], labels[:dim] + labels[dim + 1:]


def _squeeze(n: fx.Node, labels: list, tr: _Trace):
    # a one-head cache read without its heads axis: compressed_kv.squeeze(1) of a [B, 1, T, C]
    # latent cache (absorbed multi-head latent attention over an HF-style cache)
    if not is_op(n, "squeeze"):
        return None
    src = _shape(n.args[0])
    dim = arg(n, 1, "dim")
    if src is None or not isinstance(dim, int) or len(src) != len(labels) + 1 \
            or not same_size(src[dim % len(src)], 1) or "h" in labels or "q" in labels:
        raise ChainBroken(n, "removes an axis the pass cannot place")
    dim %= len(src)
    tr.parts.append(f"squeeze({arg(n, 1, 'dim')})")
    return n.args[0], labels[:dim] + ["h"] + labels[dim:]


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
    ("squeeze", _squeeze),                # compressed_kv.squeeze(1) of a one-head latent cache
    ("expand", _expand),                  # repeat_kv's expand; MQA k.expand(B, Hq, S, D)
    ("reshape", _reshape),                # repeat_kv's reshape(b, h * n, s, d), .view, .flatten(1, 2)
    ("repeat_interleave", _repeat_interleave),   # gpt-fast / litgpt GQA
]


def trace_kv(node: Any, labels: list[str]) -> KVRead:
    """Walk back from an attention operand (whose axes are ``labels``, e.g. ``['b', 'q', 's',
    'd']``) through ``KV_STEPS`` to the first node that is not a view: the cache value (or,
    when none is there, whatever computed the operand). Raises :class:`ChainBroken` at an
    operation a step recognizes but cannot follow.

    An operand without a heads axis (``['b', 's', 'd']``: multi-head latent attention's
    latent and RoPE key caches, one for every query head) ends in a 3-D cache; its heads
    are a virtual trailing axis of size one (``axes['h'] == 3``: the cache viewed as
    ``cache.unsqueeze(-1)``)."""
    tr = _Trace()
    nodes: list[fx.Node] = []
    cur, lab = node, list(labels)
    while isinstance(cur, fx.Node) and cur.op in ("call_function", "call_method") \
            and not is_layer_view(cur):         # one layer of a stacked cache: the cache
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
    headless = sorted(lab) == ["b", "d", "s"]
    if not headless and sorted(lab) != ["b", "d", "h", "s"]:
        raise ChainBroken(cur, f"ends in a tensor whose axes the pass cannot map ({lab})")
    axes = {x: i for i, x in enumerate(lab)}
    if headless:
        axes["h"] = 3
    spelling = " + ".join(reversed(list(dict.fromkeys(tr.parts))))     # in the model's order
    return KVRead(spelling, cur, nodes, axes, tr.batch, tr.stop, tr.repeat, tr.start)
