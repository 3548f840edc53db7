"""The Inductor lowerings of ``kvarn::latent_attention`` and ``kvarn::latent_tile_partials_``.

``kvarn::latent_attention`` (absorbed multi-head latent attention over a latent state):

* CUDA (or CPU tensors in the CPU Triton mode, tests), static shapes: inlined as
  ``decompose.latent_attention_split`` - the exact region (sink + tail) and the merges as
  Inductor-generated code, the packed tiles behind the internal op
  ``kvarn::latent_tile_partials_`` (per key frame and split), lowered below;
* everywhere else (CPU, symbolic shapes, ``KVARN_LOWERING_PATH=reference``, a state the
  template cannot read: other code widths, a tile length below 16 or not a power of two):
  no lowering, the op stays one fallback call (on CPU: its C++ kernel,
  ``ops.dispatch.latent_attention_cpu``, as without the lowering; on CUDA its own Triton
  path). Any other path than ``reference`` means the split decomposition here.

``kvarn::latent_tile_partials_`` (see ``ops/library.py``; its reference
``ops.attention.latent_tile_partials``):

* the ``kvarn_latent`` template (``templates/kvarn_latent.py.jinja``, whose tile loop is
  ``kernels/triton/latent_attention._latent_range``, the standalone kernel's own) in the
  launcher's default config (``latent_attention.default_config``) and one or two
  alternatives (more with ``KVARN_AUTOTUNE=autotune`` / ``max_autotune``), where it can read
  the inputs (static shapes, tiles contiguous inside, power-of-two G >= 16, 2/4/8-bit codes,
  fp16/bf16/fp32 scales or fp8 with their factors);
* ``kvarn_latent_tile_partials_torch``, the op's torch reference as an extern (always on
  CUDA and plain CPU; the fallback that is always correct);
* CPU tensors in the CPU Triton mode: the template alone, two configs, run by the Triton
  interpreter (the torch extern would always win there).

A winner recorded in :mod:`kvarn_compile.autotune` for the same key is replayed as the only
choice. Every lowering is logged in ``lowering.DECISIONS`` (op ``kvarn_latent_attention``:
the one choice ``split``; op ``kvarn_latent_tile_partials``: the template configs and the
extern, benchmarked).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import types

import torch

from kvarn_compile.lowering import decompose
from kvarn_compile.lowering.decisions import (
    Offers, current_path, finish_decision, record_decision, tune_key,
)
from kvarn_compile.lowering.tiles import _block, _code_bits
from kvarn_compile.ops.attention import LATENT_TILE_ARGS
from kvarn_compile.state import StateLayout

__all__ = ["lower_latent_attention", "lower_latent_tile_partials", "externs", "latent_template",
           "kvarn_latent_grid", "latent_configs", "LatentConfig", "latent_tile_input_gen_fns",
           "LATENT_OP_NAME", "LATENT_TILE_OP_NAME", "TEMPLATE_FILE"]

LATENT_OP_NAME = "kvarn_latent_attention"
LATENT_TILE_OP_NAME = "kvarn_latent_tile_partials"
TEMPLATE_FILE = "kvarn_latent.py.jinja"

#: Query rows per program of the template's default config (``default_config``'s block_m),
#: used to size SPLIT_MAX before the configs are known.
_ROWS_PER_PROGRAM = 16


# ------------------------------------------------------------------------------ template
def kvarn_latent_grid(batch_kv_heads, rows, meta, *, cdiv):
    """How is this kernel parallelized?

    Grid (B * H, NF * SPLIT, cdiv(GROUP_Q * TQ, BLOCK_M)). Program (b * H + h, f * SPLIT + s,
    mb) packs BLOCK_M query rows m = hg * TQ + t of kv head h (its GROUP_Q query heads x TQ
    positions), so each packed latent tile is read once per block of query heads. NF = 1:
    the tiles the block can see, [min kv_lo // G, cdiv(max kv_hi, G)) within n_tiles[b],
    are cut into SPLIT contiguous ranges; NF = 2 (per-tile key frames): program f walks its
    share of frame f's tile list (IDS/CNT) with the queries of that frame. Each writes its
    normalized partial and its lse to slot (f, s); the caller merges them by lse
    (Inductor-generated code, ``decompose.merge_latent_frames``).
    """
    return (batch_kv_heads, meta["NF"] * meta["SPLIT"], cdiv(rows, meta["BLOCK_M"]))


@functools.lru_cache(maxsize=None)
def latent_template():
    from kvarn_compile._torch_compat import inductor
    from kvarn_compile.lowering.tile_templates import template_source

    ind = inductor()
    return ind.triton_template("kvarn_latent", ind.SymbolicGridFn(kvarn_latent_grid),
                               template_source(TEMPLATE_FILE))


@dataclasses.dataclass(frozen=True)
class LatentConfig:
    """One config of the ``kvarn_latent`` template (``latent_tile_partials``'s options)."""

    block_m: int      # query rows per program (power of two >= 16)
    block_n: int      # tokens per inner step (divides G)
    block_dc: int     # latent channels per block of the batched matmuls (divides BLOCK_D)
    split: int        # splits per frame (<= SPLIT_MAX)
    num_warps: int
    prefetch: bool = True

    def template_kwargs(self) -> dict[str, int]:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_DC": self.block_dc,
                "SPLIT": self.split, "PREFETCH": int(self.prefetch), "num_warps": self.num_warps,
                "num_stages": 1}


def latent_configs(mode: str, *, d: int, rows: int, group: int, max_split: int,
                   device: torch.device) -> list[LatentConfig]:
    """The template configs to offer, the default first.

    The default is the standalone launcher's (``latent_attention.default_config``: at
    D = 512 16-row blocks, 32-token steps, two 256-channel blocks, 8 warps, no spills on
    sm_90) with SPLIT = SPLIT_MAX. ``default`` mode adds half the splits (fewer partials to
    merge) and one-step-per-64-tokens (fewer steps, a few spilled bytes at D = 512);
    ``interpret`` (CPU Triton mode) the default and one other; ``autotune`` / ``exhaustive``
    a product of steps, splits, warps and channel blocks. Configs that do not fit (BLOCK_N
    not dividing G, a channel block not dividing BLOCK_D) are dropped."""
    from kvarn_compile.kernels.triton.latent_attention import default_config

    cfg = default_config(d, rows, device)
    block_d = _block(d)
    base = LatentConfig(block_m=cfg["block_m"], block_n=min(group, cfg["block_n"]),
                        block_dc=min(block_d, cfg["block_dc"]), split=max_split,
                        num_warps=cfg["num_warps"])
    half = max(1, max_split // 2)
    if mode == "interpret":
        candidates = [base, dataclasses.replace(base, block_n=16 if base.block_n != 16 else group,
                                                block_dc=max(16, base.block_dc // 2), split=half)]
    elif mode == "default":
        candidates = [base, dataclasses.replace(base, split=half),
                      dataclasses.replace(base, block_n=min(group, 64))]
    else:
        splits = sorted({max_split, half, max(1, max_split // 4)})
        dcs = sorted({base.block_dc, max(16, base.block_dc // 2)})
        warps = (4, 8) if mode == "autotune" else (2, 4, 8)
        steps = (16, 32, 64) if mode == "autotune" else (16, 32, 64, 128)
        candidates = [base] + [dataclasses.replace(base, block_n=bn, split=s, num_warps=w,
                                                   block_dc=dc)
                               for bn, s, w, dc in itertools.product(steps, splits, warps, dcs)]
        if mode == "exhaustive":
            candidates += [dataclasses.replace(c, prefetch=False) for c in list(candidates)]
    keep = [c for c in candidates if c.block_n <= group and group % c.block_n == 0
            and block_d % c.block_dc == 0 and 1 <= c.split <= max_split]
    return list(dict.fromkeys(keep))


# ------------------------------------------------------------------------------ extern choice
def _present(has: dict[str, bool]) -> list[str]:
    """The names of ``LATENT_TILE_ARGS`` an extern receives (the None ones dropped)."""
    return [n for n in LATENT_TILE_ARGS if has.get(n, True)]


def _presence(frames: bool, factors: bool, bias: bool) -> dict[str, bool]:
    out = {n: frames for n in ("q_plain", "tile_ids", "tile_count")}
    out.update({n: factors for n in ("k_row_factor", "k_col_factor", "v_row_factor", "v_col_factor")})
    out["bias"] = bias
    return out


def _assemble(tensors, frames: bool, factors: bool, bias: bool):
    """Flat extern arguments (present tensors, then lse_part) -> the op's positional arguments."""
    given = dict(zip(_present(_presence(frames, factors, bias)), tensors))
    return (*(given.get(n) for n in LATENT_TILE_ARGS), tensors[-1])


def _latent_tile_partials_torch_flat(*tensors: torch.Tensor, frames: bool, factors: bool,
                                     bias: bool, scale: float, split_max: int) -> torch.Tensor:
    return torch.ops.kvarn.latent_tile_partials_.default(
        *_assemble(tensors, frames, factors, bias), scale, split_max)


def _create(*nodes, frames: bool, factors: bool, bias: bool, scale: float, split_max: int):
    """IR of the extern choice: a FallbackKernel of the mutable op (tracks the lse write)."""
    from kvarn_compile._torch_compat import inductor

    return inductor().ir.FallbackKernel.create(torch.ops.kvarn.latent_tile_partials_.default,
                                               *_assemble(nodes, frames, factors, bias), scale,
                                               split_max)


_EXTERNS: dict[str, object] = {}


def externs() -> dict[str, object]:
    """The extern choice, created once at import of the lowering (a process-wide name)."""
    if not _EXTERNS:
        from kvarn_compile._torch_compat import inductor

        name = "kvarn_latent_tile_partials_torch"
        _EXTERNS[name] = inductor().extern_choice(_latent_tile_partials_torch_flat, name,
                                                  has_out_variant=False, kernel_creator=_create)
    return _EXTERNS


# ------------------------------------------------------------------------------ autotune inputs
def latent_tile_input_gen_fns(shapes: dict[str, list[int]], group: int, names: list[str]
                              ) -> dict[int, object]:
    """Realistic benchmark inputs (index -> fn(ir node) -> tensor) for ``names`` (the present
    ``LATENT_TILE_ARGS``, then ``lse_part``): those of ``tiles.tile_input_gen_fns`` (scales,
    fill, bounds, bias, lse), fp8 factors around 1, and per-frame tile lists built by
    ``frame_tile_lists`` from a random mix of frames over the same fill (random ids would
    read outside the tiles)."""
    from kvarn_compile.lowering.tiles import fake_tile_fill, tile_input_gen_fns

    fns = tile_input_gen_fns(shapes, group, [n if n not in ("tile_ids", "tile_count") else "-"
                                             for n in names])
    batch, heads, n_max = shapes["k_codes"][:3]
    fill = fake_tile_fill(n_max, group, batch)

    @functools.lru_cache(maxsize=None)
    def lists(device: str):
        from kvarn_compile.kernels.triton.latent_attention import frame_tile_lists

        gen = torch.Generator().manual_seed(4321 + n_max)
        plain = torch.randint(0, 2, (batch, heads, n_max), generator=gen, dtype=torch.uint8)
        ids, count = frame_tile_lists(plain, torch.tensor(fill))
        return ids.to(device), count.to(device)

    def factors(node):
        t = torch.empty(*node.get_size(), dtype=torch.float32, device=node.get_device())
        return t.uniform_(0.5, 1.5).to(node.get_dtype())

    for i, n in enumerate(names):
        if n == "tile_ids":
            fns[i] = lambda node: lists(str(node.get_device()))[0].to(node.get_dtype())  # noqa: E731
        elif n == "tile_count":
            fns[i] = lambda node: lists(str(node.get_device()))[1].to(node.get_dtype())  # noqa: E731
        elif n.endswith("_factor"):
            fns[i] = factors
    return fns


# ------------------------------------------------------------------------------ tile lowering
def _template_reads(node_of: dict) -> bool:
    """Whether the template can read these tile inputs (by ``LATENT_TILE_ARGS`` name; the
    state's members of the same names): static shapes, tiles contiguous inside, power-of-two
    G >= 16, 2/4/8-bit codes, fp16/bf16/fp32 scales or fp8 ones with their factors (one
    tile stride for the four), tile lists of unit stride over N."""
    from kvarn_compile._torch_compat import static_ints
    from kvarn_compile.lowering.tiles import _tile_contiguous

    scales = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)
    tiles = [node_of[n] for n in LATENT_TILE_ARGS[3:11]]
    if not all(_tile_contiguous(t) for t in tiles):     # (False for symbolic sizes too)
        return False
    group = int(node_of["k_col_scale"].get_size()[-1])
    kb = _code_bits(node_of["k_codes"], group)
    vb = _code_bits(node_of["v_codes"], int(node_of["v_col_scale"].get_size()[-1]))
    if group < 16 or group & (group - 1) or kb not in (2, 4, 8) or vb not in (2, 4, 8):
        return False
    if any(node_of[n].get_dtype() != torch.uint8 for n in ("k_codes", "v_codes")):
        return False
    factors = [node_of[n] for n in ("k_row_factor", "k_col_factor", "v_row_factor",
                                    "v_col_factor") if n in node_of]
    for t in tiles:
        if t.get_dtype() != torch.uint8 and (t.get_dtype() not in scales or (
                t.get_dtype() == torch.float8_e4m3fn and not factors)):
            return False
    if factors:             # one tile stride for the four (the loop takes one)
        strides = [static_ints(t.get_stride()) for t in factors]
        if any(s is None for s in strides) or len({s[2] for s in strides}) != 1 \
                or any(t.get_dtype() not in scales[:3] for t in factors):
            return False
    if "tile_ids" in node_of:
        ids = node_of["tile_ids"]
        stride, size = static_ints(ids.get_stride()), static_ints(ids.get_size())
        if stride is None or size is None or (stride[-1] != 1 and size[-1] > 1):
            return False
    return True


def lower_latent_tile_partials(q_rot, q_plain, q_pe_rot, k_codes, k_row_scale, k_row_zero,
                               k_col_scale, v_codes, v_row_scale, v_row_zero, v_col_scale,
                               k_row_factor, k_col_factor, v_row_factor, v_col_factor, tile_ids,
                               tile_count, n_tiles, kv_lo, kv_hi, bias, lse_part, scale,
                               split_max):
    """User lowering of ``kvarn::latent_tile_partials_.default`` (see the module doc)."""
    from kvarn_compile import autotune
    from kvarn_compile._torch_compat import (
        inductor, kvarn_sources_hash, static_ints, triton_templates_available,
    )
    from kvarn_compile.lowering import heuristics

    ind = inductor()
    values = (q_rot, q_plain, q_pe_rot, k_codes, k_row_scale, k_row_zero, k_col_scale, v_codes,
              v_row_scale, v_row_zero, v_col_scale, k_row_factor, k_col_factor, v_row_factor,
              v_col_factor, tile_ids, tile_count, n_tiles, kv_lo, kv_hi, bias)
    given = dict(zip(LATENT_TILE_ARGS, values))
    frames, factors, has_bias = tile_ids is not None, k_row_factor is not None, bias is not None
    names = _present(_presence(frames, factors, has_bias))
    inputs = ind.realize_inputs(*(given[n] for n in names), lse_part)
    ind.freeze_template_inputs(inputs)
    names = names + ["lse_part"]
    node_of = dict(zip(names, inputs))
    device = q_rot.get_device()
    sizes = static_ints(q_rot.get_size())
    nf = 2 if frames else 1
    layout = ind.ir.FixedLayout(device, torch.float32,
                                [*q_rot.get_size()[:3], nf, split_max, q_rot.get_size()[-1]])
    kwargs = {"frames": frames, "factors": factors, "bias": has_bias, "scale": float(scale),
              "split_max": int(split_max)}
    key = tune_key(LATENT_TILE_OP_NAME, q=q_rot, k_codes=k_codes, k_col_scale=k_col_scale,
                   v_codes=v_codes, row_scale=k_row_scale, v_col_scale=v_col_scale)
    offers = Offers(autotune.DB.lookup(key) if key is not None else None)
    choices, offer = offers.choices, offers.offer
    interpreted = device.type == "cpu"     # templates on CPU tensors: the Triton interpreter
    torch_spec = {"choice": "torch"}

    def add_torch() -> None:
        choices.append(externs()["kvarn_latent_tile_partials_torch"].bind(inputs, layout, **kwargs))

    shapes = {"k_codes": static_ints(k_codes.get_size()) or [0, 0, 0]}
    template_ok = (triton_templates_available(device) and sizes is not None and key is not None
                   and all(static_ints(t.get_size()) is not None for t in inputs)
                   and all(static_ints(t.get_stride()) is not None for t in inputs))
    if template_ok:
        b, hq, tq, d = sizes
        heads, group = shapes["k_codes"][1], int(k_col_scale.get_size()[-1])
        dv = int(v_col_scale.get_size()[-1])
        kb, vb = _code_bits(k_codes, group), _code_bits(v_codes, dv)
        template_ok = _template_reads(node_of)
    # Under the interpreter the torch extern would always win the benchmark, so CPU Triton
    # mode lets the template configs compete alone.
    if not (template_ok and interpreted):
        offer(torch_spec, add_torch)
    if template_ok:
        from kvarn_compile.kernels import CUDA_PRECISION

        rows = hq // heads * tq
        precision = "'ieee'" if interpreted else f"'{CUDA_PRECISION}'"
        common = dict(GROUP_Q=hq // heads, D=d, BLOCK_D=_block(d), DV=dv, BLOCK_DV=_block(dv),
                      G=group, K_BITS=kb, V_BITS=vb, NF=nf, SPLIT_MAX=int(split_max),
                      HAS_BIAS=has_bias, HAS_FACTORS=factors, INPUT_PRECISION=precision,
                      SM_SCALE=float(scale), KVARN_SRC=int(kvarn_sources_hash()[:12], 16))
        mode = "interpret" if interpreted else heuristics.tune_mode()
        for cfg in latent_configs(mode, d=d, rows=rows, group=group, max_split=int(split_max),
                                  device=device):
            opts = cfg.template_kwargs()
            offer({"choice": "latent", "config": opts}, lambda opts=opts:
                  latent_template().maybe_append_choice(
                      choices, input_nodes=inputs, layout=layout, mutated_inputs=[inputs[-1]],
                      call_sizes=[b * heads, rows], **common, **opts))
    offers.or_else(torch_spec, add_torch)
    gen_fns = latent_tile_input_gen_fns(shapes, int(k_col_scale.get_size()[-1]), names) \
        if len(choices) > 1 else None
    return offers.select(LATENT_TILE_OP_NAME, key, inputs, layout, gen_fns)


# ------------------------------------------------------------------------------ latent attention
def _trace(fn, inputs: list, kwargs: dict):
    """``fn(*inputs, **kwargs)`` traced by make_fx over the inputs' fake tensors (what
    Inductor's ``SubgraphTemplate`` does, without building a benchmark choice)."""
    from kvarn_compile._torch_compat import inductor

    ind = inductor()
    with ind.V.fake_mode:
        example = []
        for node in inputs:
            node.data.freeze_layout()
            example.append(ind.ir.ir_node_to_tensor(node))
    mode = "symbolic" if ind.V.fake_mode.shape_env is not None else "fake"
    return ind.make_fx(functools.partial(fn, **kwargs), decomposition_table=ind.select_decomp_table(),
                       tracing_mode=mode)(*example)


def lower_latent_attention(q, q_pe, buffers, mask, scale, causal, window):
    """User lowering of ``torch.ops.kvarn.latent_attention.default``; None leaves the op
    as its fallback call (see the module doc)."""
    from kvarn_compile._torch_compat import inductor, static_ints, triton_templates_available
    from kvarn_compile.lowering.tiles import split_max_for
    from kvarn_compile.quant.rotation import rotation_matrix

    buffers = list(buffers)
    has_mask = mask is not None
    nodes = [q, q_pe, *buffers, *([mask] if has_mask else [])]
    shapes = [static_ints(n.get_size()) for n in nodes]
    if any(s is None for s in shapes):
        return None        # symbolic shapes: the op itself
    device = q.get_device()
    if current_path() == "reference" or not triton_templates_available(device):
        return None        # CPU: the op's C++ kernel, one fallback call (CUDA: its Triton path)
    ind = inductor()
    layout = StateLayout.of(buffers)
    if not _template_reads({n: buffers[layout.index(n)] for n in layout.names}):
        return None        # a state the template cannot read: the op's own kernel
    b_shapes = shapes[2:2 + len(buffers)]
    d, r = shapes[0][-1], shapes[1][-1]
    hq, tq = shapes[0][1], shapes[0][2]
    bsz, heads, n_max = b_shapes[layout.index("k_codes")][:3]
    nf = 2 if layout.key_frames else 1
    blocks = -(-(hq // max(heads, 1)) * tq // _ROWS_PER_PROGRAM)
    split_max = split_max_for(device, bsz * heads * nf * blocks, n_max)
    rots = [ind.V.graph.add_tensor_constant(rotation_matrix(d, device), name="kvarn_rotation"),
            ind.V.graph.add_tensor_constant(rotation_matrix(r, device), name="kvarn_rotation_v")]
    inputs = list(ind.realize_inputs(*nodes, *rots))
    at = layout.index
    key = tune_key(LATENT_OP_NAME, q=q, k_codes=buffers[at("k_codes")],
                   k_col_scale=buffers[at("k_col_scale")], v_codes=buffers[at("v_codes")],
                   row_scale=buffers[at("k_row_scale")], v_col_scale=buffers[at("v_col_scale")])
    split = types.SimpleNamespace(kvarn_spec={"choice": "split"}, name="split")
    decision = record_decision(LATENT_OP_NAME, key, [split], inputs, replayed=False)
    gm = _trace(decompose.latent_attention_split, inputs,
                dict(n_buffers=len(buffers), has_mask=has_mask, scale=float(scale),
                     causal=bool(causal), window=int(window), split_max=split_max))
    finish_decision(decision, split)
    return ind.inline_subgraph_to_ir_nodes(gm, [*nodes, *rots], LATENT_OP_NAME)
