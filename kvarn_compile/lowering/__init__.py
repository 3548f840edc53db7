"""Inductor lowerings of the KVarN ops: choices, autotuning, and a log of what was chosen.

    from kvarn_compile import lowering
    lowering.register()          # kvarn_backend(compiler="inductor") does this for you

``register()`` installs the lowering of ``torch.ops.kvarn.attention.default`` (and of the
internal ``kvarn_lowering::tile_partials_``) in ``torch._inductor.lowering.user_lowerings``
and hooks the autotune feedback saver that records winners in
:data:`kvarn_compile.autotune.DB`. What each lowering offered and picked is appended to
:data:`DECISIONS` (the backend copies it into ``backend.report.notes``).

Paths of ``kvarn::attention`` (``lowering/attention.py``):

* ``reference``: the eager op as an extern kernel (``extern_kernels.kvarn_attention_reference``);
* ``dense``: a static-shape torch decomposition (``lowering/decompose.py``) that Inductor
  compiles (C++ on CPU, Triton on CUDA) and inlines;
* ``split``: the same decomposition with the packed-tile region behind
  ``kvarn_lowering::tile_partials_``, whose lowering (``lowering/tiles.py``) autotunes the
  Triton templates (``templates/kvarn_decode.py.jinja``, ``kvarn_prefill.py.jinja``)
  against the standalone Triton kernel and the torch implementation.

``auto`` (default): ``split`` where templates can run (CUDA, static shapes, supported
format), else autotune ``reference`` against ``dense``. ``KVARN_LOWERING_PATH`` or
:func:`use_path` forces one. Shapes with symbolic sizes fall back to the op itself.

``kvarn::append_`` is deliberately not lowered: its work is data-dependent (one call in G
freezes a tile, the others only write the tail ring), it is a mutable op over the whole
buffer list that Inductor already calls in place (re-inplaced ``auto_functionalized``),
and its CUDA kernel (``kernels.quantize_tiles_into``) is launched by the op itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from typing import Any

import torch

__all__ = ["register", "registered", "DECISIONS", "LoweringDecision", "use_path", "current_path",
           "cache_salt", "PATHS"]

PATHS = ("auto", "reference", "dense", "split")
_state = threading.local()
_lock = threading.Lock()
_registered = False
_saver_added = False


@dataclasses.dataclass
class LoweringDecision:
    """One lowering of a kvarn op: the choices offered and the one that won."""

    op: str
    key: str
    offered: list[str]
    replayed: bool
    winner: str = ""
    timings_ms: dict[str, float] = dataclasses.field(default_factory=dict)

    def line(self) -> str:
        how = ("replayed from the autotune DB (no benchmark)" if self.replayed else
               "benchmarked" if len(self.offered) > 1 else "single choice")
        t = ", ".join(f"{k} {v:.4f} ms" for k, v in sorted(self.timings_ms.items(),
                                                            key=lambda kv: kv[1]))
        return (f"lowering {self.op}: {self.winner or '?'} of {len(self.offered)} choice(s) "
                f"[{', '.join(self.offered[:6])}{', ...' if len(self.offered) > 6 else ''}], {how}"
                + (f"; {t}" if t else "") + f" [{self.key}]")


#: Every lowering decision of this process, in order.
DECISIONS: list[LoweringDecision] = []
_PENDING: dict[tuple[str, tuple[str, ...]], LoweringDecision] = {}


def spec_label(spec: dict[str, Any]) -> str:
    cfg = spec.get("config")
    if not cfg:
        return spec["choice"]
    return spec["choice"] + "[" + ",".join(f"{k}={v}" for k, v in cfg.items()) + "]"


def current_path() -> str:
    path = getattr(_state, "path", None) or os.environ.get("KVARN_LOWERING_PATH", "auto")
    if path not in PATHS:
        raise ValueError(f"Expected KVARN_LOWERING_PATH in {PATHS}, but got {path!r}.")
    return path


@contextlib.contextmanager
def use_path(path: str):
    """Force the lowering path of ``kvarn::attention`` in this thread (tests, benchmarks)."""
    if path not in PATHS:
        raise ValueError(f"Expected a lowering path in {PATHS}, but got {path!r}.")
    old = getattr(_state, "path", None)
    _state.path = path
    try:
        yield
    finally:
        _state.path = old


def cache_salt() -> str:
    """Lowering state that changes generated code; part of kvarn's Inductor cache key."""
    return f"lowering={'on' if _registered else 'off'};path={current_path()}"


def registered() -> bool:
    return _registered


def tune_key(op: str, *, q, k_codes, k_col_scale, v_codes, row_scale):
    """The autotune key of a lowering from its IR inputs, or None for symbolic shapes."""
    from kvarn_compile._torch_compat import device_identity, static_ints
    from kvarn_compile.autotune import TuneKey, preset_name
    from kvarn_compile.lowering.heuristics import length_bucket, query_bucket

    qs, kc = static_ints(q.get_size()), static_ints(k_codes.get_size())
    group = static_ints(k_col_scale.get_size()[-1:])
    vrow = static_ints(v_codes.get_size()[-1:])
    if qs is None or kc is None or group is None or vrow is None:
        return None
    b, hq, tq, d = qs
    g = group[0]
    kb, vb = 8 * kc[-1] // g, 8 * vrow[0] // d
    name, cap = device_identity(q.get_device())
    return TuneKey(op=op, device=name, capability=cap, dtype=str(q.get_dtype()),
                   preset=preset_name(kb, vb, g, row_scale.get_dtype()), head_dim=d,
                   kv_heads=kc[1], q_heads=hq, batch=b, query=query_bucket(hq, kc[1], tq),
                   length_bucket=length_bucket(kc[2] * g))


def record_decision(op: str, key, choices: list, inputs: list, replayed: bool) -> LoweringDecision:
    """Log a lowering about to autotune; the feedback saver fills in the timings."""
    decision = LoweringDecision(op, key.text() if key is not None else "symbolic",
                                [spec_label(getattr(c, "kvarn_spec", {"choice": c.name}))
                                 for c in choices], replayed)
    decision._key = key  # type: ignore[attr-defined]
    with _lock:
        DECISIONS.append(decision)
        _PENDING[(op, tuple(n.get_name() for n in inputs))] = decision
    return decision


def finish_decision(decision: LoweringDecision, choice: Any) -> None:
    """Set the winner (the choice the lowering actually emits) and drop the pending entry."""
    decision.winner = spec_label(getattr(choice, "kvarn_spec", {"choice": getattr(choice, "name", "?")}))
    with _lock:
        for k in [k for k, v in _PENDING.items() if v is decision]:
            del _PENDING[k]


def _feedback_saver(timings, name, input_nodes, choices, profiled_time_fn, precompile_times):
    """Inductor feedback hook: record the winner of a kvarn benchmark in the autotune DB."""
    if not name.startswith("kvarn_"):
        return
    from kvarn_compile.autotune import DB

    with _lock:
        decision = _PENDING.pop((name, tuple(n.get_name() for n in input_nodes)), None)
    finite = {c: t for c, t in timings.items() if t == t and t != float("inf")}
    if decision is None or not finite:
        return
    best = min(finite, key=finite.get)
    spec = getattr(best, "kvarn_spec", None)
    decision.timings_ms = {spec_label(getattr(c, "kvarn_spec", {"choice": c.name})): float(t)
                           for c, t in finite.items()}
    decision.winner = spec_label(spec) if spec else best.name
    key = getattr(decision, "_key", None)
    if spec is not None and key is not None:
        DB.record(key, spec, decision.timings_ms)


def register() -> None:
    """Install the kvarn lowerings and the autotune feedback saver (idempotent)."""
    global _registered, _saver_added
    with _lock:
        if _registered:
            return
        from kvarn_compile import ops  # noqa: F401  (torch.ops.kvarn)
        from kvarn_compile._torch_compat import inductor
        from kvarn_compile.lowering import attention, tiles

        ind = inductor()
        attention.externs()
        tiles._externs()
        ind.user_lowerings[torch.ops.kvarn.attention.default] = attention.lower_attention
        ind.user_lowerings[torch.ops.kvarn_lowering.tile_partials_.default] = tiles.lower_tile_partials
        if not _saver_added:
            ind.add_feedback_saver(_feedback_saver)
            _saver_added = True
        from kvarn_compile.autotune import DB

        DB.load_default()
        _registered = True


def unregister() -> None:
    """Remove the lowerings (the ops then compile as plain fallback calls). For tests."""
    global _registered
    from kvarn_compile._torch_compat import inductor

    with _lock:
        ind = inductor()
        ind.user_lowerings.pop(torch.ops.kvarn.attention.default, None)
        from kvarn_compile.lowering import tiles  # noqa: F401

        ind.user_lowerings.pop(torch.ops.kvarn_lowering.tile_partials_.default, None)
        _registered = False


def _create_externs() -> None:
    """Create the ExternKernelChoices now, at import: they are global objects found by name,
    and cached output code calls ``extern_kernels.<name>`` directly, so they must exist
    before any compiled graph that uses them can be loaded."""
    from kvarn_compile.lowering import attention, tiles

    attention.externs()
    tiles._externs()


_create_externs()
