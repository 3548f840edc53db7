"""Context-parallel decoding: the packed tiles of one sequence spread over the ranks of a group.

For contexts one device cannot hold. Every rank runs the whole model (weights replicated,
as in decode-time context parallelism), so every rank computes the same new K/V and the
same queries; only the KV cache is split:

* **tiles**: rank ``r`` of ``R`` holds the contiguous tile range
  ``[r * n_local, (r + 1) * n_local)`` of the sequence, ``n_local = ceil(n / R)`` for the
  ``n`` tiles a single process would allocate. Its packed region is ``1 / R`` of the
  single-process one. A tile is quantized only by the rank that owns it (from the tail
  ring every rank holds), with the same kernel a single process uses, so it holds the
  same codes and scales bit for bit;
* **sink, tail and counters** are replicated (``sink + tail`` tokens of high precision,
  a few KiB per layer; the counters count the whole sequence on every rank);
* **attention**: each rank attends the exact region (sink + tail, identical on every
  rank) and its own tiles, then the ranks exchange their tile partials (normalized output
  + log-sum-exp) in **one** ``all_gather`` per attention call, and every rank merges the
  exact region and the ``R`` partials by log-sum-exp, so every rank returns the same output.
  The result equals the single-process attention up to float rounding (the softmax sums
  are grouped per rank).

Use it with ``kvarn_backend(..., context_parallel=group)`` or
``KVarNCache(..., context_parallel=group)`` (``group``: a ``ProcessGroup``, or ``True`` for
the default group). The ops are ``kvarn::cp_append_``, ``kvarn::cp_append_from_`` and
``kvarn::cp_attention`` (:mod:`kvarn_compile.ops.library`); they take the group as a key
string (:func:`register`), and the compiler sees them as opaque calls. Every rank must run
the same forward calls (same prompts, same steps), as with any collective; a rank that
stops makes the others end with the process group's timeout error.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

import torch

from kvarn_compile.ops import append as append_ref, attention as attention_ref, regions
from kvarn_compile.state import LayerState, StateLayout, TILE_FIELDS, allocate_layer, unpack

__all__ = ["ContextParallel", "register", "resolve", "allocate", "append_", "attention",
           "global_view", "owned_tiles", "tile_range"]

#: Members of the state that are per tile (dim 2 = tile slot): split over the ranks.
_PER_TILE = tuple(f"{side}_{m}" for side in "kv" for m in TILE_FIELDS) + (
    "k_row_factor", "k_col_factor", "v_row_factor", "v_col_factor", "k_plain")


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """A registered group: its key (what the ops take), rank and size."""

    key: str
    group: Any
    rank: int
    world: int

    def tile_offset(self, n_local: int) -> int:
        """The sequence tile number of this rank's first tile slot."""
        return self.rank * n_local


_GROUPS: dict[str, ContextParallel] = {}
_LOCK = threading.Lock()


def register(group: Any = True) -> ContextParallel:
    """Register a process group for context parallelism; returns its handle.

    ``group``: a ``torch.distributed`` ``ProcessGroup``, or ``True`` for the default group.
    Raises a one-line ValueError if torch.distributed is not initialized.
    """
    import torch.distributed as dist

    if group is False or group is None:
        raise ValueError("context_parallel: expected a ProcessGroup or True (the default group), "
                         f"but got {group!r}; leave the argument out to keep the cache on one device.")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("context_parallel: torch.distributed is not initialized; call "
                         "torch.distributed.init_process_group(...) on every rank first "
                         "(e.g. under torchrun).")
    pg = dist.group.WORLD if group is True else group
    if not isinstance(pg, dist.ProcessGroup):
        raise ValueError(f"context_parallel: expected a torch.distributed ProcessGroup or True, "
                         f"but got {type(group).__name__}.")
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    with _LOCK:
        for cp in _GROUPS.values():
            if cp.group is pg:
                return cp
        cp = ContextParallel(key=f"cp{len(_GROUPS)}", group=pg, rank=rank, world=world)
        _GROUPS[cp.key] = cp
    return cp


def resolve(key: str) -> ContextParallel:
    try:
        return _GROUPS[key]
    except KeyError:
        raise ValueError(f"context_parallel: no process group registered as {key!r} in this "
                         "process (kvarn_compile.ops.context_parallel.register).") from None


# ------------------------------------------------------------------------------ state
def tile_range(max_len: int, sink: int, group: int, world: int) -> tuple[int, int]:
    """(tiles of the whole sequence, tiles per rank) for ``max_len`` tokens."""
    n = max(max_len - min(sink, max_len), 0) // group
    return n, math.ceil(n / world) if n else 0


def allocate(cp: ContextParallel, config, *, batch: int, kv_heads: int, head_dim: int,
             max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu",
             spec_tokens: int = 0, name: str = "", value_head_dim: int | None = None) -> LayerState:
    """One layer's state on this rank: ``ceil(n / world)`` tile slots, replicated sink, tail
    and counters; the capacity counter is the whole sequence's ``max_len``."""
    g, sink = config.group_size, min(config.sink, max_len)
    _, n_local = tile_range(max_len, sink, g, cp.world)
    state = allocate_layer(config, batch=batch, kv_heads=kv_heads, head_dim=head_dim,
                           max_len=sink + n_local * g, dtype=dtype, device=device,
                           spec_tokens=spec_tokens, name=name, value_head_dim=value_head_dim)
    state.capacity.fill_(max_len)
    state.max_len = max_len
    state.context_parallel = cp.key
    state.tile_offset = cp.tile_offset(n_local)
    return state


def global_view(buffers: list[torch.Tensor], n_global: int) -> list[torch.Tensor]:
    """The state as the single-process bookkeeping sees it: the per-tile members replaced
    by zero-stride stand-ins of ``n_global`` slots (shapes only, no memory); sink, tail and
    counters are the real tensors."""
    layout = StateLayout.of(buffers)
    out = []
    for name, t in zip(layout.names, buffers):
        if name in _PER_TILE:
            shape = (*t.shape[:2], n_global, *t.shape[3:])
            t = t.new_zeros(()).expand(shape)
        out.append(t)
    return out


def owned_tiles(first: int, count: int, offset: int, n_local: int) -> tuple[int, int]:
    """The part [a, b) of sequence tiles [first, first + count) that slots
    [offset, offset + n_local) hold (a == b: none)."""
    a, b = max(first, offset), min(first + count, offset + n_local)
    return a, max(a, b)


def append_(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
            start_pos: torch.Tensor, method: str, iters: int, recent: int, hold: int,
            check_finite: bool, name: str, key: str, *, tile_kernel=None,
            upto: torch.Tensor | None = None) -> None:
    """``append_ref.append_`` (or ``commit_`` with ``upto``) of the whole sequence, storing only
    the tiles this rank owns. Runs on every rank; no collective."""
    cp = resolve(key)
    n_local = buffers[StateLayout.of(buffers).index("k_codes")].shape[2]
    offset = cp.tile_offset(n_local)
    view = global_view(buffers, cp.world * n_local)
    g = unpack(buffers).k.col_scale.shape[-1]

    def freeze(_view, row, tokens_k, tokens_v, first_tile, method, iters, check, name, kernel):
        a, b = owned_tiles(first_tile, tokens_k.shape[1] // g, offset, n_local)
        if a < b:
            lo, hi = (a - first_tile) * g, (b - first_tile) * g
            append_ref.freeze_tiles(buffers, row, tokens_k[:, lo:hi], tokens_v[:, lo:hi], a - offset,
                              method, iters, check, name, kernel)

    if upto is not None:
        append_ref.commit_(view, upto, method, iters, recent, check_finite, name,
                          tile_kernel=tile_kernel, freeze_fn=freeze)
    else:
        append_ref.append_(view, k, v, start_pos, method, iters, recent, hold, check_finite, name,
                          tile_kernel=tile_kernel, freeze_fn=freeze)


def _gather(t: torch.Tensor, cp: ContextParallel) -> list[torch.Tensor]:
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(cp.world)]
    dist.all_gather(parts, t.contiguous(), group=cp.group)
    return parts


def attention(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None,
              scale: float, causal: bool, window: int, key: str) -> torch.Tensor:
    """``kvarn::attention`` of a context-parallel state: the exact region and this rank's
    tiles here, the ranks' tile partials merged after one ``all_gather``."""
    cp = resolve(key)
    f = unpack(buffers)
    attention_ref.check_queries(q, f)
    attention_ref.check_mask(f, mask)
    n_local = f.k.codes.shape[2]
    offset = cp.tile_offset(n_local)
    out_e, lse_e = regions.exact_region(q, f, mask, scale, causal, window)
    n_used = max(0, min(int(f.n_tiles.max()) - offset, n_local)) if n_local else 0
    if n_used:
        out_t, lse_t = attention_ref.tile_region(q, f, mask, scale, causal, window, n_used,
                                              tile_offset=offset)
    else:
        out_t = torch.zeros_like(out_e)
        lse_t = torch.full_like(lse_e, regions.NEG_INF)
    # one collective: [out | lse] of every rank
    packed = torch.cat([out_t.reshape(-1), lse_t.reshape(-1)])
    parts = _gather(packed, cp)
    n_out = out_t.numel()
    outs = [p[:n_out].view_as(out_t) for p in parts]
    lses = [p[n_out:].view_as(lse_t) for p in parts]
    out, _ = regions.combine_splits(torch.stack([out_e, *outs], -2), torch.stack([lse_e, *lses], -1))
    return out.to(q.dtype)

