"""The Inductor lowering of ``kvarn::attention`` (see the package docstring for the paths).

Choices, all bound to the same flattened inputs ``[q, *buffers(, mask), rot(, rot_v)]``
(``rot``: the head-dim rotation as a graph constant; ``rot_v``: the values' own rotation,
``rotation_matrix(Dv)``, only for a cache whose values have another head dim Dv than the
keys, e.g. multi-head latent attention decompressed, D = 192 and Dv = 128: the tile
region's output is rotated back with it, and the output is [B, Hq, Tq, Dv]):

* ``reference`` - :data:`REFERENCE`, an ``ExternKernelChoice`` created at import under the
  unique name ``kvarn_attention_reference``: generated code calls
  ``extern_kernels.kvarn_attention_reference(q, *buffers, n_buffers=…, …)``, i.e. the op's
  own device implementation (on CUDA one Triton launch: ``kernels.kvarn_attention``).
  Offered on every path but ``split`` and ``dense`` (the fallback).
* ``dense`` - ``decompose.attention_dense`` through Inductor's ``SubgraphTemplate``: traced
  with make_fx, benchmarked as a compiled subgraph, and inlined when it wins, so the
  output code holds Inductor-generated kernels (C++ on CPU) and no extern call.
* ``shared`` - the same decomposition compiled by Inductor as a graph of its own, once per
  input geometry, and called as an extern (``extern_kernels.kvarn_attention_shared``):
  every layer of a model shares one compiled graph, so compile time does not grow with
  the number of layers (what ``auto`` offers against ``reference`` where templates cannot
  run).
* ``split`` - ``decompose.attention_split``: like ``dense``, but the tile region is the
  ``kvarn::tile_partials_`` op, lowered by ``lowering/tiles.py`` (templates).

Benchmark inputs (``input_gen_fns``) are a realistic packed cache: valid codes, positive
scales, lengths/committed/n_tiles consistent with each other and within capacity.
"""

from __future__ import annotations

import functools
import threading

import torch

from kvarn_compile.lowering import decompose
from kvarn_compile.ops import dispatch
from kvarn_compile.lowering.decisions import (
    current_path, finish_decision, record_decision, tune_key,
)
from kvarn_compile.state import BASE_FIELDS, FP8_FACTOR_FIELDS, StateLayout

__all__ = ["lower_attention", "externs", "attention_input_gen_fns", "ATTENTION_OP_NAME"]

ATTENTION_OP_NAME = "kvarn_attention"


def _reference_flat(*args: torch.Tensor, n_buffers: int, has_mask: bool, scale: float,
                    causal: bool, window: int) -> torch.Tensor:
    """The eager op with flattened tensor arguments (the extern kernel's calling convention).

    ``args`` = ``(q, *buffers[, mask], rot[, rot_v])``; the rotations (shared with the
    decompositions' inputs) are not needed here: the op rotates by itself.
    """
    q, buffers = args[0], list(args[1:1 + n_buffers])
    mask = args[1 + n_buffers] if has_mask else None
    if q.device.type == "cpu":      # the op's CPU kernel itself, without the op's dispatch
        return dispatch.attention_cpu(q, buffers, mask, scale, causal, window)
    return torch.ops.kvarn.attention.default(q, buffers, mask, scale, causal, window).contiguous()


#: (input sizes, strides, dtypes, devices, options) -> the dense decomposition compiled once
_SHARED: dict[tuple, object] = {}
_SHARED_LOCK = threading.Lock()


def _shared_flat(*args: torch.Tensor, n_buffers: int, has_mask: bool, scale: float,
                 causal: bool, window: int) -> torch.Tensor:
    """``decompose.attention_dense`` compiled by Inductor once per distinct input geometry
    and options, then called by every site that has them (all layers of a model share one
    compiled graph instead of inlining one copy each: the ``shared`` choice)."""
    kwargs = dict(n_buffers=n_buffers, has_mask=has_mask, scale=scale, causal=causal,
                  window=window)
    key = (tuple((tuple(a.shape), a.stride(), a.dtype, a.device) for a in args),
           tuple(sorted(kwargs.items())))
    fn = _SHARED.get(key)
    if fn is None:
        from kvarn_compile._torch_compat import compile_function

        with _SHARED_LOCK:
            fn = _SHARED.get(key)
            if fn is None:
                fn = compile_function(functools.partial(decompose.attention_dense, **kwargs),
                                      [a.detach() for a in args])
                _SHARED[key] = fn
    return fn(*args).contiguous()


_EXTERNS: dict[str, object] = {}


def externs() -> dict[str, object]:
    """The extern choices of this lowering, created once (ExternKernelChoice names are global)."""
    if not _EXTERNS:
        from kvarn_compile._torch_compat import inductor

        ind = inductor()
        for label, fn in (("reference", _reference_flat), ("shared", _shared_flat)):
            name = f"kvarn_attention_{label}"
            _EXTERNS[label] = ind.extern_choice(fn, name, has_out_variant=False)
    return _EXTERNS


def attention_input_gen_fns(buffer_shapes: list[list[int]], has_mask: bool,
                            mask_dtype: torch.dtype | None,
                            mask_length: int | None = None) -> dict[int, object]:
    """Realistic benchmark inputs for ``[q, *buffers(, mask), rot(, rot_v)]`` (index -> fn(ir
    node)); ``rot_v`` where the values' head dim (sink_v's last size) differs from the keys'.

    Valid codes (random bytes), positive scales, and counters that agree with each other:
    n_tiles between half and full tile capacity, lengths = sink + tiles + a partial tail,
    never beyond the capacity or the mask (the reference op rejects such a cache, and an
    empty cache would benchmark nothing).
    """
    from kvarn_compile.lowering.tiles import fake_tile_fill

    layout = StateLayout.of(buffer_shapes)
    shape = lambda name: buffer_shapes[layout.index(name)]  # noqa: E731
    bsz, _, s, d = shape("sink_k")
    n_max = shape("k_codes")[2]
    g = shape("k_col_scale")[-1]
    w = shape("tail_k")[2]
    tiles = fake_tile_fill(n_max, g, bsz)
    capacity = s + n_max * g        # the smallest max_len these buffers can come from
    # a partly filled tail after the tiles, all within capacity (and within the mask)
    lengths = [min(s + n * g + (w // 2 if n < n_max else 0), capacity) for n in tiles]
    if mask_length is not None:
        lengths = [min(n, mask_length) for n in lengths]
        tiles = [min(t, max(n - s, 0) // g) for t, n in zip(tiles, lengths)]

    def like(node, values):
        return torch.tensor(values, dtype=node.get_dtype(), device=node.get_device())

    def uniform(lo: float, hi: float):
        def gen(node):
            t = torch.empty(*node.get_size(), dtype=torch.float32, device=node.get_device())
            return t.uniform_(lo, hi).to(node.get_dtype())
        return gen

    def normal(node):
        return torch.randn(*node.get_size(), device=node.get_device()).to(node.get_dtype())

    def codes(node):
        return torch.randint(0, 256, tuple(node.get_size()), dtype=torch.uint8,
                             device=node.get_device())

    fns: dict[int, object] = {}
    for i, name in enumerate(layout.names):
        if name.endswith("codes"):
            fn = codes
        elif name in ("k_row_scale", "v_row_scale"):
            fn = uniform(0.01, 0.1)
        elif name in ("k_col_scale", "v_col_scale"):
            fn = uniform(0.75, 2.0)
        elif name in ("k_row_zero", "v_row_zero"):
            fn = uniform(-0.2, 0.2)
        elif name in ("lengths", "committed"):
            fn = lambda node: like(node, lengths)  # noqa: E731
        elif name == "n_tiles":
            fn = lambda node: like(node, tiles)  # noqa: E731
        elif name == "capacity":
            fn = lambda node: like(node, [capacity] * bsz)  # noqa: E731
        elif name in FP8_FACTOR_FIELDS:
            fn = uniform(0.5, 1.5)     # fp8 per-vector factors
        elif name in BASE_FIELDS:
            fn = normal                # sink / tail rows
        else:                          # key frames: a mix of plain and rotated tiles
            fn = lambda node: torch.randint(0, 2, tuple(node.get_size()), dtype=torch.uint8,  # noqa: E731
                                            device=node.get_device())
        fns[1 + i] = fn
    if has_mask:
        def mask_fn(node):
            if mask_dtype == torch.bool:
                return torch.ones(*node.get_size(), dtype=torch.bool, device=node.get_device())
            return torch.zeros(*node.get_size(), dtype=node.get_dtype(), device=node.get_device())
        fns[1 + len(buffer_shapes)] = mask_fn
    from kvarn_compile.quant.rotation import rotation_matrix

    # Python data, not a tensor: the generators also run under fake mode (layout inference)
    def rot_fn_of(dim: int):
        values = rotation_matrix(dim).tolist()

        def rot_fn(node):
            return torch.tensor(values, dtype=torch.float32, device=node.get_device())
        return rot_fn

    at = 1 + len(buffer_shapes) + int(has_mask)
    fns[at] = rot_fn_of(d)
    dv = shape("sink_v")[-1]
    if dv != d:
        fns[at + 1] = rot_fn_of(dv)
    return fns


def _decomposition_choice(label: str, fn, inputs: list, kwargs: dict, gen_fns: dict):
    """A SubgraphTemplate choice running ``fn(*inputs, **kwargs)`` as an Inductor subgraph.

    Like ``SubgraphTemplate.generate_custom_op_choices``, but traces symbolically only when
    the compile has a shape environment: ``compile_fx`` called from a custom backend with
    real example inputs (``kvarn_backend``) runs with a fake mode without one.
    """
    import functools

    from kvarn_compile._torch_compat import inductor

    ind = inductor()

    def make_fx_graph(*args):
        mode = "symbolic" if ind.V.fake_mode.shape_env is not None else "fake"
        return ind.make_fx(functools.partial(fn, **kwargs),
                           decomposition_table=ind.select_decomp_table(), tracing_mode=mode)(*args)

    with ind.V.fake_mode:
        example = [ind.ir.ir_node_to_tensor(n) for n in inputs]
        out = fn(*example, **kwargs)
    layout = ind.ir.FixedLayout(out.device, out.dtype, list(out.shape), list(out.stride()))
    choice = ind.SubgraphTemplate(name=ATTENTION_OP_NAME).generate(
        name=f"{ATTENTION_OP_NAME}_{label}", input_nodes=inputs, layout=layout,
        make_fx_graph=make_fx_graph, description=f"kvarn decomposition {fn.__name__}",
        input_gen_fns=gen_fns)
    choice.kvarn_spec = {"choice": label}
    return choice


def cpu_kernel_covers(q, buffers) -> bool:
    """True when, on CPU, the op's implementation for these static shapes is the C++ kernel
    (``ops/dispatch.py``: the decode step up to ``CPU_KERNEL_MAX_QUERIES`` queries, the
    multi-query kernel beyond, e.g. a prefill chunk; kernel built, head dim / dtypes / bits
    it reads, no fp8 scales). Such a site lowers to one extern call: the kernel is what the
    op runs, and inlining the decomposition per layer costs lowering and codegen time (and
    runs slower: it dequantizes every tile slot for every query).
    """
    from kvarn_compile._torch_compat import static_ints
    from kvarn_compile.kernels.cpu import attention as cpu_attention
    from kvarn_compile.state import Geometry, unpack

    if q.get_device().type != "cpu" or static_ints(q.get_size()) is None:
        return False
    f = unpack(list(buffers))
    if f.layout.fp8_factors:
        return False
    geo = Geometry.of(f, size=lambda n: static_ints(n.get_size()))
    if (geo.key_bits, geo.value_bits) not in cpu_attention.SUPPORTED_BITS or not \
            cpu_attention.supports(geo.head_dim, f.k.row_scale.get_dtype(), f.sink_k.get_dtype(),
                                   value_head_dim=geo.value_head_dim):
        return False
    return cpu_attention.available()


def lower_attention(q, buffers, mask, scale, causal, window):
    """User lowering of ``torch.ops.kvarn.attention.default``; None falls back to the op."""
    from kvarn_compile import autotune
    from kvarn_compile._torch_compat import triton_templates_available, inductor, static_ints
    from kvarn_compile.lowering.tiles import split_max_for

    ind = inductor()
    buffers = list(buffers)
    has_mask = mask is not None
    nodes = [q, *buffers, *([mask] if has_mask else [])]
    shapes = [static_ints(n.get_size()) for n in nodes]
    layout = StateLayout.of(buffers)
    if any(s is None for s in shapes):
        return None        # symbolic shapes: the op itself (a fallback kernel)
    device = q.get_device()
    d = shapes[0][-1]
    b_shapes = shapes[1:1 + len(buffers)]
    dv = b_shapes[layout.index("sink_v")][-1]     # the values' head dim (the output's)
    from kvarn_compile.quant.rotation import rotation_matrix

    rots = [ind.V.graph.add_tensor_constant(rotation_matrix(d, device), name="kvarn_rotation")]
    if dv != d:   # values of another head dim: their own rotation, a trailing input
        rots.append(ind.V.graph.add_tensor_constant(rotation_matrix(dv, device),
                                                    name="kvarn_rotation_v"))
    inputs = list(ind.realize_inputs(*nodes, *rots))
    path = current_path()
    bsz, heads, n_max = b_shapes[layout.index("k_codes")][:3]
    kwargs = dict(n_buffers=len(buffers), has_mask=has_mask, scale=float(scale),
                  causal=bool(causal), window=int(window))
    at = layout.index
    key = tune_key(ATTENTION_OP_NAME, q=q, k_codes=buffers[at("k_codes")],
                   k_col_scale=buffers[at("k_col_scale")], v_codes=buffers[at("v_codes")],
                   row_scale=buffers[at("k_row_scale")], v_col_scale=buffers[at("v_col_scale")])
    # on a GPU, auto weighs the split decomposition (its templates autotuned) against the
    # op's own kernel, which runs the whole attention in one launch (kvarn_attention)
    on_gpu = path == "auto" and device.type == "cuda" and triton_templates_available(device)
    if path == "auto" and not on_gpu and triton_templates_available(device):
        path = "split"
    elif path == "auto" and not on_gpu and cpu_kernel_covers(q, buffers):
        path = "reference"      # the C++ kernel: one extern call, nothing inlined or tuned
    replay = autotune.DB.lookup(key) if key is not None and path == "auto" else None
    # auto: the op's own kernels against the decomposition compiled once and shared by
    # every site of this geometry (inlining a copy per layer costs lowering and code
    # generation time in every layer)
    wanted = {"auto": ("split", "reference") if on_gpu else ("reference", "shared"),
              "reference": ("reference",), "dense": ("dense",), "shared": ("shared",),
              "split": ("split",)}[path]
    if replay is not None:
        wanted = tuple(c for c in wanted if c == replay.get("choice")) or wanted
        if wanted != (replay.get("choice"),):
            replay = None

    gen_fns = attention_input_gen_fns(b_shapes, has_mask, mask.get_dtype() if has_mask else None,
                                      shapes[-1][-1] if has_mask else None)
    choices: list = []
    if "dense" in wanted:
        choices.append(_decomposition_choice("dense", decompose.attention_dense, inputs, kwargs,
                                             gen_fns))
    if "split" in wanted:
        split_max = split_max_for(device, bsz * heads, n_max)
        choices.append(_decomposition_choice("split", decompose.attention_split, inputs,
                                             dict(kwargs, split_max=split_max), gen_fns))
    for label in ("shared", "reference"):
        if label in wanted:
            # [B, Hq, Tq, Dv], contiguous: the op's output (the values' head dim)
            layout = choices[0].layout if choices else ind.ir.FixedLayout(
                device, q.get_dtype(), [*q.get_size()[:3], dv])
            choice = externs()[label].bind(inputs, layout, **kwargs)
            choice.kvarn_spec = {"choice": label}
            choices.append(choice)
    layout = choices[0].layout
    decision = record_decision(ATTENTION_OP_NAME, key, choices, inputs, replayed=replay is not None)
    if len(choices) == 1:          # forced or replayed: no benchmark, no extra subgraph compile
        choice, node = choices[0], None
    else:
        node, choice = ind.select_algorithm(ATTENTION_OP_NAME, choices, inputs, layout,
                                                     input_gen_fns=gen_fns)
    finish_decision(decision, choice)
    if getattr(choice, "gm", None) is not None:   # a decomposition won: inline its IR
        # (with the lowering's own TensorBoxes: pointwise lowerings need boxes, not storages)
        return ind.inline_subgraph_to_ir_nodes(choice.gm, [*nodes, *rots], ATTENTION_OP_NAME)
    return node if node is not None else choice.output_node()
