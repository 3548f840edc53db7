"""What a front-end did to the graphs it saw: the report of ``kvarn_backend`` and ``inductor_pass``.

One :class:`Report` per front-end object: every attention site of every graph (rewritten,
or left unchanged and why), the bytes of the packed states and of the released model
buffers, free-text notes, and the lowering decisions (structured
:class:`~kvarn_compile.lowering.decisions.LoweringDecision` records, summarized once per op
and shape bucket when printed). Counts go to ``torch._dynamo.utils.counters["kvarn"]``
(``sites_rewritten``, ``sites_unchanged``, ``lowering:<op>:<winner>``) as Inductor's own
passes count theirs. :func:`run_rewrite` is the step both front-ends take for one graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch._dynamo.utils import counters

from kvarn_compile.lowering.decisions import LoweringDecision
from kvarn_compile.passes.rewrite import RewriteContext, SiteReport, rewrite_graph

__all__ = ["Report", "summarize_lowerings", "log_graph", "check_consistent", "run_rewrite",
           "rewrite_context"]

log = logging.getLogger("kvarn_compile.backend")


def log_graph(msg: str, graph_id: int, gm: fx.GraphModule) -> None:
    """A graph before/after the rewrite, at DEBUG (``msg`` takes the graph's number and its
    readable code, which is only generated when the level is on).

    ``TORCH_LOGS="+kvarn_compile"`` turns it on through torch._logging (torch parses
    TORCH_LOGS when it is imported, before a third-party artifact could be registered, so
    the variable names the module); ``torch._logging.set_logs(modules={"kvarn_compile":
    logging.DEBUG})`` does the same in-process.
    """
    if log.isEnabledFor(logging.DEBUG):
        log.debug(msg, graph_id, gm.print_readable(print_output=False))


class Report:
    """Every attention site seen by a front-end, over all the graphs it compiled.

    ``str(report)`` lists the sites per graph, the bytes of the packed states (in use and
    allocated, when the front-end passes ``states``) and of the released model buffers,
    the notes, then the lowering decisions summarized once per op and shape bucket: how
    many sites, which choice won, the range of each choice's timings.
    """

    def __init__(self, released_bytes: Callable[[], int] | None = None,
                 states: Callable[[], Any] | None = None) -> None:
        self.sites: list[SiteReport] = []
        self.graphs = 0
        #: free-text notes (ignored modes, kept buffers, knob-tuning decisions)
        self.notes: list[str] = []
        #: the lowering decisions of the graphs this front-end compiled, in order
        self.lowerings: list[LoweringDecision] = []
        self._released_elsewhere = released_bytes
        self._states = states

    @property
    def released_bytes(self) -> int:
        """Bytes of model-owned full-precision K/V buffers freed so far (they are freed when
        the compiled graphs run; a second StaticCache adds its own bytes)."""
        extra = self._released_elsewhere() if self._released_elsewhere else 0
        return sum(s.released_bytes for s in self.sites) + extra

    @property
    def rewritten(self) -> list[SiteReport]:
        return [s for s in self.sites if s.rewritten]

    @property
    def unchanged(self) -> list[SiteReport]:
        return [s for s in self.sites if not s.rewritten]

    def add_sites(self, reports: list[SiteReport]) -> None:
        self.sites.extend(reports)
        for r in reports:
            counters["kvarn"]["sites_rewritten" if r.rewritten else "sites_unchanged"] += 1
            log.info("kvarn: %s", r.line().strip())

    def add_lowerings(self, decisions: list[LoweringDecision]) -> None:
        self.lowerings.extend(decisions)
        for d in decisions:
            counters["kvarn"][f"lowering:{d.op}:{d.winner or '?'}"] += 1

    def note(self, text: str) -> None:
        """Add a note once."""
        if text not in self.notes:
            self.notes.append(text)

    def state_bytes(self) -> dict[str, int] | None:
        """``{"used": ..., "allocated": ...}`` bytes of the packed states (None: not known)."""
        if self._states is None:
            return None
        states = list(self._states())
        return {"used": sum(sum(s.used_bytes().values()) for s in states),
                "allocated": sum(s.nbytes for s in states)}

    def __str__(self) -> str:
        lines = [f"KVarN rewrite report: {len(self.rewritten)} attention site(s) rewritten, "
                 f"{len(self.unchanged)} left unchanged, in {self.graphs} graph(s)"]
        for graph in range(1, self.graphs + 1):
            sites = [s for s in self.sites if s.graph == graph]
            if sites:
                lines.append(f" graph {graph}:")
                lines.extend(s.line() for s in sites)
        held = self.state_bytes()
        if held and held["allocated"]:
            lines.append(f" packed KV states: {_mib(held['used'])} in use (tokens held), "
                         f"{_mib(held['allocated'])} allocated (capacity)")
        if self.released_bytes:
            lines.append(f" released {self.released_bytes} bytes ({_mib(self.released_bytes)}) of "
                         "model-owned full-precision K/V buffers")
        lines.extend(f" note: {n}" for n in self.notes)
        lines.extend(f" note: {n}" for n in summarize_lowerings(self.lowerings))
        return "\n".join(lines)

    __repr__ = __str__


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _how(d: LoweringDecision) -> str:
    return "replayed" if d.replayed else "benchmarked" if len(d.offered) > 1 else "single choice"


def summarize_lowerings(decisions: list[LoweringDecision]) -> list[str]:
    """One line per (op, autotune key): how many lowerings, the winners, how they were
    chosen and each choice's timing range, in order of first appearance."""
    groups: dict[tuple[str, str], list[LoweringDecision]] = {}
    for d in decisions:
        groups.setdefault((d.op, d.key), []).append(d)
    out = []
    for (op, key), group in groups.items():
        fields = dict(part.split("=", 1) for part in key.split("|") if "=" in part)
        bucket = " ".join(f"{k}={fields.pop(k)}" for k in ("query", "length_bucket") if k in fields)
        fields.pop("op", None)
        rest = " ".join(f"{k}={v}" for k, v in fields.items()) if fields else key
        winners: dict[str, int] = {}
        hows: dict[str, int] = {}
        ms: dict[str, list[float]] = {}
        for d in group:
            winners[d.winner or "?"] = winners.get(d.winner or "?", 0) + 1
            hows[_how(d)] = hows.get(_how(d), 0) + 1
            for name, t in d.timings_ms.items():
                ms.setdefault(name, []).append(t)
        won = ", ".join(f"{w} x{n}" if len(winners) > 1 else w
                        for w, n in sorted(winners.items(), key=lambda kv: -kv[1]))
        how = ", ".join(f"{h} x{n}" if len(group) > 1 else h for h, n in hows.items())
        times = ", ".join(f"{name} {min(v):.3g}-{max(v):.3g} ms" if min(v) != max(v)
                          else f"{name} {v[0]:.3g} ms"
                          for name, v in sorted(ms.items(), key=lambda kv: min(kv[1])))
        out.append(f"lowering {op} at {len(group)} site(s), {bucket or 'bucket ' + key}: "
                   f"{won} ({how}){'; ' + times if times else ''} [{rest}]")
    return out


def check_consistent(seen: set[str], reports: list[SiteReport]) -> None:
    """Refuse a graph that leaves unchanged a site an earlier graph rewrote.

    A transformers static sliding-window layer is written with ``index_copy_`` (it looks
    like a full-attention cache and is rewritten) until its window fills, then with roll +
    copy_ (refused): its tokens would then live in two places. Stop with a clear error
    instead of computing on a cache that lost them. ``seen``: names rewritten so far.
    """
    for r in reports:
        if r.rewritten:
            seen.add(r.name)
        elif r.name in seen:
            raise RuntimeError(
                f"kvarn_backend: attention site {r.name} was rewritten in an earlier graph but "
                f"is left unchanged now ({r.reason}); its KV cache would be split between the "
                "packed state and the model's buffers. This happens with a cache that stops "
                "growing with the queries: a sliding-window layer once its window fills, or a "
                "cross-attention cache whose encoder length equals the first decoder chunk. "
                "Such layers are not supported; compile a model whose sliding layers keep a "
                "full cache, or pass release_buffers=False and leave such models uncompiled.")


def rewrite_context(frontend: Any, **kw: Any) -> RewriteContext:
    """The :class:`RewriteContext` of a front-end: its config's method and knobs and its
    :class:`~kvarn_compile.config.KVarNOptions`, plus the front-end's own ``kw``."""
    c, o = frontend.config, frontend.options
    return RewriteContext(method=c.op_method, iters=c.sinkhorn_iters, recent=c.recent_window,
                          hold=o.spec_tokens, check_finite=c.check_finite,
                          max_cache_len=o.max_cache_len, release_buffers=o.release_buffers, **kw)


def run_rewrite(frontend: Any, original: fx.GraphModule, gm: fx.GraphModule,
                example_inputs: list[Any], ctx: RewriteContext, *, what: str, seen: set[str] | None,
                rename: Callable[[str], str] = str,
                finish: Callable[[list[Any]], None] | None = None
                ) -> tuple[list[Any], list[SiteReport]]:
    """The KVarN pass over one graph ``gm`` (in place; ``original`` is the graph as the
    front-end got it), as a front-end runs it: numbered in ``frontend.report``, logged
    before and after, its site names ``rename``d, ``finish(extra)`` applied to the rewritten
    graph, refused when it splits a cache an earlier graph packed (:func:`check_consistent`,
    ``seen``: the keyed front-end; ``kvarn_backend`` passes None and enforces it per cache at
    run time, :mod:`kvarn_compile.cache_book`), its sites added to the report, and ``frontend.on_graph(stage, gm)`` called
    before and after when set (graph recording is a test's job:
    :func:`kvarn_compile.testing.record_graphs`). Returns the rewrite's extra graph inputs
    and the site reports."""
    report: Report = frontend.report
    report.graphs += 1
    graph_id = report.graphs
    hook = getattr(frontend, "on_graph", None)
    if hook is not None:
        hook("before", original)
    log_graph(f"kvarn {what} %d before rewrite:\n%s", graph_id, original)
    extra, reports = rewrite_graph(gm, example_inputs, ctx, graph_id)
    for r in reports:
        r.name = rename(r.name)
    if finish is not None:
        finish(extra)
    if seen is not None:
        check_consistent(seen, reports)
    report.add_sites(reports)
    if hook is not None:
        hook("after", gm)
    log_graph(f"kvarn {what} %d after rewrite:\n%s", graph_id, gm)
    return extra, reports
