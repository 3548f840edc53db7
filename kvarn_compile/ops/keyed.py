"""Packed KV states addressed by a string key, for graphs that cannot take them as inputs.

``kvarn_backend`` hands every packed state to its compiled graphs as extra graph inputs.
An Inductor pre-grad pass (:mod:`kvarn_compile.pre_grad_pass`) cannot add graph inputs,
so the graphs it rewrites call the keyed ops (``kvarn::append_keyed``,
``kvarn::attention_keyed``) with a constant key ``"<namespace>/<site>"`` instead, and the
ops find the state here at run time. Each pass object owns one :class:`StateStore` (its
namespace); a state is allocated on the first append per (site, batch size), with the
shape of the keys written, and reallocated only when that shape, the device or the
capacity changes (as ``kvarn_backend`` does).

The registry holds its stores strongly: compiled code may outlive the pass object. Call
``StateStore.close()`` (``KVarNInductorPass.close()``) to drop a store and its states.
"""

from __future__ import annotations

import itertools
import threading
import uuid as _uuid
from collections.abc import Callable

import torch

from kvarn_compile.config import KVarNConfig
from kvarn_compile.ops.append import adopt_, reorder_
from kvarn_compile.ops.buffers import release_storage
from kvarn_compile.state import LayerState, allocate_layer

__all__ = ["StateStore", "resolve", "SEP", "append_keyed", "state_for_attention", "reorder_keyed"]

#: Separates the store's namespace from the site name in a key (namespaces never hold it).
SEP = "/"

_STORES: dict[str, "StateStore"] = {}
_LOCK = threading.Lock()
_COUNTER = itertools.count()


class StateStore:
    """The packed states of one namespace, keyed by (site name, batch size)."""

    def __init__(self, config: KVarNConfig, *, spec_tokens: int = 0) -> None:
        self.config = config
        self.spec_tokens = spec_tokens
        #: unique in the process and across processes (it ends up in compiled graphs and
        #: in Inductor's cache keys, so a cached graph never reaches another store)
        self.namespace = f"kvarn{next(_COUNTER)}-{_uuid.uuid4().hex[:12]}"
        self.states: dict[tuple[str, int], LayerState] = {}
        #: bytes of model-owned cache buffers freed at run time (kvarn::append_keyed)
        self.released_bytes = 0
        self._lock = threading.Lock()
        with _LOCK:
            _STORES[self.namespace] = self

    def key(self, site: str) -> str:
        return f"{self.namespace}{SEP}{site}"

    # ------------------------------------------------------------------ states
    def for_append(self, site: str, k: torch.Tensor, max_len: int, *,
                   growable: bool = False, value_head_dim: int | None = None) -> LayerState:
        """The state new keys ``k`` [B, H, T, D] go to; allocated on first use (``growable``:
        with the tile slots these keys need, grown later by ``LayerState.reserve``;
        ``value_head_dim``: the values' Dv, when not D)."""
        batch, heads, tokens, dim = k.shape
        dv = dim if value_head_dim is None else value_head_dim
        state = self.states.get((site, batch))
        if state is not None and self._fits(state, k, dv, max_len, growable):
            return state
        with self._lock:
            state = self.states.get((site, batch))
            if state is None or not self._fits(state, k, dv, max_len, growable):
                state = allocate_layer(self.config, batch=batch, kv_heads=heads, head_dim=dim,
                                       max_len=max_len, dtype=k.dtype, device=k.device,
                                       spec_tokens=self.spec_tokens, name=site,
                                       grow_from=tokens if growable else None,
                                       value_head_dim=dv)
                self.states[(site, batch)] = state
        return state

    @staticmethod
    def _fits(state: LayerState, k: torch.Tensor, dv: int, max_len: int, growable: bool) -> bool:
        return (state.max_len == max_len and state.head_dim == k.shape[3]
                and state.value_head_dim == dv
                and state.kv_heads == k.shape[1] and state.sink_k.device == k.device
                and state.growable == growable)

    def for_attention(self, site: str, batch: int) -> LayerState:
        state = self.states.get((site, batch))
        if state is None:
            raise RuntimeError(
                f"KVarN attention at {site}: no packed state for batch size {batch}; its cache "
                "update must run first in the same graph (kvarn::append_keyed).")
        return state

    @property
    def nbytes(self) -> int:
        """Bytes held by every packed state of this store (live tensors)."""
        return sum(s.nbytes for s in self.states.values())

    def reset(self) -> None:
        """Forget every sequence (the states stay allocated)."""
        for state in self.states.values():
            for name in ("lengths", "committed", "n_tiles"):
                getattr(state, name).zero_()

    def close(self) -> None:
        """Drop every state and unregister; graphs compiled for this store then fail."""
        with _LOCK:
            _STORES.pop(self.namespace, None)
        self.states.clear()


def resolve(key: str) -> tuple[StateStore, str]:
    """(store, site) of a key made by :meth:`StateStore.key`."""
    namespace, _, site = key.partition(SEP)
    store = _STORES.get(namespace)
    if store is None:
        raise RuntimeError(
            f"KVarN: no packed-state store {namespace!r} for {site!r}. The graph was compiled "
            "by a kvarn_compile.inductor_pass(...) object that was closed, or in another "
            "process; compile the model again with a live pass object.")
    return store, site


# ------------------------------------------------------------------------------ keyed ops
def append_keyed(k: torch.Tensor, v: torch.Tensor, start_pos: torch.Tensor,
                 cache_k: torch.Tensor | None, cache_v: torch.Tensor | None, key: str,
                 max_len: int, method: str, iters: int, recent: int, hold: int,
                 check_finite: bool, release: bool, *, append: Callable[..., None]) -> torch.Tensor:
    """The reference of ``kvarn::append_keyed`` (see its doc in :mod:`.library`); ``append``
    is the plain append op, so the device's kernel runs."""
    store, site = resolve(key)
    # a cat cache (no model-owned tensors) grows with the sequence: room for this append
    growable = cache_k is None and cache_v is None
    state = store.for_append(site, k, max_len, growable=growable, value_head_dim=v.shape[-1])
    if growable and start_pos.numel():
        first, last = start_pos.aminmax()  # every row starting over at 0: a new sequence
        state.reserve(int(last) + k.shape[2], fresh=int(last) == 0, shortest=int(first) + k.shape[2])
    if cache_k is not None and cache_v is not None:
        adopt_(state.buffers, cache_k, cache_v, start_pos, method, iters, recent, hold,
               check_finite, site, release, append=append)
    append(state.buffers, k, v, start_pos, method, iters, recent, hold, check_finite, site)
    if growable:
        state.trim()                      # the tail slots frozen tiles freed
    if release:
        for cache in (cache_k, cache_v):
            if cache is not None:
                store.released_bytes += release_storage(cache)
    return v.new_empty((0, v.shape[-1]))


def state_for_attention(key: str, batch: int) -> list[torch.Tensor]:
    """The buffers ``kvarn::attention_keyed`` attends over."""
    store, site = resolve(key)
    return store.for_attention(site, batch).buffers


def reorder_keyed(batch: int, rows: torch.Tensor, key: str) -> None:
    """The reference of ``kvarn::reorder_keyed``: reorder the state's rows if allocated."""
    store, site = resolve(key)
    state = store.states.get((site, batch))
    if state is not None:
        reorder_(state.buffers, rows, site)
