"""Packed KV states addressed by a string key, for graphs that cannot take them as inputs.

``kvarn_backend`` hands every packed state to its compiled graphs as extra graph inputs.
An Inductor pre-grad pass (:mod:`kvarn_compile.passes.inductor`) cannot add graph inputs,
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

import torch

from kvarn_compile.config import KVarNConfig
from kvarn_compile.state import LayerState, allocate_layer

__all__ = ["StateStore", "resolve", "releasable", "release_storage", "SEP"]

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
    def for_append(self, site: str, k: torch.Tensor, max_len: int) -> LayerState:
        """The state new keys ``k`` [B, H, T, D] go to; allocated on first use."""
        batch, heads, _, dim = k.shape
        state = self.states.get((site, batch))
        if state is not None and self._fits(state, k, max_len):
            return state
        with self._lock:
            state = self.states.get((site, batch))
            if state is None or not self._fits(state, k, max_len):
                state = allocate_layer(self.config, batch=batch, kv_heads=heads, head_dim=dim,
                                       max_len=max_len, dtype=k.dtype, device=k.device,
                                       spec_tokens=self.spec_tokens, name=site)
                self.states[(site, batch)] = state
        return state

    @staticmethod
    def _fits(state: LayerState, k: torch.Tensor, max_len: int) -> bool:
        return (state.max_len == max_len and state.head_dim == k.shape[3]
                and state.kv_heads == k.shape[1] and state.sink_k.device == k.device)

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


def releasable(tensor: torch.Tensor) -> bool:
    """True for a real tensor that holds storage and spans all of it (never a view into a
    larger buffer, whose other parts someone else may use)."""
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, torch._subclasses.FakeTensor):
        return False
    nbytes = tensor.untyped_storage().nbytes()
    return bool(nbytes) and tensor.storage_offset() == 0 and tensor.is_contiguous() \
        and tensor.numel() * tensor.element_size() == nbytes


def release_storage(tensor: torch.Tensor) -> int:
    """Resize a model-owned tensor's storage to 0 bytes (shape, strides and dtype stay);
    the bytes freed, 0 when not :func:`releasable` (already released, a fake, a view)."""
    if not releasable(tensor):
        return 0
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    return nbytes


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
