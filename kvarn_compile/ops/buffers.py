"""Releasing the model-owned K/V buffers a rewritten graph no longer reads.

A model's own preallocated K/V buffers (a gpt-fast ``register_buffer`` cache, a
transformers ``StaticCache``) are no longer read or written by the rewritten graphs; the
packed state holds the tokens. Releasing them must free their memory without ever making
a later eager access illegal: the model's own code may still reset (``zero_()``), write
(an uncompiled prefill), copy or print them.

CPU (Linux): ``madvise(MADV_DONTNEED)`` on the page-aligned interior of the buffer's
storage returns those pages to the operating system while the mapping stays valid; the
partial pages at both ends (shared with neighbouring allocations) are zeroed instead. The
tensor keeps its storage, size, strides, dtype and data pointer (Dynamo's guards do not
change), every element reads 0 afterwards, and a write simply commits fresh pages again
(the next compiled call frees them again). Other platforms, shared-memory, pinned and
non-CPU (CUDA) buffers are kept as they are: CUDA cannot free device memory under a live
tensor without making its next access an illegal memory access.

Between compiled calls the front-end types such a buffer (``cache_book.PackedBuffer``): plain
PyTorch that touches it first gets the packed tokens dequantized into it, never zeros.

A released storage is marked; ``unwritten_since_release`` tells the adoption step
(kvarn::adopt_) whether an uncompiled forward wrote a new prompt there since: its first
token row is no longer all zeros.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import torch

__all__ = ["releasable", "release_storage", "released", "claim", "managed", "unwritten_since_release",
           "untouched_since_release",
           "mark_seen", "unchanged_since_seen",
           "freeable_bytes", "is_freed", "resident_bytes"]

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_RELEASED = "_kvarn_released"       # attributes on the UntypedStorage: bytes returned to the OS,
_MANAGED = "_kvarn_managed"         # "freed after every call" (see claim),
_VERSION = "_kvarn_version"         # and the tensor's version counter right after its release
_SEEN = "_kvarn_seen"               # the version counter of a kept buffer after a call read it
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


def _version(tensor: torch.Tensor) -> int | None:
    """``tensor``'s version counter, or None where it has none: an inference tensor (under
    ``torch.inference_mode`` the compiled code's aliases of a model buffer are), whose writes
    are then not counted, so every check below answers "may have changed" and the data
    decides."""
    return None if tensor.is_inference() else tensor._version


def untouched_since_release(tensor: torch.Tensor) -> bool:
    """Released, and no in-place op has run on ``tensor`` (or a view of its buffer) since:
    its version counter is the one recorded right after the release. (A write that bypasses
    the dispatcher, through a raw pointer, goes unseen here: such memory is freed again on
    the next release that follows a counted write.)"""
    storage = tensor.untyped_storage()
    version = _version(tensor)
    return getattr(storage, _RELEASED, None) is not None and version is not None \
        and getattr(storage, _VERSION, None) == version


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
    if untouched_since_release(tensor):
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
    setattr(storage, _VERSION, _version(tensor))
    from kvarn_compile.kernels.cpu import attention as cpu_attention

    cpu_attention.note_released(tensor)      # the native append kernel's own record
    return freed if first else 0


def released(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s storage was released by :func:`release_storage` (it may have
    been written again since)."""
    return isinstance(tensor, torch.Tensor) and \
        getattr(tensor.untyped_storage(), _RELEASED, None) is not None


def mark_seen(tensor: torch.Tensor) -> None:
    """Record that a compiled call has taken in what ``tensor`` (a model-owned buffer kept in
    full precision, e.g. on CUDA, where it cannot be freed) holds now: its version counter."""
    setattr(tensor.untyped_storage(), _SEEN, _version(tensor))


def unchanged_since_seen(tensor: torch.Tensor) -> bool:
    """True when no in-place op has run on ``tensor`` (or a view of its buffer) since
    :func:`mark_seen`: a host-side test (the version counter), no read of the data, so a
    step that asks it can be captured in a CUDA graph."""
    version = _version(tensor)
    return version is not None and getattr(tensor.untyped_storage(), _SEEN, None) == version


def unwritten_since_release(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` (a cache [B, H, S, D], or a view in that order) holds no data a
    forward wrote since its release: released, and its first position still all zeros (a
    prompt always writes position 0). A zero-byte storage counts as released too."""
    if not tensor.untyped_storage().nbytes() or untouched_since_release(tensor):
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
