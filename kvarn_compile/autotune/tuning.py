"""Knob tuning at run time: T per layer at its first tile (``kvarn_backend(tune_knobs=...)``)
and (G, T) per layer before allocation (:class:`kvarn_compile.hf.TunedKVarNCache`), under the rule of
:mod:`.knobs`.

Importing this module registers the kernels of ``kvarn::tune_observe_`` (declared in
``ops/library.py``), the observer op :class:`KnobTuner` inserts into rewritten graphs.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch

from kvarn_compile.autotune.knobs import RULE, Decision, QuantKnobs, Timer, select_quant_knobs
from kvarn_compile.config import KVarNConfig
from kvarn_compile.ops import library
from kvarn_compile.state import unpack

__all__ = ["KnobTuning", "KnobTuner", "first_tile_rows", "observe"]

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class KnobTuning:
    """Options of the quantization-knob tuning (``kvarn_backend(..., tune_knobs=...)``).

    ``iters``: the T candidates; ``group_sizes``: G candidates (only where G can still
    change: :class:`kvarn_compile.hf.TunedKVarNCache`; the backend tunes T only); ``tolerance``: the allowed
    relative error increase over the preset's setting; ``timer``: see select_quant_knobs.
    """

    tolerance: float = 0.05
    iters: tuple[int, ...] = (0, 1, 2, 4, 8, 16)
    group_sizes: tuple[int, ...] = ()
    timer: Timer | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.tolerance, (int, float)) and self.tolerance >= 0):
            raise ValueError(f"KnobTuning.tolerance: expected a number >= 0, but got {self.tolerance!r}.")
        if any(not isinstance(t, int) or t < 0 for t in self.iters):
            raise ValueError(f"KnobTuning.iters: expected ints >= 0, but got {self.iters!r}.")


_TUNERS: dict[str, "KnobTuner"] = {}


def observe(token: torch.Tensor, buffers: list[torch.Tensor], k: torch.Tensor,
            v: torch.Tensor, start_pos: torch.Tensor, tuner: str, site: str, recent: int,
            hold: int) -> None:
    """The kernel of ``kvarn::tune_observe_`` (CPU and CUDA): hand the full-precision rows
    of a layer's first tile to its tuner, once.

    Runs right before the layer's ``kvarn::append_`` and reads (never writes) the state;
    ``token`` is a one-element counter it bumps so the call is not dead code.
    """
    token.add_(1)
    t = _TUNERS.get(tuner)
    if t is None or t.decided(site):
        return
    rows = first_tile_rows(buffers, k, v, start_pos, recent, hold)
    if rows is not None:
        t.decide(site, *rows)


library.tune_observe_.register_kernel(("cpu", "cuda"))(observe)


def first_tile_rows(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                    start_pos: torch.Tensor, recent: int, hold: int
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The full-precision rows [B, H, G, D] of tile 0 if the coming append freezes it.

    Before the append, tokens [S, p0) of a row live in the tail ring (none frozen yet) and
    the new tokens are ``k``/``v``; tile 0 is frozen when, after the append, G committed
    tokens past the sink plus ``recent`` newer ones exist. Rows that do not freeze tile 0
    now are skipped; None when no row does.
    """
    f = unpack(buffers)
    tail_k, tail_v = f.tail_k, f.tail_v
    s, w = f.sink_k.shape[2], tail_k.shape[2]
    g = f.k.col_scale.shape[-1]
    n_max = f.k.codes.shape[2]
    if n_max == 0:
        return None
    committed, n_tiles = f.committed.tolist(), f.n_tiles.tolist()
    t = k.shape[2]
    ks, vs = [], []
    for row, p0 in enumerate(start_pos.tolist()):
        done, tiles = (0, 0) if p0 == 0 else (committed[row], n_tiles[row])
        if tiles:
            continue
        end = p0 + t
        committed_after = max(done, p0, end - max(hold, 0))
        if committed_after - s - recent < g:
            continue
        parts_k, parts_v = [], []
        pos = torch.arange(s, s + g, device=k.device)
        old = pos[pos < p0]                               # already in the tail ring
        if old.numel():
            slots = (old - s) % w
            parts_k.append(tail_k[row][:, slots].float())
            parts_v.append(tail_v[row][:, slots].float())
        new = pos[pos >= p0] - p0                         # from this write
        parts_k.append(k[row][:, new].to(tail_k.dtype).float())
        parts_v.append(v[row][:, new].to(tail_v.dtype).float())
        ks.append(torch.cat(parts_k, 1))
        vs.append(torch.cat(parts_v, 1))
    if not ks:
        return None
    return torch.stack(ks), torch.stack(vs)


class KnobTuner:
    """Chooses T per attention site (layer) of a :class:`~kvarn_compile.backend.KVarNBackend`.

    ``wrap`` instruments a rewritten graph: a ``kvarn::tune_observe_`` node before each
    undecided site's ``kvarn::append_``. When an observer sees the first tile of its site it
    runs :func:`select_quant_knobs` on those rows (candidates: ``options.iters`` at the
    preset's G). After the call that produced new decisions, the wrapper sets each decided
    site's ``iters`` argument, drops its observer and recompiles the graph (once per batch
    of decisions); graphs compiled later get the decided T directly and no observer.
    Graphs with symbolic shapes are not recompiled in place (their decisions apply from the
    next compile).
    """

    def __init__(self, config: KVarNConfig, options: KnobTuning):
        self.config = config
        self.options = options
        self.id = uuid.uuid4().hex
        self.decisions: dict[str, Decision] = {}
        self._lock = threading.Lock()
        self._version = 0
        _TUNERS[self.id] = self

    @property
    def active(self) -> bool:
        return self.config.method == "kvarn"

    def decided(self, site: str) -> bool:
        return site in self.decisions

    def iters_for(self, site: str) -> int | None:
        d = self.decisions.get(site)
        return None if d is None else d.chosen.iters

    def decide(self, site: str, k: torch.Tensor, v: torch.Tensor) -> Decision:
        cands = [QuantKnobs(self.config.group_size, t) for t in self.options.iters]
        decision = select_quant_knobs(k, v, self.config, cands, self.options.tolerance,
                                      self.options.timer)
        with self._lock:
            self.decisions[site] = decision
            self._version += 1
        log.info("kvarn knob tuning %s: %s", site, decision.summary())
        return decision

    def report_lines(self) -> list[str]:
        lines = [f"quant-knob rule: {RULE}; tolerance {self.options.tolerance:g}; T candidates "
                 f"{list(self.options.iters)}; G fixed at {self.config.group_size} (the packed "
                 "layout is allocated at compile time)"]
        for site in sorted(self.decisions):
            d = self.decisions[site]
            lines.append(f"quant knobs {site}: {d.summary()}")
            lines += [f"quant knobs {site}:   {c.line()}" for c in d.candidates]
        return lines

    # ------------------------------------------------------------------ graph plumbing
    def _sites(self, gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
        return [n for n in gm.graph.nodes
                if n.op == "call_function" and n.target is torch.ops.kvarn.append_.default]

    def prepare(self, gm: torch.fx.GraphModule) -> bool:
        """Apply known decisions and add observers; True when any observer was added."""
        appends = self._sites(gm)
        token_ph = next((n for n in gm.graph.nodes if n.op == "placeholder"
                         and n.name == "kvarn_tune_token"), None)
        observed = False
        for node in appends:
            site = node.args[9]
            iters = self.iters_for(site)
            if iters is not None:
                node.update_arg(5, iters)
            observers = [u for u in node.args[0][0].users if u.op == "call_function"
                         and u.target is torch.ops.kvarn.tune_observe_.default
                         and u.args[6] == site]
            if iters is not None or not self.active:
                for o in observers:
                    gm.graph.erase_node(o)
                continue
            observed = True
            if observers:
                continue
            if token_ph is None:
                last_ph = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
                with gm.graph.inserting_after(last_ph):
                    token_ph = gm.graph.placeholder("kvarn_tune_token")
                    token_ph.meta["example_value"] = torch.zeros(1, dtype=torch.int64)
            bufs, k, v, start = node.args[:4]
            with gm.graph.inserting_before(node):
                gm.graph.call_function(torch.ops.kvarn.tune_observe_.default,
                                       (token_ph, bufs, k, v, start, self.id, site,
                                        node.args[6], node.args[7]))
        if token_ph is not None and not token_ph.users:
            gm.graph.erase_node(token_ph)
        gm.recompile()
        return observed

    def wrap(self, gm: torch.fx.GraphModule, inputs: list[Any],
             compile_fn: Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]],
             report_notes: list[str]) -> Callable[..., Any]:
        """Compile ``gm`` with observers; return a callable taking the graph's inputs.

        ``inputs`` are the example inputs of ``gm`` (the state buffers included);
        ``compile_fn(gm, inputs)`` compiles it. The token tensor is appended here.
        """
        token = torch.zeros(1, dtype=torch.int64, device=_device_of(inputs))
        observed = self.prepare(gm)
        state = {"compiled": compile_fn(gm, inputs + ([token] if observed else [])),
                 "observed": observed, "version": self._version}
        symbolic = any(isinstance(x, torch.SymInt) for x in inputs) or any(
            isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape)
            for x in inputs)
        lock = threading.Lock()

        def run(*args: Any) -> Any:
            out = state["compiled"](*args, *([token] if state["observed"] else []))
            if state["observed"] and self._version != state["version"] and not symbolic:
                with lock:
                    if self._version != state["version"]:
                        state["version"] = self._version
                        observed_now = self.prepare(gm)
                        state["compiled"] = compile_fn(gm, list(args) + ([token] if observed_now else []))
                        state["observed"] = observed_now
                        _sync_notes(report_notes, self.report_lines())
            return out

        _sync_notes(report_notes, self.report_lines())
        return run


def _device_of(inputs: list[Any]) -> torch.device:
    for x in inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _sync_notes(notes: list[str], lines: list[str]) -> None:
    """Replace the knob-tuning lines of a report's notes with ``lines``."""
    notes[:] = [n for n in notes if not n.startswith(("quant-knob rule:", "quant knobs "))]
    notes.extend(lines)
