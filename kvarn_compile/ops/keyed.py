"""Packed KV states addressed by a string key, for graphs that cannot take them as inputs.

``kvarn_backend`` hands every packed state to its compiled graphs as extra graph inputs.
An Inductor pre-grad pass (:mod:`kvarn_compile.inductor_pass`) cannot add graph inputs,
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

import ctypes
import ctypes.util
import itertools
import mmap
import sys
import threading
import uuid as _uuid

import torch

from kvarn_compile.config import KVarNConfig
from kvarn_compile.state import LayerState, allocate_layer

__all__ = ["StateStore", "resolve", "releasable", "release_storage", "released", "claim",
           "managed", "unwritten_since_release", "freeable_bytes", "is_freed", "resident_bytes",
           "SEP"]

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
                   growable: bool = False) -> LayerState:
        """The state new keys ``k`` [B, H, T, D] go to; allocated on first use (``growable``:
        with the tile slots these keys need, grown later by ``LayerState.reserve``)."""
        batch, heads, tokens, dim = k.shape
        state = self.states.get((site, batch))
        if state is not None and self._fits(state, k, max_len, growable):
            return state
        with self._lock:
            state = self.states.get((site, batch))
            if state is None or not self._fits(state, k, max_len, growable):
                state = allocate_layer(self.config, batch=batch, kv_heads=heads, head_dim=dim,
                                       max_len=max_len, dtype=k.dtype, device=k.device,
                                       spec_tokens=self.spec_tokens, name=site,
                                       grow_from=tokens if growable else None)
                self.states[(site, batch)] = state
        return state

    @staticmethod
    def _fits(state: LayerState, k: torch.Tensor, max_len: int, growable: bool) -> bool:
        return (state.max_len == max_len and state.head_dim == k.shape[3]
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


# ------------------------------------------------------------------ released buffers
# A model's own preallocated K/V buffers (a gpt-fast ``register_buffer`` cache, a
# transformers ``StaticCache``) are no longer read or written by the rewritten graphs; the
# packed state holds the tokens. Releasing them must free their memory without ever making
# a later eager access illegal: the model's own code may still reset (``zero_()``), write
# (an uncompiled prefill), copy or print them.
#
# CPU (Linux): ``madvise(MADV_DONTNEED)`` on the page-aligned interior of the buffer's
# storage returns those pages to the operating system while the mapping stays valid; the
# partial pages at both ends (shared with neighbouring allocations) are zeroed instead. The
# tensor keeps its storage, size, strides, dtype and data pointer (Dynamo's guards do not
# change), every element reads 0 afterwards, and a write simply commits fresh pages again
# (the next compiled call frees them again). Other platforms, shared-memory, pinned and
# non-CPU (CUDA) buffers are kept as they are: CUDA cannot free device memory under a live
# tensor without making its next access an illegal memory access.
#
# A released storage is marked; ``unwritten_since_release`` tells the adoption step
# (kvarn::adopt_) whether an uncompiled forward wrote a new prompt there since: its first
# token row is no longer all zeros.

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_RELEASED = "_kvarn_released"       # attributes on the UntypedStorage: bytes returned to the OS,
_MANAGED = "_kvarn_managed"         # "freed after every call" (see claim),
_VERSION = "_kvarn_version"         # and the tensor's version counter right after its release
_madvise_fn = None


def _madvise():
    """libc's madvise, or None off Linux (where MADV_DONTNEED does not zero-fill)."""
    global _madvise_fn
    if _madvise_fn is None:
        fn = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                fn = libc.madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = False
        _madvise_fn = fn
    return _madvise_fn or None


def _spans_storage(t: torch.Tensor) -> bool:
    nbytes = t.untyped_storage().nbytes()
    return bool(nbytes) and t.storage_offset() == 0 and t.is_contiguous() \
        and t.numel() * t.element_size() == nbytes


def releasable(tensor: torch.Tensor) -> bool:
    """True when :func:`release_storage` frees ``tensor``'s memory: a real CPU tensor on
    Linux that spans its whole storage, not in shared memory and not pinned (never a view
    into a larger buffer, whose other parts something else may use)."""
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, torch._subclasses.FakeTensor):
        return False
    if tensor.device.type != "cpu" or not _spans_storage(tensor) or _madvise() is None:
        return False
    return not tensor.untyped_storage().is_shared() and not tensor.is_pinned()


def _untouched(tensor: torch.Tensor) -> bool:
    """Released, and no in-place op has run on ``tensor`` (or a view of its buffer) since:
    its version counter is the one recorded right after the release. (A write that bypasses
    the dispatcher, through a raw pointer, goes unseen here: such memory is freed again on
    the next release that follows a counted write.)"""
    storage = tensor.untyped_storage()
    return getattr(storage, _RELEASED, None) is not None \
        and getattr(storage, _VERSION, None) == tensor._version


def claim(tensor: torch.Tensor) -> None:
    """Mark ``tensor``'s storage as freed after every call (the backend claims the buffers it
    releases before each call, so the adoption step also recognizes views of them)."""
    if getattr(tensor.untyped_storage(), _MANAGED, False):
        return                                   # claimed before (every call passes it again)
    if releasable(tensor):
        setattr(tensor.untyped_storage(), _MANAGED, True)


def managed(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` (or the buffer it is a view of) is freed after the call that
    passes it: :func:`releasable`, or claimed or released before."""
    return releasable(tensor) or bool(getattr(tensor.untyped_storage(), _MANAGED, False))


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _interior(storage: torch.UntypedStorage) -> tuple[int, int]:
    """Offsets [lo, hi) of the whole pages inside the storage (lo == hi: none)."""
    ptr, n = storage.data_ptr(), storage.nbytes()
    lo = -ptr % _PAGE
    hi = max(lo, (ptr + n) // _PAGE * _PAGE - ptr)
    return lo, hi


def freeable_bytes(tensor: torch.Tensor) -> int:
    """Bytes :func:`release_storage` returns to the operating system for ``tensor`` (the
    whole pages of its storage), 0 when it is not :func:`releasable`."""
    if not releasable(tensor):
        return 0
    lo, hi = _interior(tensor.untyped_storage())
    return hi - lo


def release_storage(tensor: torch.Tensor) -> int:
    """Free the memory of a model-owned buffer (see the comment above); every element reads
    0 afterwards and stays legal to read and write. Returns the bytes newly returned to the
    operating system: the whole pages of the storage on its first release, 0 afterwards
    (a buffer written again is freed again, but counted once) and 0 when the buffer is not
    :func:`releasable` (kept as it is). A buffer nothing wrote since its last release is
    left as it is (no system call: it is called for every cache buffer on every step)."""
    if _untouched(tensor):
        return 0
    if not releasable(tensor):
        return 0
    storage = tensor.untyped_storage()
    setattr(storage, _MANAGED, True)
    raw = _bytes_of(storage)
    lo, hi = _interior(storage)
    raw[:lo].zero_()
    raw[hi:].zero_()
    freed = hi - lo
    if hi > lo:
        ok = _madvise()(storage.data_ptr() + lo, hi - lo, _MADV_DONTNEED) == 0
        if ok and getattr(storage, _RELEASED, None) is None:
            ok = int(raw[lo]) == 0 and int(raw[hi - 1]) == 0     # zero-filled on next touch
        if not ok:                     # e.g. locked pages: keep the memory, zero it
            raw[lo:hi].zero_()
            freed = 0
    first = getattr(storage, _RELEASED, None) is None
    if first:
        setattr(storage, _RELEASED, freed)
    setattr(storage, _VERSION, tensor._version)
    return freed if first else 0


def released(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s storage was released by :func:`release_storage` (it may have
    been written again since)."""
    return isinstance(tensor, torch.Tensor) and \
        getattr(tensor.untyped_storage(), _RELEASED, None) is not None


def unwritten_since_release(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` (a cache [B, H, S, D], or a view in that order) holds no data a
    forward wrote since its release: released, and its first position still all zeros (a
    prompt always writes position 0). A zero-byte storage counts as released too."""
    if not tensor.untyped_storage().nbytes() or _untouched(tensor):
        return True
    if not released(tensor):
        return False
    return not bool(tensor[:, :, :1].any())


def is_freed(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s buffer is released and holds no more physical memory than the
    partial pages at its two ends (and, right after the first release, the two pages that
    checked the zero fill): what a test or a user checks after a compiled call."""
    resident = resident_bytes(tensor)
    return released(tensor) and resident is not None and resident <= 4 * _PAGE


def resident_bytes(tensor: torch.Tensor) -> int | None:
    """Bytes of ``tensor``'s storage backed by physical memory now (Linux ``mincore``); None
    where that cannot be measured. Reading a released buffer maps the shared zero page,
    which ``mincore`` counts but the process's RSS does not; tests measure before reading."""
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return None
    storage = tensor.untyped_storage()
    ptr, n = storage.data_ptr(), storage.nbytes()
    if not n:
        return 0
    first = ptr // _PAGE * _PAGE
    pages = (ptr + n - first + _PAGE - 1) // _PAGE
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(pages * _PAGE), vec) != 0:
        return None
    return sum(b & 1 for b in vec) * _PAGE


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
