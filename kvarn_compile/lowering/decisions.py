"""What the kvarn lowerings offered and chose: the decision log, the forced path, the tune key.

Every lowering of a kvarn op appends a :class:`LoweringDecision` to :data:`DECISIONS`
(the choices offered, whether they were replayed from the autotune database, and, once
Inductor has benchmarked them, the winner and the timings, filled in by the feedback
saver). :func:`use_path` / ``KVARN_LOWERING_PATH`` force a lowering path of
``kvarn::attention``; :func:`cache_salt` is the part of that state that changes generated
code (it is part of kvarn's Inductor cache key).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["DECISIONS", "LoweringDecision", "PATHS", "use_path", "current_path", "cache_salt",
           "tune_key", "record_decision", "finish_decision", "feedback_saver", "spec_label", "Offers"]

PATHS = ("auto", "reference", "dense", "shared", "split")
_state = threading.local()
_lock = threading.Lock()


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
        """One readable line (messages, benchmark JSON); the report summarizes the records
        themselves (:func:`kvarn_compile.report.summarize_lowerings`)."""
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


def cache_salt(registered: bool) -> str:
    """Lowering state that changes generated code; part of kvarn's Inductor cache key."""
    return f"lowering={'on' if registered else 'off'};path={current_path()}"


def tune_key(op: str, *, q, k_codes, k_col_scale, v_codes, row_scale, v_col_scale=None):
    """The autotune key of a lowering from its IR inputs, or None for symbolic shapes
    (``v_col_scale`` [.., Dv] gives the values' head dim; without it, the queries')."""
    from kvarn_compile._torch_compat import device_identity, static_ints
    from kvarn_compile.autotune import TuneKey, preset_name
    from kvarn_compile.lowering.heuristics import length_bucket, query_bucket

    qs, kc = static_ints(q.get_size()), static_ints(k_codes.get_size())
    group = static_ints(k_col_scale.get_size()[-1:])
    vrow = static_ints(v_codes.get_size()[-1:])
    dvs = static_ints(v_col_scale.get_size()[-1:]) if v_col_scale is not None else None
    if qs is None or kc is None or group is None or vrow is None \
            or (v_col_scale is not None and dvs is None):
        return None
    b, hq, tq, d = qs
    dv = d if dvs is None else dvs[0]
    g = group[0]
    kb, vb = 8 * kc[-1] // g, 8 * vrow[0] // dv
    name, cap = device_identity(q.get_device())
    return TuneKey(op=op, device=name, capability=cap, dtype=str(q.get_dtype()),
                   preset=preset_name(kb, vb, g, row_scale.get_dtype()), head_dim=d,
                   kv_heads=kc[1], q_heads=hq, batch=b, query=query_bucket(hq, kc[1], tq),
                   length_bucket=length_bucket(kc[2] * g), value_head_dim=0 if dv == d else dv)


class Offers:
    """The choices one lowering offers ``select_algorithm``, each tagged with its spec (what
    the autotune database keeps of a winner: ``{"choice": ..., "config": ...}``). With a
    winner replayed from the database (``replay``) only that spec is built."""

    def __init__(self, replay: dict | None) -> None:
        self.replay = replay
        self.choices: list = []

    def offer(self, spec: dict, make: Callable[[], None]) -> None:
        """Build the choices of ``spec`` (``make`` appends them to :attr:`choices`), unless
        another spec is being replayed."""
        if self.replay is not None and spec != self.replay:
            return
        before = len(self.choices)
        make()
        for c in self.choices[before:]:
            c.kvarn_spec = spec

    def or_else(self, spec: dict, make: Callable[[], None]) -> None:
        """Nothing offered (a replayed winner that cannot be built here): benchmark afresh,
        offering ``spec``."""
        if not self.choices:
            self.replay = None
            self.offer(spec, make)

    def select(self, op: str, key, inputs: list, layout, input_gen_fns) -> Any:
        """Inductor's ``select_algorithm`` over the choices offered, logged as a
        :class:`LoweringDecision` with its winner: the chosen node."""
        from kvarn_compile._torch_compat import inductor

        decision = record_decision(op, key, self.choices, inputs, replayed=self.replay is not None)
        node, choice = inductor().select_algorithm(op, self.choices, inputs, layout,
                                                   input_gen_fns=input_gen_fns)
        finish_decision(decision, choice)
        return node


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
    if choice is not None:       # None: Inductor did not say (the feedback set the winner)
        decision.winner = spec_label(getattr(choice, "kvarn_spec",
                                             {"choice": getattr(choice, "name", "?")}))
    with _lock:
        for k in [k for k, v in _PENDING.items() if v is decision]:
            del _PENDING[k]


def feedback_saver(timings, name, input_nodes, choices, profiled_time_fn, precompile_times):
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


