"""``torch.ops.kvarn.*``: custom ops over the packed layer state, with fake kernels.

Each op's default implementation is its pure-torch reference (:mod:`.reference`); CUDA
tensors use the Triton kernels of :mod:`kvarn_compile.kernels` where they apply. The
fake kernels compute shapes and check devices (they also serve the Meta dispatch key), so
the ops trace under torch.compile and FakeTensor.

    kvarn::append_(Tensor(a!)[] buffers, Tensor k, Tensor v, Tensor start_pos, str method,
                   int iters, int recent, int hold, bool check_finite, str name) -> ()
    kvarn::commit_(Tensor(a!)[] buffers, Tensor upto, str method, int iters, int recent,
                   bool check_finite, str name) -> ()
    kvarn::attention(Tensor q, Tensor[] buffers, Tensor? mask, float scale, bool causal,
                     int window) -> Tensor

Adoption (new op, before ``append_``, where the graph no longer reads the model's own
preallocated cache): a prompt that a non-compiled forward wrote to that cache is taken
over into the packed state (transformers' eager prefill under ``generate(compile_config=)``).

    kvarn::adopt_(Tensor(a!)[] buffers, Tensor cache_k, Tensor cache_v, Tensor start_pos,
                  str method, int iters, int recent, int hold, bool check_finite, str name,
                  bool fresh) -> ()
    kvarn::append_from_(Tensor(a!)[] buffers, Tensor k, Tensor v, Tensor start_pos,
                        str method, int iters, int recent, int hold, bool check_finite,
                        str name, Tensor cache_k, Tensor cache_v, bool fresh) -> ()
                                     # adopt_ + append_ in one call (the rewrite's default)

Keyed forms for graphs that cannot take the packed state as an input (the Inductor
pre-grad pass, :mod:`kvarn_compile.passes.inductor`): the state is found at run time in
:mod:`kvarn_compile.registry` by a constant key, and the append returns an empty token
tensor the attention takes, so the compiler keeps the append and orders it first. To the
compiler these ops are functional (the state is invisible to it).

    kvarn::append_keyed(Tensor k, Tensor v, Tensor start_pos, Tensor? cache_k,
                        Tensor? cache_v, str key, int max_len, str method, int iters,
                        int recent, int hold, bool check_finite, bool release) -> Tensor
    kvarn::attention_keyed(Tensor q, Tensor token, Tensor? mask, str key, float scale,
                           bool causal, int window) -> Tensor
"""

from __future__ import annotations

import os

import torch

from kvarn_compile.ops import reference

__all__ = ["append_", "commit_", "attention", "adopt_", "append_from_", "append_keyed",
           "attention_keyed", "reorder_", "reorder_keyed"]


@torch.library.custom_op("kvarn::append_", mutates_args=("buffers",))
def append_(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
            start_pos: torch.Tensor, method: str, iters: int, recent: int,
            hold: int, check_finite: bool, name: str) -> None:
    """Quantize-on-append: write K/V [B, H, T, D] at start_pos [B] (see ops.reference)."""
    reference.append_(buffers, k, v, start_pos, method=method, iters=iters, recent=recent,
                      hold=hold, check_finite=check_finite, name=name)


def _check_devices(op: str, buffers: list[torch.Tensor], **tensors: torch.Tensor | None) -> None:
    """The data-free part of the eager checks, for the fake kernels.

    A fake kernel also serves the Meta dispatch key, so without this an op called with a
    meta tensor next to a real cache would silently do nothing instead of failing like the
    eager kernel does.
    """
    device = buffers[0].device
    for label, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"KVarN {op}: expected {label} on {device} like the cache, but got "
                             f"{t.device}. Move the cache or the model.")


@append_.register_fake
def _append_fake(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name):
    _check_devices("append", buffers, keys=k, values=v)
    return None


@torch.library.custom_op("kvarn::commit_", mutates_args=("buffers",))
def commit_(buffers: list[torch.Tensor], upto: torch.Tensor, method: str, iters: int,
            recent: int, check_finite: bool, name: str) -> None:
    """Commit tokens < upto[b] and freeze every tile that became complete."""
    reference.commit_(buffers, upto, method=method, iters=iters, recent=recent,
                      check_finite=check_finite, name=name)


@commit_.register_fake
def _commit_fake(buffers, upto, method, iters, recent, check_finite, name):
    return None


@torch.library.custom_op("kvarn::attention", mutates_args=())
def attention(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None,
              scale: float, causal: bool, window: int) -> torch.Tensor:
    """Fused dual-scale dequant attention of q [B, Hq, Tq, D] over the packed cache."""
    return reference.attention(q, buffers, mask, scale, causal, window).contiguous()


@attention.register_fake
def _attention_fake(q, buffers, mask, scale, causal, window):
    _check_devices("attention", buffers, queries=q)
    return q.new_empty(q.shape)      # contiguous, whatever q's strides (as the kernels return)


@attention.register_kernel("cuda")
def _attention_cuda(q, buffers, mask, scale, causal, window):
    from kvarn_compile.kernels import triton_available
    from kvarn_compile.ops import kernel_impl

    if not triton_available():
        return reference.attention(q, buffers, mask, scale, causal, window).contiguous()
    return kernel_impl.attention(q, buffers, mask, scale, causal, window).contiguous()


@attention.register_kernel("cpu")
def _attention_cpu(q, buffers, mask, scale, causal, window):
    # The C++ tile kernel where it applies and builds (KVARN_CPU_KERNEL=0 turns it off);
    # otherwise the pure-torch reference.
    from kvarn_compile.kernels import cpu_attention
    from kvarn_compile.ops import kernel_impl

    if os.environ.get("KVARN_CPU_KERNEL", "1") != "0" and q.shape[2] <= 16 \
            and kernel_impl.kernel_applies(q, buffers, mask) and cpu_attention.available():
        return kernel_impl.attention(q, buffers, mask, scale, causal, window, kernel="cpu").contiguous()
    return reference.attention(q, buffers, mask, scale, causal, window).contiguous()


# ------------------------------------------------------------------------------ adoption
def _adopt(buffers: list[torch.Tensor], cache_k: torch.Tensor, cache_v: torch.Tensor,
           start_pos: torch.Tensor, method: str, iters: int, recent: int, hold: int,
           check_finite: bool, name: str, fresh: bool) -> None:
    """Restart the packed sequence with the tokens [0, p) of the model's own cache.

    Runs when the model's cache tensors still hold storage (the graph never writes them;
    a forward that was not compiled did, e.g. transformers' eager prefill under
    ``generate(compile_config=...)``) and this write starts at p > 0. ``fresh``: the
    caller frees the cache after this call, so stored data always belongs to a new
    sequence; otherwise (or for a view the caller cannot free) only a state that does not
    continue at p is restarted.
    """
    from kvarn_compile.registry import managed, unwritten_since_release
    from kvarn_compile.state import BUF

    if unwritten_since_release(cache_k) and unwritten_since_release(cache_v):
        return                                       # released, nothing written since (fast path)
    starts = start_pos.tolist()
    p = starts[0]
    if p <= 0 or any(s != p for s in starts) or p > cache_k.shape[2]:
        return                                       # a new sequence, or the append refuses it
    if not (fresh and managed(cache_k) and managed(cache_v)):
        if all(n == p for n in buffers[BUF["lengths"]].tolist()):
            return                                   # the packed state continues at p
    reference.append_(buffers, cache_k[:, :, :p], cache_v[:, :, :p], torch.zeros_like(start_pos),
                      method=method, iters=iters, recent=recent, hold=hold,
                      check_finite=check_finite, name=name)


@torch.library.custom_op("kvarn::adopt_", mutates_args=("buffers",))
def adopt_(buffers: list[torch.Tensor], cache_k: torch.Tensor, cache_v: torch.Tensor,
           start_pos: torch.Tensor, method: str, iters: int, recent: int, hold: int,
           check_finite: bool, name: str, fresh: bool) -> None:
    """Before ``append_``: take over a prompt a non-compiled forward wrote to the model's
    cache (see ``_adopt``). A no-op (one storage-size check) once the cache is released."""
    _adopt(buffers, cache_k, cache_v, start_pos, method, iters, recent, hold, check_finite,
           name, fresh)


@adopt_.register_fake
def _adopt_fake(buffers, cache_k, cache_v, start_pos, method, iters, recent, hold,
                check_finite, name, fresh):
    return None


@torch.library.custom_op("kvarn::append_from_", mutates_args=("buffers",))
def append_from_(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                 start_pos: torch.Tensor, method: str, iters: int, recent: int, hold: int,
                 check_finite: bool, name: str, cache_k: torch.Tensor, cache_v: torch.Tensor,
                 fresh: bool) -> None:
    """``adopt_`` then ``append_`` in one call (one dispatch per step instead of two); the
    first ten arguments are ``append_``'s."""
    _adopt(buffers, cache_k, cache_v, start_pos, method, iters, recent, hold, check_finite,
           name, fresh)
    reference.append_(buffers, k, v, start_pos, method=method, iters=iters, recent=recent,
                      hold=hold, check_finite=check_finite, name=name)


@append_from_.register_fake
def _append_from_fake(buffers, k, v, start_pos, method, iters, recent, hold, check_finite,
                      name, cache_k, cache_v, fresh):
    _check_devices("append", buffers, keys=k, values=v)
    return None


# ------------------------------------------------------------------------------ keyed forms
@torch.library.custom_op("kvarn::append_keyed", mutates_args=())
def append_keyed(k: torch.Tensor, v: torch.Tensor, start_pos: torch.Tensor,
                 cache_k: torch.Tensor | None, cache_v: torch.Tensor | None, key: str,
                 max_len: int, method: str, iters: int, recent: int, hold: int,
                 check_finite: bool, release: bool) -> torch.Tensor:
    """``append_`` into the registry state ``key`` (allocated on first use for ``max_len``
    tokens); returns an empty token for the site's ``attention_keyed``.

    ``cache_k``/``cache_v``: the model's own cache tensors, which the graph no longer
    reads. A prompt a non-compiled forward wrote there is adopted first (see ``_adopt``);
    with ``release`` their storage is then freed (resized to 0 bytes, counted in the
    store), on every call that passes tensors that still hold storage.
    """
    from kvarn_compile import registry

    store, site = registry.resolve(key)
    state = store.for_append(site, k, max_len)
    if cache_k is not None and cache_v is not None:
        _adopt(state.buffers, cache_k, cache_v, start_pos, method, iters, recent, hold,
               check_finite, site, release)
    append_(state.buffers, k, v, start_pos, method, iters, recent, hold, check_finite, site)
    if release:
        for cache in (cache_k, cache_v):
            if cache is not None:
                store.released_bytes += registry.release_storage(cache)
    return k.new_empty((0,))


@append_keyed.register_fake
def _append_keyed_fake(k, v, start_pos, cache_k, cache_v, key, max_len, method, iters, recent,
                       hold, check_finite, release):
    return k.new_empty((0,))


@torch.library.custom_op("kvarn::attention_keyed", mutates_args=())
def attention_keyed(q: torch.Tensor, token: torch.Tensor, mask: torch.Tensor | None, key: str,
                    scale: float, causal: bool, window: int) -> torch.Tensor:
    """``attention`` over the registry state ``key``; ``token`` comes from its append."""
    from kvarn_compile import registry

    store, site = registry.resolve(key)
    state = store.for_attention(site, q.shape[0])
    return attention(q, state.buffers, mask, scale, causal, window)


@attention_keyed.register_fake
def _attention_keyed_fake(q, token, mask, key, scale, causal, window):
    return q.new_empty(q.shape)


# ------------------------------------------------------------------------------ beam reorder
def _row_order(rows: torch.Tensor, batch: int, name: str) -> torch.Tensor | None:
    """The batch-row order ``rows`` [B] (row tags of a cat-cache handle, see
    passes/rewrite.py) asks for, or None when it is the identity."""
    tags = rows.detach().float().reshape(-1).cpu()
    idx = tags.round().long()
    if tags.numel() != batch or not bool(torch.isfinite(tags).all()) \
            or not torch.equal(idx.float(), tags) or bool((idx < 0).any()) or bool((idx >= batch).any()):
        raise ValueError(
            f"KVarN {name}: the past keys passed to the compiled model are not the handle its "
            f"previous call returned (expected {batch} batch-row tags in [0, {batch}), got "
            f"{tags[:8].tolist()}). Pass the cache the compiled model returned, reordered along "
            "the batch only (beam search), or start a new cache.")
    if torch.equal(idx, torch.arange(batch)):
        return None
    return idx


def _reorder(buffers: list[torch.Tensor], rows: torch.Tensor, name: str) -> None:
    idx = _row_order(rows, buffers[0].shape[0], name)
    if idx is None:
        return
    for buf in buffers:
        buf.copy_(buf.index_select(0, idx.to(buf.device)))


@torch.library.custom_op("kvarn::reorder_", mutates_args=("buffers",))
def reorder_(buffers: list[torch.Tensor], rows: torch.Tensor, name: str) -> None:
    """Reorder the state's batch rows: row i becomes old row ``rows[i]`` (beam search).

    ``rows``: the per-row tags the compiled graph read from the past handle a cat cache
    handed back (each handle's row i holds i; ``index_select(0, beam_idx)`` on it gives
    ``beam_idx``). Identity tags do nothing; anything but row tags raises ValueError.
    """
    _reorder(buffers, rows, name)


@reorder_.register_fake
def _reorder_fake(buffers, rows, name):
    return None


@torch.library.custom_op("kvarn::reorder_keyed", mutates_args=())
def reorder_keyed(k: torch.Tensor, rows: torch.Tensor, key: str) -> torch.Tensor:
    """``reorder_`` of the registry state ``key`` (if allocated); returns a copy of ``k``
    that the site's ``append_keyed`` takes, which orders the append after the reorder."""
    from kvarn_compile import registry

    store, site = registry.resolve(key)
    state = store.states.get((site, k.shape[0]))
    if state is not None:
        _reorder(state.buffers, rows, site)
    return k.clone()


@reorder_keyed.register_fake
def _reorder_keyed_fake(k, rows, key):
    return torch.empty_like(k)
