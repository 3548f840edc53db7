"""Graph recording and normalization for the golden graph tests: production front-ends
render no graph text; a test records it with :func:`record_graphs`."""

from __future__ import annotations

from kvarn_compile.passes.graph_text import normalize_graph

__all__ = ["normalize_graph", "record_graphs"]

def record_graphs(frontend):
    """Record the normalized text of every graph ``frontend`` (a ``kvarn_backend`` or an
    ``inductor_pass`` object) rewrites from now on, as ``frontend.graph_log``: a list of
    (before, after) pairs. Returns ``frontend``. Production front-ends render no graph text."""
    frontend.graph_log = []
    pending = []

    def on_graph(stage, gm):
        if stage == "before":
            pending.append(normalize_graph(gm))
        else:
            frontend.graph_log.append((pending.pop(), normalize_graph(gm)))

    frontend.on_graph = on_graph
    return frontend
