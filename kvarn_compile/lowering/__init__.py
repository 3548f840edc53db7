"""Inductor lowerings of the KVarN ops: choices, autotuning, and a log of what was chosen.

    from kvarn_compile import lowering
    lowering.register()          # kvarn_backend(compiler="inductor") does this for you

``register()`` installs the lowering of ``torch.ops.kvarn.attention.default`` (and of the
internal ``kvarn::tile_partials_``, and of ``kvarn::positions_start`` for one position:
``lowering/positions.py``), and of ``kvarn::latent_attention`` with its internal
``kvarn::latent_tile_partials_`` (``lowering/latent.py``: on CUDA the split decomposition
with the ``kvarn_latent`` template; elsewhere the op's own kernel, one fallback call) in
``torch._inductor.lowering.user_lowerings``
and hooks the autotune feedback saver that records winners in
:data:`kvarn_compile.autotune.DB`. What each lowering offered and picked is appended to
:data:`DECISIONS` (the backend copies it into ``backend.report.notes``).

Paths of ``kvarn::attention`` (``lowering/attention.py``):

* ``reference``: the eager op as an extern kernel (``extern_kernels.kvarn_attention_reference``);
* ``dense``: a static-shape torch decomposition (``lowering/decompose.py``) that Inductor
  compiles (C++ on CPU, Triton on CUDA) and inlines;
* ``shared``: the same decomposition compiled once per input geometry as a graph of its
  own and called as an extern (``extern_kernels.kvarn_attention_shared``) by every site
  of that geometry, so a model's layers share one compile;
* ``split``: the same decomposition with the packed-tile region behind
  ``kvarn::tile_partials_``, whose lowering (``lowering/tiles.py``) autotunes the
  Triton template's configs (``templates/kvarn_decode.py.jinja``: split-K for decode,
  one split for multi-token shapes) against the standalone Triton kernel and the torch
  implementation.

``auto`` (default): on CUDA (static shapes) ``split`` autotuned against ``reference``, the
op's own kernel (the whole attention in one Triton launch); with the Triton templates on
CPU (tests) ``split``; on CPU ``reference`` (one extern call of the C++ kernel: the decode
step, or the multi-query kernel for a prefill chunk) where that kernel covers the shape;
else autotune ``reference`` against ``shared``. ``KVARN_LOWERING_PATH`` or
:func:`use_path` forces one. Shapes with symbolic sizes fall back to the op itself.

``kvarn::append_`` is deliberately not lowered: its work is data-dependent (one call in G
freezes a tile, the others only write the tail ring), it is a mutable op over the whole
buffer list that Inductor already calls in place (re-inplaced ``auto_functionalized``),
and its CUDA kernel (``kernels.quantize_tiles_into``) is launched by the op itself.
"""

from __future__ import annotations

import threading

import torch

from kvarn_compile import _torch_compat, ops  # noqa: F401  (ops: registers torch.ops.kvarn)
from kvarn_compile.lowering import attention, decisions, latent, positions, tiles
from kvarn_compile.lowering.decisions import (
    DECISIONS, PATHS, LoweringDecision, current_path, finish_decision, record_decision,
    spec_label, tune_key, use_path,
)

__all__ = ["register", "registered", "unregister", "DECISIONS", "LoweringDecision", "use_path",
           "current_path", "cache_salt", "PATHS", "record_decision", "finish_decision",
           "spec_label", "tune_key"]

_lock = threading.Lock()
_registered = False
_saver_added = False


def registered() -> bool:
    return _registered


def cache_salt() -> str:
    """Lowering state that changes generated code; part of kvarn's Inductor cache key
    (registered with ``_torch_compat.register_cache_salt`` at import)."""
    return decisions.cache_salt(_registered)


def register() -> None:
    """Install the kvarn lowerings and the autotune feedback saver (idempotent)."""
    global _registered, _saver_added
    with _lock:
        if _registered:
            return
        ind = _torch_compat.inductor()
        attention.externs()
        tiles.externs()
        latent.externs()
        ind.user_lowerings[torch.ops.kvarn.attention.default] = attention.lower_attention
        ind.user_lowerings[torch.ops.kvarn.tile_partials_.default] = tiles.lower_tile_partials
        ind.user_lowerings[torch.ops.kvarn.latent_attention.default] = latent.lower_latent_attention
        ind.user_lowerings[torch.ops.kvarn.latent_tile_partials_.default] = \
            latent.lower_latent_tile_partials
        ind.user_lowerings[torch.ops.kvarn.positions_start.default] = positions.lower_positions_start
        if not _saver_added:
            ind.add_feedback_saver(decisions.feedback_saver)
            _saver_added = True
        from kvarn_compile.autotune import DB

        DB.load_default()
        _torch_compat.tag_inductor_caches(_cache_tag())
        _registered = True


def unregister() -> None:
    """Remove the lowerings (the ops then compile as plain fallback calls). For tests."""
    global _registered
    with _lock:
        ind = _torch_compat.inductor()
        ind.user_lowerings.pop(torch.ops.kvarn.attention.default, None)
        ind.user_lowerings.pop(torch.ops.kvarn.tile_partials_.default, None)
        ind.user_lowerings.pop(torch.ops.kvarn.latent_attention.default, None)
        ind.user_lowerings.pop(torch.ops.kvarn.latent_tile_partials_.default, None)
        ind.user_lowerings.pop(torch.ops.kvarn.positions_start.default, None)
        _torch_compat.tag_inductor_caches(_cache_tag(), remove=True)
        _registered = False


def _cache_tag() -> str:
    """The Inductor cache tag of a process with the lowerings installed (see
    ``_torch_compat.tag_inductor_caches``)."""
    return f"kvarn-lowering-{_torch_compat.kvarn_sources_hash()[:16]}"


# The ExternKernelChoices are created now, at import: they are global objects found by
# name, and cached output code calls ``extern_kernels.<name>`` directly, so they must exist
# before any compiled graph that uses them can be loaded.
attention.externs()
tiles.externs()
latent.externs()
_torch_compat.register_cache_salt("lowering", cache_salt)
