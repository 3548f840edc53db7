"""KVarN as an Inductor pre-grad custom pass, for models compiled with ``backend="inductor"``.

    kv = kvarn_compile.inductor_pass(preset="k4v2")
    model.compile(options={"pre_grad_custom_pass": kv})     # the default Inductor backend
    out = model.generate(ids, max_new_tokens=256)
    print(kv.report, kv.nbytes)

The same pattern tables and rewrite as :func:`kvarn_compile.kvarn_backend`, in *keyed* mode:
a pre-grad pass runs inside Inductor after Dynamo's graph inputs are fixed, so it cannot
add the packed states as graph inputs. The rewritten graph calls
``kvarn::append_keyed`` / ``kvarn::attention_keyed`` with a constant key instead; the ops
find (and on the first append allocate) the state in :mod:`kvarn_compile.ops.keyed`. The
append returns an empty token that the attention takes, so nothing is dead-code
eliminated or reordered. Model-owned preallocated cache buffers the graph no longer
reads are passed to ``kvarn::append_keyed``, which first adopts a prompt an uncompiled
forward wrote there (transformers' eager prefill under ``generate(compile_config=...)``)
and then frees them, on every call (so a second transformers ``StaticCache`` is freed too).
Not supported here: ``tune_knobs`` (use ``kvarn_backend``).

Caching: ``uuid()`` hashes every kvarn source, the configuration and this object's
store namespace, so Inductor's FX-graph/AOT caches never hand one pass object's graph to
another (whose states live elsewhere). A graph served from the cache to the *same* pass
object (e.g. after ``torch._dynamo.reset()``) skips the pass, and is then not counted
again in the report; the cached graph still runs on this object's states.

Unlike ``kvarn_backend``, the keyed ops reach Inductor as plain fallback calls: the
kvarn lowerings (templates, autotuning) do not apply; on CPU and CUDA the ops run the
same kernels as in eager mode.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from kvarn_compile import ops as _ops  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile._torch_compat import custom_graph_pass_base, kvarn_sources_hash
from kvarn_compile.config import KVarNConfig, KVarNOptions, get_config, options_from
from kvarn_compile.ops.keyed import StateStore
from kvarn_compile.report import Report, rewrite_context, run_rewrite
from kvarn_compile.state import LayerState, allocate_layer

__all__ = ["KVarNInductorPass", "inductor_pass"]

class KVarNInductorPass(custom_graph_pass_base()):
    """An Inductor ``pre_grad_custom_pass`` (see :func:`inductor_pass`). Thread-safe."""

    def __init__(self, config: KVarNConfig, options: KVarNOptions | None = None) -> None:
        self.config = config
        self.options = options or KVarNOptions()
        #: the packed states, found by the compiled graphs through kvarn_compile.ops.keyed
        self.store = StateStore(config, spec_tokens=self.spec_tokens)
        self.report = Report(released_bytes=lambda: self.store.released_bytes)
        #: ``on_graph(stage, gm)``, stage "before"/"after" the rewrite: a test's graph recorder
        #: (:func:`kvarn_compile.testing.record_graphs`); None in production
        self.on_graph: Callable[[str, fx.GraphModule], None] | None = None
        self._rewritten_sites: set[str] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ CustomGraphPass
    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        if gm is None:      # a bare graph: wrap it so that rewrite_graph can recompile
            gm = fx.GraphModule(torch.nn.Module(), graph)
        with self._lock:
            ctx = rewrite_context(self, get_state=self._size_state, state_key=self.store.key)
            _, reports = run_rewrite(self, gm, gm, [], ctx, what="pre-grad graph",
                                     seen=self._rewritten_sites)
        if any(r.rewritten for r in reports):
            from kvarn_compile._torch_compat import refuse_eager_fallback

            refuse_eager_fallback()      # the model's caches are released: never uncompiled

    def uuid(self) -> Any:
        c = self.config
        return (f"kvarn-pre-grad;{kvarn_sources_hash()};{self.store.namespace};{c!r};"
                f"max_cache_len={self.max_cache_len};release={self.release_buffers};"
                f"spec={self.spec_tokens}")

    # ------------------------------------------------------------------ states
    def _size_state(self, name: str, *, batch: int, kv_heads: int, head_dim: int, max_len: int,
                    dtype: torch.dtype, device: torch.device, tokens: Any = None,
                    fresh: bool = False, value_head_dim: int | None = None) -> LayerState:
        # the report's state size; the real state is allocated by the first append (a cat
        # cache's grows with the sequence: sized here for this graph's tokens when known)
        grow_from = None if tokens is None else tokens if isinstance(tokens, int) else 0
        return allocate_layer(self.config, batch=batch, kv_heads=kv_heads, head_dim=head_dim,
                              max_len=max_len, dtype=dtype, device="meta",
                              spec_tokens=self.spec_tokens, name=name, grow_from=grow_from,
                              value_head_dim=value_head_dim)

    max_cache_len = property(lambda self: self.options.max_cache_len)
    release_buffers = property(lambda self: self.options.release_buffers)
    spec_tokens = property(lambda self: self.options.spec_tokens)

    @property
    def states(self) -> dict[tuple[str, int], LayerState]:
        """The live packed states, keyed by (site name, batch size)."""
        return self.store.states

    @property
    def nbytes(self) -> int:
        """Bytes held by all packed states allocated so far (live tensors)."""
        return self.store.nbytes

    def reset(self) -> None:
        """Forget every sequence (the states stay allocated)."""
        self.store.reset()

    def close(self) -> None:
        """Free every packed state; graphs compiled with this pass then stop with an error."""
        self.store.close()

    def __deepcopy__(self, memo: dict) -> "KVarNInductorPass":
        return self           # copies must keep using the same states

    def __repr__(self) -> str:
        return f"KVarNInductorPass({self.config.short()}, {self.store.namespace})"


def inductor_pass(preset: str | KVarNConfig = "k4v2", *, max_cache_len: int | None = None,
                  release_buffers: bool | None = None, spec_tokens: int | None = None,
                  options: KVarNOptions | None = None, **config_overrides: Any) -> KVarNInductorPass:
    """KVarN as an Inductor pre-grad pass: ``options={"pre_grad_custom_pass": inductor_pass()}``.

    Same arguments as :func:`kvarn_compile.kvarn_backend` (``preset`` or a
    :class:`KVarNConfig`, ``**config_overrides``, and the front-end options
    ``max_cache_len``, ``release_buffers``, ``spec_tokens`` or ``options=KVarNOptions(...)``).
    ``.report`` lists every attention site seen, ``.nbytes`` the bytes of the packed states.
    """
    opts = options_from(options, max_cache_len=max_cache_len, release_buffers=release_buffers,
                        spec_tokens=spec_tokens)
    return KVarNInductorPass(get_config(preset, **config_overrides), opts)
