"""Every private PyTorch API kvarn_compile touches, in one version-gated place.

Tested with torch 2.13. These internals (``torch._inductor``, ``torch._logging._internal``)
change between releases; when they move, only this module should need an edit. Each
helper fails with a clear message naming the torch version instead of an AttributeError
deep inside a compile. It is a leaf: it imports nothing of kvarn_compile (state it needs
for cache keys is registered with :func:`register_cache_salt`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pathlib
import platform
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TESTED_TORCH", "check_torch_version", "compile_fx_with_pass", "kvarn_sources_hash",
           "lazy_graph_module", "refuse_eager_fallback", "EagerFallbackRefused",
           "KVarNUUIDPass", "custom_graph_pass_base", "inductor", "triton_version",
           "device_identity", "triton_templates_available", "register_cache_salt", "cache_salt",
           "tag_inductor_caches", "triton_cpu_mode", "triton_cpu_requested",
           "plain_tensor_functions"]

TESTED_TORCH = ((2, 13), (2, 14))   # inclusive range of minor versions

#: a context inside which tensor subclasses' ``__torch_function__`` does not run (their
#: instances act as plain tensors): the cache book's own runtime around a compiled call
plain_tensor_functions = torch._C.DisableTorchFunctionSubclass


def _torch_minor() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


#: Set to 1 to use the compiler integration with an untested torch (a warning, not an error).
UNTESTED_TORCH_ENV = "KVARN_ALLOW_UNTESTED_TORCH"


def check_torch_version() -> None:
    lo, hi = TESTED_TORCH
    if not lo <= _torch_minor() <= hi:
        if os.environ.get(UNTESTED_TORCH_ENV, "0") == "1":
            import warnings

            warnings.warn(f"kvarn_compile: torch {torch.__version__} is outside the tested range "
                          f"{lo[0]}.{lo[1]}-{hi[0]}.{hi[1]} ({UNTESTED_TORCH_ENV}=1).", stacklevel=2)
            return
        raise RuntimeError(
            f"kvarn_compile's compiler integration is tested with torch {lo[0]}.{lo[1]}-"
            f"{hi[0]}.{hi[1]}, but torch {torch.__version__} is installed. Install a tested "
            "torch (pip install torch==2.13.0) or use the eager KVarNCache without compiling "
            f"({UNTESTED_TORCH_ENV}=1 tries anyway).")


# ------------------------------------------------------------------------------ sources hash
#: Suffixes of the files that make up kvarn's compiled behaviour: Python sources (passes,
#: ops, kernels, lowerings), the Triton templates (``lowering/templates/*.py.jinja``) and
#: the C++ kernel sources (``kernels/csrc``).
SOURCE_SUFFIXES = (".py", ".jinja", ".cpp", ".h")
#: parts of the package that compile nothing (the evaluation harness, test helpers, the CLI):
#: editing them keeps Inductor's caches
NOT_COMPILED = ("eval", "testing", "cli.py")


def _hash_sources(root: pathlib.Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if rel.parts and rel.parts[0] in NOT_COMPILED:
            continue
        if path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts and path.is_file():
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def kvarn_sources_hash() -> str:
    """sha256 over every source file of the package that shapes compiled code (passes, ops,
    kernels, lowerings and the ``templates/*.py.jinja`` Triton templates; not
    :data:`NOT_COMPILED`). Cached for the process; tests that edit
    a source call ``kvarn_sources_hash.cache_clear()``."""
    return _hash_sources(pathlib.Path(__file__).parent)


#: name -> callable returning a string: state outside the sources that changes generated code
#: (the lowering registers whether it is installed and which path it is forced to).
_CACHE_SALTS: dict[str, Any] = {}


def register_cache_salt(name: str, fn: Any) -> None:
    """Add ``fn()`` (a string) to kvarn's Inductor cache key under ``name``."""
    _CACHE_SALTS[name] = fn


def cache_salt() -> str:
    """The registered salts, in name order (see :func:`register_cache_salt`)."""
    return ";".join(f"{name}:{_CACHE_SALTS[name]()}" for name in sorted(_CACHE_SALTS))


def tag_inductor_caches(tag: str, *, remove: bool = False) -> None:
    """Add ``tag`` to (or remove it from) ``torch.compiler.config.cache_key_tag``.

    Inductor's FX-graph and AOTAutograd caches key on that tag, not on registered lowerings.
    While kvarn's lowerings are installed, every compile of the process carries a tag that
    hashes kvarn's sources, so generated code that calls kvarn's extern kernels or
    templates is never loaded into a process without them (or with other sources), even
    for a plain ``torch.compile`` without kvarn's uuid pass. A tag the user set is kept.
    """
    import torch.compiler.config as compiler_config

    parts = [p for p in compiler_config.cache_key_tag.split("|") if p]
    if remove:
        parts = [p for p in parts if p != tag]
    elif tag not in parts:
        parts.append(tag)
    compiler_config.cache_key_tag = "|".join(parts)


@functools.lru_cache(maxsize=1)
def _uuid_pass_class() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _KVarNUUIDPass(CustomGraphPass):
        """A no-op post-grad pass whose uuid() hashes every kvarn source file.

        User lowerings and templates are not part of Inductor's FX-graph cache key; with
        this pass installed an edited kernel or pass never hits a stale compiled graph.
        """

        def __call__(self, graph: torch.fx.Graph) -> None:
            return None

        def uuid(self) -> Any:
            return f"{kvarn_sources_hash()};{cache_salt()}"

    return _KVarNUUIDPass


def KVarNUUIDPass() -> Any:  # noqa: N802  (a factory that reads like the class)
    return _uuid_pass_class()()


def custom_graph_pass_base() -> type:
    """Inductor's ``CustomGraphPass`` (``torch._inductor.custom_graph_pass``), the base a
    pass needs so that Inductor's FX-graph/AOT caches key on its ``uuid()`` (otherwise
    they are bypassed, or a pre-grad pass runs before the cache lookup with a warning)."""
    check_torch_version()
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


# ------------------------------------------------------------------------------ dynamo
#: Dynamo frame ids whose graphs a kvarn pass rewrote (see :func:`refuse_eager_fallback`).
_REWRITTEN_FRAMES: set[int] = set()
_FALLBACK_GUARD = threading.Lock()
_FALLBACK_INSTALLED = False


class EagerFallbackRefused(RuntimeError):
    """Dynamo would run a frame whose graphs kvarn rewrote uncompiled (see
    :func:`refuse_eager_fallback`)."""


#: A key kept in a set ``torch._dynamo.reset()`` clears: frame ids restart from 0 after a reset,
#: so the frames recorded before it must be forgotten.
_GENERATION_MARK = "kvarn: frames rewritten since the last torch._dynamo.reset()"


def _forget_frames_after_reset() -> None:
    """Forget the recorded frames when Dynamo was reset since they were recorded."""
    cleared_on_reset = getattr(torch._dynamo.utils, "warn_once_cache", None)
    if isinstance(cleared_on_reset, set) and _GENERATION_MARK not in cleared_on_reset:
        _REWRITTEN_FRAMES.clear()
        cleared_on_reset.add(_GENERATION_MARK)


def refuse_eager_fallback() -> None:
    """Refuse to let Dynamo run the frame being compiled (whose graph kvarn rewrote) uncompiled.

    When a frame exceeds ``torch._dynamo.config.recompile_limit`` Dynamo runs it as plain
    Python from then on (a warning in the log). For a frame whose attention kvarn rewrote
    that is wrong, not merely slow: the model's own K/V cache tensors were released or
    replaced by a placeholder (the packed state holds the tokens), so the uncompiled
    attention would read zeros. Dynamo logs the limit just before it gives up; a filter on
    that log record raises instead (Dynamo re-raises errors of a compile to the caller, so
    the call fails with this message). Needs Dynamo's warnings to be logged (the default).
    """
    global _FALLBACK_INSTALLED
    frame = getattr(torch._guards.CompileContext.current_compile_id(), "frame_id", None)
    if frame is None:
        return
    with _FALLBACK_GUARD:
        _forget_frames_after_reset()
        _REWRITTEN_FRAMES.add(frame)
        if _FALLBACK_INSTALLED:
            return
        _FALLBACK_INSTALLED = True
    import logging

    class _RefuseFallback(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if not str(record.msg).startswith("torch._dynamo hit config."):
                return True
            current = torch._guards.CompileContext.current_compile_id()
            with _FALLBACK_GUARD:
                _forget_frames_after_reset()
                ours = getattr(current, "frame_id", None) in _REWRITTEN_FRAMES
            if not ours:
                return True
            args = tuple(record.args or ()) + ("recompile_limit", "?", "?")
            limit, value, function = args[0], args[1], args[2]
            raise EagerFallbackRefused(
                f"kvarn: Dynamo reached torch._dynamo.config.{limit} ({value}) for {function}, "
                "a function whose attention kvarn rewrote; it would now run uncompiled, over K/V "
                "cache tensors that kvarn has released (wrong results), so the call is stopped. "
                f"Raise torch._dynamo.config.{limit} (compiling each decoder layer on its own "
                "takes about 2 graphs per layer), or use transformers' StaticCache.")

    logging.getLogger("torch._dynamo.convert_frame").addFilter(_RefuseFallback())


# ------------------------------------------------------------------------------ compile
def lazy_graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """``fx.GraphModule(root, graph)`` whose Python code is generated on first use instead
    of at construction and at every ``recompile()`` (``torch.fx``'s lazy graph module, the
    one Dynamo hands to backends); a plain GraphModule where torch has none."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:
        return torch.fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def fakify_static(tensors: list[Any], dynamic_dim2: list[Any] | None = None) -> list[Any]:
    """Pre-register fakes of ``tensors`` in the current compile's fake mode: static shapes,
    except dim 2 of the tensors in ``dynamic_dim2`` (the growing axis of growable states),
    which gets a symbol of its own.

    Graph inputs a backend adds (the packed states) are unknown to Dynamo, so AOTAutograd
    would fakify them with fresh symbolic sizes; Inductor then sees symbolic shapes and the
    kvarn lowerings fall back. The fake-tensor converter memoizes per tensor, so a fake made
    first is the one AOTAutograd picks up. The memo holds its fakes weakly: keep the
    returned list alive until the compile is done. Outside a compile: [].
    """
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    fake_mode = detect_fake_mode()
    if fake_mode is None:
        return []
    grow = {id(t) for t in dynamic_dim2 or []}
    if grow and fake_mode.shape_env is None:
        raise RuntimeError("kvarn: a growable KV state needs a symbolic shape environment in "
                           "the compile; none was found (unsupported torch.compile setup).")
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or isinstance(t, torch._subclasses.FakeTensor):
            continue
        if id(t) in grow:
            # DYNAMIC, not DUCK: never unified with another size that happens to be equal
            sizes = [DimDynamic.STATIC] * t.dim()
            sizes[2] = DimDynamic.DYNAMIC
            context = StatelessSymbolicContext(dynamic_sizes=sizes, constraint_sizes=[None] * t.dim())
            out.append(fake_mode.from_tensor(t, symbolic_context=context))
        else:
            out.append(fake_mode.from_tensor(t, static_shapes=True))
    return out


def check_dynamic_dim2(fakes: list[Any]) -> None:
    """Raise when the compile specialized the growing axis (dim 2) of a growable state's
    fakes ``fakes`` (a constant from the start: a size of 0 or 1; or a symbol replaced by a
    constant): the compiled code would be wrong once it grows."""
    for f in fakes:
        if f.dim() <= 2:
            continue
        size = f.shape[2]
        if not isinstance(size, torch.SymInt):
            raise RuntimeError(
                f"kvarn: a growing axis of a KV state was compiled as the constant {size} (a "
                "size of 0 or 1 is never symbolic; compile through a larger stand-in); compiled "
                "graphs would break when the cache grows. Please report this; preallocate "
                "instead (a StaticCache).")
        node = size.node
        expr = node.shape_env.replace(node.expr)
        if not expr.free_symbols:
            raise RuntimeError(
                f"kvarn: the compile specialized the growing axis of a KV state to {expr}; "
                "compiled graphs would break when the cache grows. Please report this; "
                "preallocate instead (a StaticCache, or kvarn_backend on a model whose cache "
                "is preallocated).")


#: per thread: (graph inputs in all, first and count of the inputs the generated code does
#: not assert) while :func:`compile_fx_with_pass` compiles with ``unchecked_inputs``; part of
#: the cache key (code without those assertions is never served to a compile that wants them)
_UNCHECKED = threading.local()
register_cache_salt("unchecked_inputs", lambda: str(getattr(_UNCHECKED, "spec", (0, 0, 0))[1:]))


@functools.lru_cache(maxsize=1)
def _install_unchecked_inputs() -> bool:
    """Let the generated code skip Inductor's size/stride assertion on the inputs a graph
    is compiled with ``unchecked_inputs`` for (the backend's own state buffers, whose shapes
    it checks itself whenever it hands the graph other buffers). Every other graph (of this
    thread or another, or a subgraph of another arity) keeps all its assertions, as does a
    torch whose wrapper code generation does not look like 2.11-2.13's (False): there the
    assertions come from ``codegen_input_size_asserts`` over ``get_graph_inputs()``, which
    this hides the unchecked inputs from while it runs."""
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    from torch._inductor.virtualized import V

    original = getattr(PythonWrapperCodegen, "codegen_input_size_asserts", None)
    if original is None or not hasattr(PythonWrapperCodegen, "get_graph_inputs"):
        return False

    def codegen_input_size_asserts(self: Any) -> None:
        total, first, count = getattr(_UNCHECKED, "spec", (0, 0, 0))
        names = list(getattr(V.graph, "graph_input_names", ()))
        if not count or len(names) != total:
            return original(self)
        skip = set(names[first:first + count])
        inputs = self.get_graph_inputs()
        self.get_graph_inputs = lambda: {k: v for k, v in inputs.items() if k not in skip}
        try:
            original(self)
        finally:
            del self.get_graph_inputs

    PythonWrapperCodegen.codegen_input_size_asserts = codegen_input_size_asserts
    return True


def compile_fx_with_pass(gm: torch.fx.GraphModule, inputs: list[Any], mode: str | None = None,
                         static_inputs: list[Any] | None = None,
                         dynamic_dim2_inputs: list[Any] | None = None,
                         unchecked_inputs: tuple[int, int] = (0, 0)):
    """Inductor's compile_fx with the kvarn uuid pass (and the options of ``mode``).

    ``static_inputs``: backend-added inputs whose shapes never change (see fakify_static),
    but for dim 2 of ``dynamic_dim2_inputs`` (the growing axis of growable states).
    ``unchecked_inputs``: (first, count) of the inputs whose sizes and strides the generated
    code does not assert on every call (the caller checks those tensors itself).
    """
    check_torch_version()
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    fakes = fakify_static(static_inputs or [], dynamic_dim2_inputs)  # held during compile_fx
    grown = fakify_static(dynamic_dim2_inputs or [], dynamic_dim2_inputs)   # (the same fakes)
    check_dynamic_dim2(grown)

    patches: dict[str, Any] = {"post_grad_custom_post_pass": KVarNUUIDPass()}
    if mode:
        patches.update(list_mode_options(mode))
    on_cpu = not any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in inputs)
    first, count = unchecked_inputs
    count = count if count > 0 and _install_unchecked_inputs() else 0
    before = getattr(_UNCHECKED, "spec", (0, 0, 0))
    _UNCHECKED.spec = (len(inputs), first, count) if count else (0, 0, 0)
    try:
        if triton_cpu_requested() and on_cpu:     # KVARN_TRITON_CPU=1: the templates on CPU (tests)
            with triton_cpu_mode():
                compiled = compile_fx(gm, inputs, config_patches=patches)
        else:
            compiled = compile_fx(gm, inputs, config_patches=patches)
    finally:
        _UNCHECKED.spec = before
    check_dynamic_dim2(grown)
    return compiled


def _trace(fn: Callable[..., Any], args: list[torch.Tensor]) -> Any:
    """make_fx of ``fn`` on ``args`` with Inductor's decompositions, always as a plain
    GraphModule: inside a compile (a lowering benchmarking this graph) fx would make a lazy
    one, whose attributes come in another order, and AOTAutograd's cache key would differ
    from the same graph traced at run time in a later process (which then compiled it
    again: 2 s of every first warm start)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:
        return make_fx(fn, decomposition_table=select_decomp_table())(*args)
    with _use_lazy_graph_module(False):
        return make_fx(fn, decomposition_table=select_decomp_table())(*args)


#: the per-compile class state of Inductor's Triton bundler (``_winners`` since torch 2.12)
_BUNDLER_STATE = ("_entries", "_static_autotuners", "_winners")


def compile_function(fn: Callable[..., Any], args: list[torch.Tensor]) -> Callable[..., Any]:
    """``fn`` traced with make_fx (Inductor's decompositions) on ``args`` and compiled by
    Inductor as a graph of its own (static shapes); returns ``compiled(*args) -> output``.

    Runs in a worker thread: the caller may be inside another compile (a lowering that
    benchmarks this choice), and a graph of its own must not see that compile's tracing
    context, fake mode or virtualized handlers (all thread-local). Compiled in a tracing
    context with a shape environment, so AOTAutograd's and Inductor's FX-graph caches serve
    it in a warm process.
    """
    check_torch_version()
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.triton_bundler import TritonBundler
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    result: dict[str, Any] = {}

    def work() -> None:
        try:
            with torch.no_grad():
                gm = _trace(fn, args)
                # compiled in a tracing context whose fake mode has a shape environment:
                # without one, AOTAutograd's and Inductor's FX-graph caches bypass the graph
                # ("No shape env") and a warm process compiles it again
                # (Inductor's Triton bundler is process-global state of the compile that
                # waits for this one: set aside while this graph compiles and is cached)
                context = torch._guards.TracingContext(FakeTensorMode(shape_env=ShapeEnv()))
                bundler = {name: getattr(TritonBundler, name) for name in _BUNDLER_STATE
                           if hasattr(TritonBundler, name)}
                TritonBundler.end_compile()
                try:
                    with torch._guards.tracing(context):
                        result["fn"] = compile_fx(gm, list(args))
                finally:
                    for name, value in bundler.items():
                        setattr(TritonBundler, name, value)
        except BaseException as e:          # re-raised in the caller's thread
            result["error"] = e

    t = threading.Thread(target=work, name="kvarn-compile-function")
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    compiled = result["fn"]

    def call(*a: torch.Tensor) -> Any:
        out = compiled(*a)
        return out[0] if isinstance(out, (list, tuple)) and len(out) == 1 else out
    return call


# ------------------------------------------------------------------------------ inductor
class _UserLowerings(dict):
    """``user_lowerings`` for torch < 2.12, which checks only its built-in ``lowerings``:
    setting an op installs a wrapper there that calls the lowering and, when it returns
    None, Inductor's plain fallback kernel (what 2.12+ does); popping it restores the
    previous entry."""

    def __init__(self, lowerings: dict) -> None:
        super().__init__()
        self._table, self._saved = lowerings, {}

    def __setitem__(self, op, fn) -> None:
        from torch._inductor.lowering import fallback_handler

        if op not in self._saved:
            self._saved[op] = self._table.get(op)

        def lower(*args, **kwargs):
            out = fn(*args, **kwargs)
            if out is None:
                out = fallback_handler(op, add_to_fallback_set=False)(*args, **kwargs)
            return out

        super().__setitem__(op, fn)
        self._table[op] = lower

    def pop(self, op, *default):
        if op in self._saved:
            previous = self._saved.pop(op)
            if previous is None:
                self._table.pop(op, None)
            else:
                self._table[op] = previous
        return super().pop(op, *default)


_EXTERN_CHOICES: dict[str, Any] = {}


def _extern_choice(fn: Callable, name: str, **kwargs: Any) -> Any:
    """The ``ExternKernelChoice`` named ``name`` (a process-wide name): the one made earlier,
    else a new one over ``fn``."""
    from torch._inductor.select_algorithm import ExternKernelChoice

    found = (ExternKernelChoice.lookup(name) if hasattr(ExternKernelChoice, "lookup")
             else _EXTERN_CHOICES.get(name))   # torch < 2.12 has no registry
    if found is None:
        found = _EXTERN_CHOICES[name] = ExternKernelChoice(fn, name=name, **kwargs)
    return found


def _template_freezes_inputs() -> bool:
    """Whether this torch's ``TritonTemplate`` takes ``always_freeze_layout`` (2.12+)."""
    import inspect

    from torch._inductor.select_algorithm import TritonTemplate

    return "always_freeze_layout" in inspect.signature(TritonTemplate.__init__).parameters


def _triton_template(name: str, grid: Any, source: str) -> Any:
    """A ``TritonTemplate`` whose inputs' layouts are frozen when it reads them (it has no aten
    fallback should a layout change later). torch < 2.12 lacks ``always_freeze_layout``: there
    the lowering freezes them itself (:func:`_freeze_template_inputs`)."""
    from torch._inductor.select_algorithm import TritonTemplate

    kwargs = {"always_freeze_layout": True} if _template_freezes_inputs() else {}
    return TritonTemplate(name=name, grid=grid, source=source, **kwargs)


def _freeze_template_inputs(nodes: Any) -> None:
    """Freeze the flexible layouts of a template's realized inputs, where ``TritonTemplate``
    cannot be told to (torch < 2.12); a no-op elsewhere."""
    from torch._inductor import ir

    if _template_freezes_inputs():
        return
    for node in nodes:
        data = getattr(node, "data", None)
        if isinstance(getattr(data, "layout", None), ir.FlexibleLayout):
            data.freeze_layout()


_BEST: dict[tuple, Any] = {}


def _remember_best(timings, name, input_nodes, choices, profiled_time_fn, precompile_times=None):
    finite = {c: t for c, t in timings.items() if t == t and t != float("inf")}
    if finite and name.startswith("kvarn_"):
        _BEST[(name, tuple(n.get_name() for n in input_nodes))] = min(finite, key=finite.get)


def _select_algorithm(name: str, choices: list, inputs: list, layout: Any, **kwargs: Any) -> tuple:
    """``autotune_select_algorithm`` as ``(node, winning choice)``. torch < 2.12 returns the node
    alone: the winner is then the fastest choice Inductor benchmarked (None if it did not)."""
    from torch._inductor.select_algorithm import autotune_select_algorithm

    out = autotune_select_algorithm(name, choices, inputs, layout, **kwargs)
    best = _BEST.pop((name, tuple(n.get_name() for n in inputs)), None)
    if isinstance(out, tuple):
        return out
    return out, best if best is not None else choices[0] if len(choices) == 1 else None


@functools.lru_cache(maxsize=1)
def inductor() -> types.SimpleNamespace:
    """The private Inductor pieces the lowerings use, imported once behind the version gate.

    Attributes: ``extern_choice(fn, name, **kw)`` (the process-wide ``ExternKernelChoice`` of
    that name, made once), ``triton_template(name, grid, source)`` and
    ``freeze_template_inputs(nodes)`` (a template over frozen input layouts), ``user_lowerings`` (op -> lowering, checked before the built-in table; a
    lowering may return None to fall back), ``lowerings`` (the built-in table),
    ``ExternKernelChoice``, ``TritonTemplate``, ``SymbolicGridFn``,
    ``autotune_select_algorithm``, ``select_algorithm`` (its ``(node, winner)`` on every torch),
    ``add_feedback_saver``, ``AlgorithmSelectorCache``,
    ``SubgraphTemplate``, ``inline_subgraph_to_ir_nodes``, ``realize_inputs``, ``ir``
    (``torch._inductor.ir``: FixedLayout, FallbackKernel, TensorBox, ...), ``V``,
    ``config`` (``torch._inductor.config``), ``make_fx``, ``select_decomp_table``, ``ops``
    (the virtualized ops handler of ``inner_fn`` bodies).

    Verified on torch 2.13 (CPU). TritonTemplate needs a GPU driver even to render.
    """
    check_torch_version()
    import torch._inductor.config as config
    import torch._inductor.ir as ir
    from torch._inductor.codegen.subgraph import SubgraphTemplate, inline_subgraph_to_ir_nodes
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import lowerings
    try:
        from torch._inductor.lowering import user_lowerings
    except ImportError:   # torch < 2.12: emulated on the built-in table
        user_lowerings = _UserLowerings(lowerings)
    from torch._inductor.select_algorithm import (
        AlgorithmSelectorCache, ExternKernelChoice, SymbolicGridFn, TritonTemplate,
        add_feedback_saver, autotune_select_algorithm, realize_inputs,
    )
    from torch._inductor.virtualized import V, ops
    from torch.fx.experimental.proxy_tensor import make_fx

    add_feedback_saver(_remember_best)
    return types.SimpleNamespace(
        select_algorithm=_select_algorithm, extern_choice=_extern_choice, triton_template=_triton_template,
        freeze_template_inputs=_freeze_template_inputs, user_lowerings=user_lowerings, lowerings=lowerings, ExternKernelChoice=ExternKernelChoice,
        TritonTemplate=TritonTemplate, SymbolicGridFn=SymbolicGridFn,
        autotune_select_algorithm=autotune_select_algorithm, add_feedback_saver=add_feedback_saver,
        AlgorithmSelectorCache=AlgorithmSelectorCache, SubgraphTemplate=SubgraphTemplate,
        inline_subgraph_to_ir_nodes=inline_subgraph_to_ir_nodes, realize_inputs=realize_inputs,
        ir=ir, V=V, config=config, make_fx=make_fx, select_decomp_table=select_decomp_table,
        ops=ops)


def static_ints(values: Any) -> list[int] | None:
    """Sizes/strides of an IR node as Python ints, or None when any is symbolic."""
    out = []
    for v in values:
        try:
            out.append(int(v))
        except TypeError:
            return None
    return out


# ------------------------------------------------------------------------------ identity
def triton_version() -> str | None:
    try:
        import triton
    except Exception:  # not installed, or a broken install
        return None
    return getattr(triton, "__version__", None)


def triton_templates_available(device: torch.device | str) -> bool:
    """True when Triton templates can be rendered and run for ``device``: CUDA with triton,
    or CPU tensors inside :func:`triton_cpu_mode` (the Triton interpreter)."""
    device = torch.device(device)
    if device.type == "cpu":
        return _TRITON_CPU.active > 0
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    from torch.utils._triton import has_triton

    return has_triton()


class _TritonCPUState:
    active = 0
    lock = threading.Lock()


_TRITON_CPU = _TritonCPUState()
#: Set to 1 to run kvarn_backend's compiles in :func:`triton_cpu_mode` (tests).
TRITON_CPU_ENV = "KVARN_TRITON_CPU"


def triton_cpu_requested() -> bool:
    return os.environ.get(TRITON_CPU_ENV, "0").strip().lower() in ("1", "true", "on", "yes")


@contextlib.contextmanager
def triton_cpu_mode():
    """Inductor renders, autotunes and runs Triton code, kvarn's TritonTemplates included,
    for CPU tensors through the Triton interpreter (slow: tiny shapes, for tests).

    Needs ``TRITON_INTERPRET=1`` set before triton is first imported. Inside the block:
    ``cpu_backend="triton"`` (Inductor emits Triton for CPU tensors), a constant
    ``triton_hash_with_backend`` (without a GPU driver the real one fails: "0 active
    drivers"), ``benchmark_epilogue_fusion=False`` (the fused benchmark module does not
    render on CPU), ``use_fast_math=True`` (``tl_math.exp``: the interpreter has no
    ``libdevice``), one compile thread and the shortest benchmark (one timed run per
    choice). bf16 is wrong in the interpreter (triton#11584):
    use fp16/fp32. Users on CPU keep the C++ path; this mode exists for CI.
    """
    if os.environ.get("TRITON_INTERPRET", "0").strip() not in ("1", "true", "on", "yes"):
        raise RuntimeError("kvarn's CPU Triton mode needs TRITON_INTERPRET=1 in the environment "
                           "before triton is imported (the tests' conftest sets it).")
    check_torch_version()
    import torch._inductor.config as config
    import torch.utils._triton as triton_utils

    _interpreted_libdevice()
    with _TRITON_CPU.lock:
        _TRITON_CPU.active += 1
        saved_hash = triton_utils.triton_hash_with_backend
        triton_utils.triton_hash_with_backend = lambda: "kvarn-triton-interpreter"
    try:
        with config.patch(cpu_backend="triton", benchmark_epilogue_fusion=False,
                          use_fast_math=True, compile_threads=1,
                          # one timed run per choice: interpreted kernels take seconds
                          inductor_default_autotune_warmup=0, inductor_default_autotune_rep=0):
            yield
    finally:
        with _TRITON_CPU.lock:
            _TRITON_CPU.active -= 1
            if not _TRITON_CPU.active:
                triton_utils.triton_hash_with_backend = saved_hash


#: libdevice functions Inductor's own kernels call (RMSNorm's rsqrt, ...) that the Triton
#: interpreter leaves as empty stubs; under the interpreter they forward to tl.math.
_LIBDEVICE_VIA_TL_MATH = ("rsqrt", "sqrt", "exp", "exp2", "log", "log2", "cos", "sin", "erf",
                          "floor", "ceil", "abs")


def _interpreted_libdevice() -> None:
    """Point the interpreter's empty libdevice stubs at ``tl.math`` (once per process; only
    reached with ``TRITON_INTERPRET=1``, where no compiled kernel uses libdevice)."""
    from triton.language import math as tl_math
    from triton.language.extra import libdevice

    if getattr(libdevice, "_kvarn_interpreted", False):
        return
    for name in _LIBDEVICE_VIA_TL_MATH:
        if hasattr(libdevice, name) and hasattr(tl_math, name):
            # resolved at call time: the interpreter patches tl.math while a kernel runs
            setattr(libdevice, name, lambda *a, _n=name: getattr(tl_math, _n)(*a))
    libdevice._kvarn_interpreted = True


def device_identity(device: torch.device | str) -> tuple[str, str]:
    """(device name, capability) keying autotune results, e.g. ("NVIDIA H100", "sm90")."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return torch.cuda.get_device_name(index), f"sm{major}{minor}"
    return (platform.processor() or platform.machine() or device.type), device.type
