"""``kvarn_backend``: the torch.compile backend that puts every attention's KV cache in KVarN.

    model.compile(backend=kvarn_backend(preset="k4v2"))      # or torch.compile(fn, backend=...)

For each graph Dynamo hands over, the backend copies it, runs the KVarN pass
(:mod:`kvarn_compile.passes`), gives every rewritten attention site a packed
:class:`~kvarn_compile.state.LayerState` (shared by all graphs of the same model, keyed by
the attention module's path and the batch size; a second model compiled with the same
backend gets its own states), appends the states' buffers as extra
graph inputs and compiles the result with Inductor (or runs it eagerly with
``compiler="eager"``). After every call it frees the model's own preallocated K/V buffers
that the graph no longer uses. ``backend.report`` says what was rewritten, what was not and
why. For ``backend="inductor"`` the same pass runs as an Inductor pre-grad pass:
:func:`kvarn_compile.inductor_pass` (:mod:`kvarn_compile.pre_grad_pass`).
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from collections.abc import Callable
from typing import Any

import operator

import torch
import torch.fx as fx

from kvarn_compile import ops as _ops  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile._torch_compat import lazy_graph_module, plain_tensor_functions as _internal, \
    refuse_eager_fallback
from kvarn_compile.cache_book import CacheBook, CallMemo, _Site, plain_inputs
from kvarn_compile.config import LATENT_ROPE_BITS, KVarNConfig, KVarNOptions, get_config, options_from
from kvarn_compile.ops.buffers import (
    claim, mark_seen, releasable, release_storage, untouched_since_release,
)
from kvarn_compile.ops.dispatch import cuda_checks_deferred, deferred_checks, prepare_device
from kvarn_compile.report import Report, rewrite_context, run_rewrite
from kvarn_compile.state import (
    MIN_GROWN_SLOTS, LayerState, allocate_layer, grow_axis_indices,
)

__all__ = ["kvarn_backend", "KVarNBackend", "Report"]  # Report: kvarn_compile.report

log = logging.getLogger(__name__)


class KVarNBackend:
    """A torch.compile backend (see :func:`kvarn_backend`). Thread-safe."""

    def __init__(self, config: KVarNConfig, options: KVarNOptions | None = None, *,
                 compiler: str = "inductor", mode: str | None = None, tune_knobs: Any = None,
                 context_parallel: Any = None):
        if compiler not in ("inductor", "eager"):
            raise ValueError(f"Expected compiler 'inductor' or 'eager', but got {compiler!r}.")
        self.config = config
        self.options = options or KVarNOptions()
        self.compiler = compiler
        self.mode = mode
        #: (site name, batch) -> the packed state that site's latest call used (each cache has
        #: its own: kvarn_compile.cache_book; :meth:`all_states` lists every live one)
        self.states: dict[tuple[str, int], LayerState] = {}
        #: the registered group of context-parallel decoding, or None
        self.context_parallel = None
        if context_parallel is not None:
            if tune_knobs is not None:
                raise ValueError("kvarn_backend: tune_knobs and context_parallel cannot be combined; "
                                 "pass one of them.")
            from kvarn_compile.ops import context_parallel as cp

            self.context_parallel = cp.register(context_parallel)
        #: id(parameter) -> (weak reference, model number): which model a graph belongs to
        self._param_models: dict[int, tuple[Any, int]] = {}
        self._n_models = 0
        self.report = Report(states=self.all_states)
        #: names of sites in graphs the backend traced again (see ``_per_batch``)
        self._site_names: dict[str, str] = {}
        #: what each graph compiled to, by its code and inputs (:func:`_graph_key`)
        self._compiled: dict[tuple, Any] = {}
        #: ``on_graph(stage, gm)``, stage "before"/"after" the rewrite: a test's graph recorder
        #: (:func:`kvarn_compile.testing.record_graphs`); None in production
        self.on_graph: Callable[[str, fx.GraphModule], None] | None = None
        self._lock = threading.Lock()
        #: the packed states keyed on the caches that hold them (kvarn_compile.cache_book)
        self.book = CacheBook(lambda name, **kw: self._allocate(name, **kw), self.report.note,
                              _reset_state)
        if compiler == "inductor":   # Inductor lowerings (templates, autotuning) of the kvarn ops
            from kvarn_compile import lowering

            lowering.register()
        #: per-layer Sinkhorn-iteration tuning at the first tile (kvarn_compile.autotune)
        self.knob_tuner = None
        if tune_knobs is not None:
            from kvarn_compile.autotune import KnobTuner, KnobTuning

            if tune_knobs is True:
                tune_knobs = KnobTuning()
            self.knob_tuner = KnobTuner(config, tune_knobs)

    # ------------------------------------------------------------------ states
    def _get_state(self, name: str, *, batch: int, kv_heads: int, head_dim: int, max_len: int,
                   dtype: torch.dtype, device: torch.device, tokens: Any = None,
                   fresh: bool = False, value_head_dim: int | None = None,
                   latent: bool = False) -> LayerState:
        """The state compiled with site ``name`` (by name and batch size), allocated when
        missing or of another geometry. At run time each cache gets its own state
        (:mod:`kvarn_compile.cache_book`); this one serves the first cache of the site and
        any site whose cache is not a graph input. ``tokens`` (cat caches only, see
        ``RewriteContext``): the state grows with the sequence instead of holding
        ``max_len`` up front (not under context parallelism, whose tile ranges are fixed)."""
        key = (name, batch)
        growable = tokens is not None and self.context_parallel is None
        state = self.states.get(key)
        dv = head_dim if value_head_dim is None else value_head_dim
        if state is None or state.max_len != max_len or state.head_dim != head_dim \
                or state.value_head_dim != dv \
                or state.kv_heads != kv_heads or state.sink_k.device != torch.device(device) \
                or state.growable != growable \
                or state.config.value_bits != self._config_for(latent).value_bits:
            state = self._allocate(name, batch=batch, kv_heads=kv_heads, head_dim=head_dim,
                                   max_len=max_len, dtype=dtype, device=device, tokens=tokens,
                                   value_head_dim=dv, latent=latent)
            self.states[key] = state
        return state

    def _config_for(self, latent: bool) -> KVarNConfig:
        """The packed format of a site: the backend's, or for a multi-head latent attention
        latent cache (``latent``: its values are the shared RoPE key) that with the values at
        ``LATENT_ROPE_BITS`` (2-bit values would wreck the positions)."""
        return self.config.replace(value_bits=LATENT_ROPE_BITS) if latent else self.config

    def _allocate(self, name: str, *, batch: int, kv_heads: int, head_dim: int, max_len: int,
                  dtype: torch.dtype, device: torch.device, tokens: Any = None,
                  fresh: bool = False, value_head_dim: int | None = None,
                  latent: bool = False) -> LayerState:
        """A new packed state for site ``name`` (growable for cat caches, ``tokens`` given)."""
        growable = tokens is not None and self.context_parallel is None
        kw = dict(batch=batch, kv_heads=kv_heads, head_dim=head_dim, max_len=max_len,
                  dtype=dtype, device=device, spec_tokens=self.spec_tokens, name=name,
                  value_head_dim=value_head_dim)
        if self.context_parallel is not None:
            from kvarn_compile.ops import context_parallel as cp

            return cp.allocate(self.context_parallel, self._config_for(latent), **kw)
        grow_from = (tokens if isinstance(tokens, int) else 0) if growable else None
        return allocate_layer(self._config_for(latent), **kw, grow_from=grow_from)

    def _model_tag(self, example_inputs: list[Any]) -> str:
        """Site-name prefix of the model a graph comes from: "" for the first model (and for
        graphs without parameters), ``"model<N>/"`` for the N-th. Dynamo passes a model's
        parameters as graph inputs; graphs sharing a parameter belong to one model, so one
        backend compiled into two models keeps their packed states apart."""
        params = [t for t in example_inputs if isinstance(t, torch.nn.Parameter)]
        if not params:
            return ""
        found = set()
        for p in params:
            entry = self._param_models.get(id(p))
            if entry is not None and entry[0]() is p:
                found.add(entry[1])
        if found:
            number = min(found)
        else:
            number = self._n_models
            self._n_models += 1
        for p in params:
            self._param_models[id(p)] = (weakref.ref(p), number)
        return f"model{number + 1}/" if number else ""

    def all_states(self) -> list[LayerState]:
        """Every packed state this backend holds: :attr:`states` (per site, the one its
        latest call used) and those of other live caches (:mod:`kvarn_compile.cache_book`)."""
        out = {id(s): s for s in self.states.values()}
        out.update((id(s), s) for s in self.book.live.values())
        return list(out.values())

    @property
    def nbytes(self) -> int:
        """Bytes held by all packed states of this backend (live tensors)."""
        return sum(s.nbytes for s in self.all_states())

    max_cache_len = property(lambda self: self.options.max_cache_len)
    release_buffers = property(lambda self: self.options.release_buffers)
    spec_tokens = property(lambda self: self.options.spec_tokens)

    def __deepcopy__(self, memo: dict) -> "KVarNBackend":
        # transformers deep-copies CompileConfig(backend=...); the backend owns the packed
        # states and a lock, and every copy must keep using the same ones.
        return self

    def reset(self) -> None:
        """Forget every sequence (the states stay allocated; growable ones shrink back)."""
        for state in self.all_states():
            _reset_state(state)

    # ------------------------------------------------------------------ backend
    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any):
        mode = kwargs.pop("mode", None) or self.mode
        if mode is not None and mode != "default" and not any(
                isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs):
            self.report.note(f"mode={mode!r} is ignored on CPU (it only selects CUDA-graph/"
                             "autotune options)")
            mode = None
        tag = self._model_tag(example_inputs)
        key = _graph_key(gm, example_inputs, mode, tag)
        if key is not None and key in self._compiled:
            # the same graph again: Dynamo traced it once more because a cache tensor's type
            # changed (a packed buffer or handle, cache_book) - run the one compiled before
            return self._compiled[key]
        out = self._compile_graph(gm, example_inputs, mode, tag)
        if key is not None:
            self._compiled[key] = out
        return out

    def _compile_graph(self, gm: fx.GraphModule, example_inputs: list[Any], mode: str | None,
                       tag: str):
        """Rewrite and compile ``gm``; ``tag``: the site-name prefix of its model (:meth:`_model_tag`)."""
        with self._lock:
            new_gm = _copy_graph_module(gm)
            param_at = [i for i, t in enumerate(example_inputs) if isinstance(t, torch.nn.Parameter)]
            sites: list[tuple[str, dict[str, Any]]] = []
            site_states: list[LayerState] = []

            def get_state(name: str, **kw: Any) -> LayerState:
                name = self._site_names.get(name, name)
                sites.append((name, kw))
                site_states.append(self._get_state(tag + name, **kw))
                return site_states[-1]

            def use_context_parallel(extra: list[Any]) -> None:
                if extra and self.context_parallel is not None:
                    from kvarn_compile.passes.context_parallel import use_context_parallel_ops

                    use_context_parallel_ops(new_gm, self.context_parallel.key)

            ctx = rewrite_context(self, get_state=get_state,
                                  separate_adopt=self.knob_tuner is not None,
                                  latent_refused=None if self.context_parallel is None else (
                                      "absorbed multi-head latent attention has no context-"
                                      "parallel form yet: this site keeps its full-precision "
                                      "cache under context_parallel"),
                                  weights_refused=None if self.context_parallel is None else (
                                      "the attention weights are returned (output_attentions), "
                                      "which context_parallel does not compute from the ranks' "
                                      "tiles: this site keeps its full-precision cache"))
            extra, reports = run_rewrite(self, gm, new_gm, list(example_inputs), ctx, what="graph",
                                         seen=None, rename=lambda n: tag + self._site_names.get(n, n),
                                         finish=use_context_parallel)
        graph_id = self.report.graphs
        fakes = _fake_inputs(gm)
        per_batch = _batch_symbols(fakes)
        if per_batch and any(r.reason.startswith(_DYNAMIC_BATCH) for r in reports if not r.rewritten):
            for r in reports:
                if not r.rewritten:
                    r.reason = ("the batch size is dynamic in this graph (the model ran with a "
                                "second batch size): each batch size runs its own graph, "
                                "compiled when first seen, with the cache packed")
            return self._per_batch(gm, fakes, per_batch)
        unchanged = [r for r in reports if not r.rewritten]
        why = "; ".join(dict.fromkeys(f"{r.name}: {r.reason}" for r in unchanged)) or \
            "no attention over it that the pass rewrites in this graph"
        # tensor inputs a cache could be (not parameters); those a rewritten site consumes
        # are read through the kvarn ops, the others must not be packed caches (book.guard)
        candidates = [i for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor)
                      and not isinstance(t, torch.nn.Parameter) and t.dim() >= 3]
        conflict = [loc for loc in ctx.locations if loc.kind == "buffer" and loc.k_input is not None
                    and loc.v_input is not None and not loc.adopts and loc.layer is None]
        if conflict:
            # a cache a site of this graph packs is also read in full precision in this graph:
            # the graph runs as Dynamo made it, its caches materialized before each call
            reason = (f"the KV cache of {conflict[0].site} is also read by another operation of "
                      "this graph, which the pass does not rewrite; the whole graph keeps its "
                      "caches in full precision")
            for r in reports:
                if r.rewritten:
                    r.rewritten, r.reason = False, reason
            why, extra = reason, []
        if not extra:  # nothing rewritten: compile Dynamo's graph untouched
            compiled = self._compile(gm, list(example_inputs), mode)
            if not candidates:
                return compiled

            def run_unchanged(*args: Any) -> Any:
                with _internal():
                    return compiled(*self.book.guard(list(args), candidates, graph_id, why))
            return run_unchanged
        # this frame may no longer run uncompiled (its model's caches are released)
        refuse_eager_fallback()
        consumed = {i for loc in ctx.locations for i in (loc.k_input, loc.v_input) if i is not None}
        candidates = [i for i in candidates if i not in consumed]
        book_sites = [_Site(tag + name, kw, loc, graph_id)
                      for (name, kw), loc in zip(sites, ctx.locations)]
        for site, state in zip(book_sites, site_states):
            self.book.offer(site.name, state)
        site_keys = [(site.name, kw["batch"]) for site, (_, kw) in zip(book_sites, sites)]
        # growable states (cat caches): sized before every call for the tokens the call's
        # appends bring (an int, or evaluated from the call's arguments); their growing axis is
        # dynamic in the compiled graph, so growing never recompiles
        growth = [(i, sizer(kw["tokens"], gm), kw["fresh"]) for i, (_, kw) in enumerate(sites)
                  if site_states[i].growable]
        n_args = len(example_inputs)
        # a decode graph on CUDA (every site appends one token per call to a state that never
        # grows, single-device) runs without a host sync (dispatch.deferred_checks): its
        # states are static inputs, so CUDA graphs capture it; their device flags are read
        # after each call, replayed or not
        capturable = (any(isinstance(t, torch.Tensor) and t.is_cuda for t in extra)
                      and all(loc.new_tokens == 1 for loc in ctx.locations)
                      and not any(st.growable for st in site_states)
                      and self.context_parallel is None and cuda_checks_deferred())
        _mark_added_inputs(new_gm, len(extra), capturable)
        if capturable:
            prepare_device(extra[0].device, [kw.get(d) or kw["head_dim"] for _, kw in sites
                                             for d in ("head_dim", "value_head_dim")])

        # A graph whose states never grow runs without Inductor's size/stride assertion on
        # each state buffer at every call (510 of them for a 30-layer model, ~0.15 ms a
        # decode step): those are the backend's own tensors, and the flat list checks their
        # shapes against what the graph was compiled for whenever it hands it other buffers.
        expected: list[tuple[Any, ...]] = [] if growth else [_layout_of(t) for t in extra]
        flat = _SiteStates(expected, graph_id)

        def compile_with(g: fx.GraphModule, inputs: list[Any]):
            # inputs[n_args:] are the states' current buffers (the knob tuner recompiles later)
            inputs, grown = _stand_ins(inputs, n_args, _growable_tiles(site_states))
            return self._compile(g, inputs, mode, inputs[n_args:], grown,
                                 unchecked=(n_args, len(expected)))

        if self.knob_tuner is not None:
            compiled = self.knob_tuner.wrap(new_gm, list(example_inputs) + extra, compile_with,
                                            self.report.notes)
        else:
            compiled = compile_with(new_gm, list(example_inputs) + extra)
        released = tuple(ctx.released_inputs)
        models = {tag: list(site_states)}
        first_param = weakref.ref(example_inputs[param_at[0]]) if param_at else None

        def by_name(args: list[Any], i: int) -> LayerState:
            # a site whose cache is not a graph input: its state by site name and model
            # (Dynamo does not guard on the module instance: a second model of the same
            # class runs this graph with its own parameters; it gets its own states)
            if first_param is None or args[param_at[0]] is first_param():
                return models[tag][i]
            with self._lock:
                model = self._model_tag([args[j] for j in param_at])
                if model not in models:
                    models[model] = [self._get_state(model + name, **kw) for name, kw in sites]
                return models[model][i]

        cache_inputs = tuple(sorted(consumed))
        # a graph whose every site packs a model-owned buffer it takes as an input (a static
        # cache) resolves to the same states call after call: CallMemo skips the bookkeeping
        # while the buffers are the same untouched tensors
        memo = CallMemo(tuple(sorted(consumed | {i for i, _ in released}))) if not growth and all(
            s.loc.kind == "buffer" and s.loc.k_input is not None and s.loc.v_input is not None
            for s in book_sites) else None

        def run(*call_args: Any) -> Any:
            with _internal(), plain_inputs(call_args, cache_inputs):
                return run_packed(call_args)

        def call(args: list[Any], buffers: list[torch.Tensor]) -> Any:
            if buffers and buffers[0].is_cuda:
                # every layer's decode append and attention without host syncs; their device
                # error flags read once, after the step
                with deferred_checks(f"graph {graph_id}", buffers[0].device if capturable else None):
                    return compiled(*args, *buffers)
            return compiled(*args, *buffers)

        def run_packed(call_args: tuple[Any, ...]) -> Any:
            args = self.book.guard(list(call_args), candidates, graph_id, why)
            buffers = memo.states_for(args) if memo is not None else None
            if buffers is not None:         # the same untouched buffers as the last call
                return call(args, buffers)
            for i, _ in released:
                claim(args[i])
            states = [self.book.resolve(site, args, lambda i=i: by_name(args, i))
                      for i, site in enumerate(book_sites)]
            for key, state in zip(site_keys, states):
                self.states[key] = state
            for i, tokens, fresh in growth:
                states[i].reserve(tokens(args), fresh=fresh)
            buffers = flat.buffers(states)
            out = call(args, buffers)
            for i, _, _ in growth:          # the tail slots this call's frozen tiles freed
                states[i].trim()
            self.book.after(list(zip(book_sites, states)), out, args)
            # The model's own cache tensors this graph no longer reads: freed after the
            # call (kvarn::append_from_ has taken over any prompt written there before), on
            # every call, so a new cache passed in their place (a second StaticCache) or a
            # buffer the model wrote again (a reset, an uncompiled prefill) is freed too.
            # Freed memory stays mapped and reads zeros (ops.buffers.release_storage).
            for i, site in released:
                if untouched_since_release(args[i]):
                    continue                # freed by an earlier call, not written since
                if releasable(args[i]):
                    site.released_bytes += release_storage(args[i])
                else:
                    mark_seen(args[i])      # adopt_ reads it again only once it is written
                    self._note_kept(args[i])
            if memo is not None and not any(st.growable for st in states):
                memo.record(args, buffers)      # (buffers a state never reallocates)
            return out

        return run

    def _per_batch(self, gm: fx.GraphModule, fakes: list[Any], batch: set[Any]):
        """Run a graph Dynamo made dynamic in the batch size (a second batch size on one
        compiled model) as one graph per batch size: each is Dynamo's graph traced again with
        that batch size fixed (its other dynamic sizes stay dynamic), through this backend,
        so its caches stay packed. A graph the pass leaves unchanged for another reason runs
        as it is."""
        keep = [(i, d) for i, t in enumerate(fakes) if isinstance(t, torch.Tensor)
                for d, n in enumerate(t.shape) if isinstance(n, torch.SymInt)
                and not (n.node.expr.free_symbols & batch)]
        at = [i for i, t in enumerate(fakes) if isinstance(t, torch.Tensor)
              and t.dim() and isinstance(t.shape[0], torch.SymInt)]
        graphs: dict[tuple[int, ...], Any] = {}

        def run(*args: Any) -> Any:
            key = tuple(int(args[i].shape[0]) for i in at)
            fn = graphs.get(key)
            if fn is None:
                for i, d in keep:
                    torch._dynamo.maybe_mark_dynamic(args[i], d)
                inner = _copy_graph_module(gm)
                _plain_size_ops(inner.graph)
                inner.recompile()
                real = getattr(inner, "real_recompile", None)
                if real is not None:          # Dynamo does not trace a lazy module's stub
                    real()
                self._site_names.update(_names_by_line(inner))
                fn = graphs[key] = torch.compile(inner.forward, backend=self, fullgraph=True)
            return fn(*args)

        return run

    def _note_kept(self, tensor: torch.Tensor) -> None:
        """Say once per device why a model-owned buffer was kept instead of freed."""
        where = "cuda" if tensor.is_cuda else tensor.device.type
        if tensor.device.type == "cpu":
            why = ("it is not a whole CPU buffer this platform can free in place (a view, "
                   "shared or pinned memory, or not Linux)")
        else:
            why = (f"{where} memory cannot be freed under a live tensor without making a later "
                   "access to it an illegal memory access")
        self.report.note(f"model-owned {where} K/V buffers are kept in full precision: {why}; use "
                         "kvarn_compile.hf.KVarNCache or a cat-style cache to avoid allocating them")

    def _compile(self, gm: fx.GraphModule, inputs: list[Any], mode: str | None,
                 static: list[Any] | None = None, dynamic: list[Any] | None = None,
                 unchecked: tuple[int, int] = (0, 0)):
        if self.compiler == "eager":
            return gm.forward
        from kvarn_compile import lowering
        from kvarn_compile._torch_compat import compile_fx_with_pass

        first = len(lowering.DECISIONS)
        _fill_sources(gm)
        compiled = compile_fx_with_pass(gm, inputs, mode, static_inputs=static,
                                        dynamic_dim2_inputs=dynamic, unchecked_inputs=unchecked)
        self.report.add_lowerings(lowering.DECISIONS[first:])
        return compiled


_DYNAMIC_BATCH = "dynamic batch"


#: Dynamo's size functions and the builtins Dynamo traces again as such (on plain ints,
#: ``torch.sym_*`` would be a torch function returning a non-tensor, which it refuses)
_SIZE_OPS = {torch.sym_sum: sum, torch.sym_max: max, torch.sym_min: min, torch.sym_float: float,
             torch.sym_int: int, torch.sym_not: operator.not_}


def _graph_key(gm: fx.GraphModule, example_inputs: list[Any], mode: str | None,
               tag: str) -> tuple | None:
    """What makes two of Dynamo's graphs the same compiled graph: their code and their inputs'
    shapes, strides, dtypes and devices, not the inputs' Python types (a cache tensor typed
    between calls, :mod:`kvarn_compile.cache_book`, makes Dynamo trace the graph again).
    None for a graph holding attributes (constants the code does not show), and for a graph
    with symbolic input shapes: the guards its compile added (the pass reads a static cache's
    length as an int; Inductor specializes too) are not this graph's, which would then serve
    shapes the compiled graph was not made for."""
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        return None
    if any(_symbolic(v) for v in _fake_inputs(gm)):
        return None
    inputs = tuple((str(tuple(t.shape)), str(t.stride()), t.dtype, t.device.type,
                    isinstance(t, torch.nn.Parameter), t.requires_grad)
                   if isinstance(t, torch.Tensor) else str(t) for t in example_inputs)
    # (the code's signature annotates each input with its type: left out)
    code = re.sub(r" : [\w.]+(?=[,)])", "", gm.code)
    return code, inputs, mode, tag


def _symbolic(value: Any) -> bool:
    """A SymInt, or a tensor with a symbolic size, stride or offset."""
    if isinstance(value, torch.SymInt):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(x, torch.SymInt)
                   for x in (*value.shape, *value.stride(), value.storage_offset()))
    return False


def _plain_size_ops(graph: fx.Graph) -> None:
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _SIZE_OPS:
            node.target = _SIZE_OPS[node.target]


def _names_by_line(gm: fx.GraphModule) -> dict[str, str]:
    """Site names as the pass gives them to a trace of ``gm``'s generated code (its source
    line), mapped to the names of the nodes that line came from (their module paths)."""
    from kvarn_compile.passes.sites import site_name

    nodes = list(gm.graph.nodes)
    code = gm.forward.__code__
    out = {}
    for line, index in (getattr(gm, "_lineno_map", None) or {}).items():
        if index is not None:
            out[f"forward@{code.co_filename}:{line + gm._prologue_start}"] = site_name(nodes[index])
    return out


def _fake_inputs(gm: fx.GraphModule) -> list[Any]:
    """What Dynamo traced each input of ``gm`` as (fake tensors with symbolic sizes, SymInts)."""
    return [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]


def _batch_symbols(fakes: list[Any]) -> set[Any]:
    """The size symbols of dim 0 (the batch) of a graph's tensor inputs."""
    return {sym for t in fakes if isinstance(t, torch.Tensor) and t.dim()
            and isinstance(t.shape[0], torch.SymInt) for sym in t.shape[0].node.expr.free_symbols}


def _layout_of(t: Any) -> tuple[Any, ...]:
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


class _SiteStates:
    """The flat buffer list (the extra graph inputs) of one graph's site states, rebuilt only
    when a site's state changed (another cache) or reallocated its tile buffers.

    ``expected``: the (shape, stride, dtype, device) of each buffer the graph was compiled
    for, when its generated code does not assert them itself: every rebuilt list is checked
    against them (a mismatch would read memory the graph was not compiled for)."""

    def __init__(self, expected: list[tuple[Any, ...]] | None = None, graph: int = 0) -> None:
        self._states: list[LayerState] = []
        self._versions: list[int] = []
        self._flat: list[torch.Tensor] = []
        self._expected, self._graph = expected or [], graph

    def buffers(self, states: list[LayerState]) -> list[torch.Tensor]:
        versions = [st.version for st in states]
        if versions != self._versions or len(states) != len(self._states) \
                or any(a is not b for a, b in zip(states, self._states)):
            flat = [b for st in states for b in st.buffers]
            if self._expected:
                self._check(flat)
            self._flat = flat
            self._states, self._versions = list(states), versions
        return self._flat

    def _check(self, flat: list[torch.Tensor]) -> None:
        for i, (t, want) in enumerate(zip(flat, self._expected)):
            got = _layout_of(t)
            if got != want:
                raise RuntimeError(
                    f"kvarn_backend: graph {self._graph} was compiled for KV state buffer {i} of "
                    f"shape {want[0]}, strides {want[1]}, {want[2]} on {want[3]}, but its state "
                    f"holds shape {got[0]}, strides {got[1]}, {got[2]} on {got[3]}; this is a "
                    "kvarn_compile bug, please report it (nothing was run).")
        if len(flat) != len(self._expected):
            raise RuntimeError(f"kvarn_backend: graph {self._graph} was compiled for "
                               f"{len(self._expected)} KV state buffers, but its states hold "
                               f"{len(flat)}; this is a kvarn_compile bug, please report it.")


def _reset_state(state: LayerState) -> None:
    """Empty ``state`` (a new sequence; growable states shrink back)."""
    for name in ("lengths", "committed", "n_tiles"):
        getattr(state, name).zero_()
    state.reserve(0, fresh=True)


def _stand_ins(inputs: list[Any], first: int, grown: list[torch.Tensor]
               ) -> tuple[list[Any], list[torch.Tensor]]:
    """``inputs`` and ``grown`` with every growing buffer (among ``inputs[first:]``) whose
    axis holds fewer than :data:`MIN_GROWN_SLOTS` slots replaced by a zero stand-in of that
    many: the compile would specialize a size of 0 or 1 to a constant; the code compiled
    for a symbolic size runs with any size, 0 and 1 included."""
    small = {id(t): t.new_zeros((*t.shape[:2], MIN_GROWN_SLOTS, *t.shape[3:]))
             for t in grown if t.shape[2] < MIN_GROWN_SLOTS}
    if not small:
        return inputs, grown
    swap = lambda t: small.get(id(t), t)  # noqa: E731
    return inputs[:first] + [swap(t) for t in inputs[first:]], [swap(t) for t in grown]


def _growable_tiles(states: list[LayerState]) -> list[torch.Tensor]:
    """The buffers growable states grow (dynamic along dim 2 when compiled)."""
    return [b for st in states if st.growable
            for j, b in enumerate(st.buffers) if j in grow_axis_indices(st.buffers)]


def sizer(tokens: Any, gm: fx.GraphModule) -> Callable[[tuple[Any, ...]], int]:
    """``args -> int``: the value of ``tokens`` (an int, or a SymInt of ``gm``'s inputs) for
    one call of ``gm`` with ``args``. A symbol is read from the graph input it was made for
    (a SymInt input, or a dimension of a tensor input); an expression no input determines
    gives the state's whole ``max_len`` (a huge value: ``reserve`` clamps it)."""
    if isinstance(tokens, int):
        return lambda args: tokens
    expr = tokens.node.expr
    where: dict[Any, tuple[int, int | None]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, ph in enumerate(placeholders):
        val = ph.meta.get("example_value", ph.meta.get("val"))
        if isinstance(val, torch.SymInt):
            where.setdefault(val.node.expr, (i, None))
        elif isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt):
                    where.setdefault(size.node.expr, (i, d))
    free = list(expr.free_symbols)
    if any(sym not in where for sym in free):
        return lambda args: 2 ** 62
    if len(free) == 1 and expr == free[0]:
        i, d = where[expr]
        return (lambda args: int(args[i])) if d is None else (lambda args: args[i].shape[d])

    def value(args: tuple[Any, ...]) -> int:
        subs = {sym: (args[i] if d is None else args[i].shape[d])
                for sym, (i, d) in ((sym, where[sym]) for sym in free)}
        return int(expr.xreplace(subs))
    return value


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over a copy of ``gm``'s graph (Dynamo keeps using the original); its
    Python code is generated when first needed (the compiler hashes it once anyway).

    Dynamo's metadata comes along (the graph's ``meta``, ``_param_name_to_source``, each
    placeholder's ``_dynamo_source``): AOTAutograd reads it to tell static inputs
    (parameters, buffers, tensors marked static such as a StaticCache's) from the others,
    and CUDA graphs copy every input that is not static into the graph on every replay, and
    skip a graph that mutates one (the packed states): without it no kvarn graph ran under
    ``mode="reduce-overhead"``. Placeholders the pass adds get their own (see
    :func:`_mark_added_inputs`, :func:`_fill_sources`)."""
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, copies)
    graph.output(out)
    new = lazy_graph_module(gm, graph)
    new.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        new._param_name_to_source = gm._param_name_to_source
    for node in gm.graph.find_nodes(op="placeholder"):
        if hasattr(node, "_dynamo_source"):
            copies[node]._dynamo_source = node._dynamo_source
    return new


def _mark_added_inputs(gm: fx.GraphModule, added: int, static: bool) -> None:
    """Mark the ``added`` placeholders the pass appended (the packed states' buffers) static
    when ``static``: their addresses never change between calls (a state that does not
    grow), so CUDA graphs read and mutate them in place."""
    if not static or added <= 0:
        return
    for node in gm.graph.find_nodes(op="placeholder")[-added:]:
        node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}


def _fill_sources(gm: fx.GraphModule) -> None:
    """Placeholders the backend added (states, the knob tuner's token) have no user source:
    Dynamo's metadata says so (None), as AOTAutograd requires of every placeholder once the
    graph carries Dynamo's ``_param_name_to_source``."""
    if hasattr(gm, "_param_name_to_source"):
        for node in gm.graph.find_nodes(op="placeholder"):
            if not hasattr(node, "_dynamo_source"):
                node._dynamo_source = None


def kvarn_backend(preset: str | KVarNConfig = "k4v2", *, max_cache_len: int | None = None,
                  release_buffers: bool | None = None, spec_tokens: int | None = None,
                  options: KVarNOptions | None = None, compiler: str = "inductor",
                  mode: str | None = None, tune_knobs: Any = None, context_parallel: Any = None,
                  **config_overrides: Any) -> KVarNBackend:
    """A torch.compile backend that stores every attention's KV cache KVarN-packed.

    Args:
        preset: a preset name (``k4v2`` default, ``k4v4``, ``k2v2``, ``k4v2_g64``,
            ``k4v4_g64``) or a :class:`KVarNConfig`; ``**config_overrides`` change fields
            (e.g. ``group_size=64``, ``method="kivi"``).
        max_cache_len, release_buffers, spec_tokens: the front-end options (defaults 8192,
            True, 0), or all of them as ``options=KVarNOptions(...)``; see
            :class:`kvarn_compile.KVarNOptions`. ``max_cache_len``: tokens per sequence for
            caches whose capacity the model does not fix (``torch.cat`` caches such as
            transformers' DynamicCache). ``release_buffers``: free the memory of model-owned
            full-precision cache buffers that the rewritten graphs no longer use, after every
            call that passes them (a prompt an uncompiled forward wrote there is first
            adopted into the packed cache); on CPU (Linux) their pages go back to the
            operating system while the tensors stay valid (they read zeros); CUDA buffers are
            kept (see :mod:`kvarn_compile.ops.buffers`). ``spec_tokens``: newest tokens of
            each write kept uncommitted (speculative decoding).
        compiler: ``"inductor"`` (default) or ``"eager"`` (run the rewritten graph as is).
        mode: a torch.compile mode; also accepted as the keyword torch.compile/transformers pass.
        tune_knobs: ``True`` or a :class:`kvarn_compile.autotune.KnobTuning`: choose the
            Sinkhorn iteration count per layer at its first tile, under the quality rule of
            :func:`kvarn_compile.autotune.select_quant_knobs` (decisions in ``report.notes``).
        context_parallel: a ``torch.distributed`` ProcessGroup, or ``True`` for the default
            group: context-parallel decoding (every rank runs the model; each holds 1/ranks of
            the packed tiles; one ``all_gather`` per attention; see
            :mod:`kvarn_compile.ops.context_parallel`).
    """
    opts = options_from(options, max_cache_len=max_cache_len, release_buffers=release_buffers,
                        spec_tokens=spec_tokens)
    return KVarNBackend(get_config(preset, **config_overrides), opts, compiler=compiler,
                        mode=mode, tune_knobs=tune_knobs, context_parallel=context_parallel)
