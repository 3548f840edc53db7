"""The lowering of ``kvarn::tile_partials_``, the packed-tile region of the attention.

The op (declared with the others in ``ops/library.py``) is used only inside the lowering
of ``kvarn::attention`` (the ``split`` path, see ``lowering/decompose.py``): it isolates
the hot part, the dual-scale attention over the packed tiles, so that Triton templates
can compete for it while everything around it (rotation, the exact sink/tail, the merges)
stays Inductor-generated code.

    kvarn::tile_partials_(Tensor q_rot, Tensor k_codes, Tensor k_row_scale,
        Tensor k_row_zero, Tensor k_col_scale, Tensor v_codes, Tensor v_row_scale,
        Tensor v_row_zero, Tensor v_col_scale, Tensor n_tiles, Tensor kv_lo, Tensor kv_hi,
        Tensor? bias, Tensor(a!) lse_part, float scale, int split_max) -> Tensor o_part

It writes the per-split lse into ``lse_part`` [B, Hq, Tq, SPLIT_MAX] (filled with -inf by
the caller; a kernel may leave unused split slots alone) and returns the normalized
per-split outputs o_part [B, Hq, Tq, SPLIT_MAX, Dv] (flash-decoding partials, in the
values' rotated frame). Dv, the values' head dim (``v_col_scale``'s last size), is D except
for caches whose keys and values differ in width (MLA decompressed: D = 192, Dv = 128); the
templates then score over D and accumulate over Dv (constexprs D / DV).

Choices of its lowering:

* CUDA, static shapes, tiles contiguous inside, power-of-two G, 2/4/8-bit codes: the
  ``kvarn_decode`` template (GQA heads packed with their positions), split-K configs for
  decode-sized row counts and one-split configs otherwise, one choice per tile config of
  :mod:`~kvarn_compile.lowering.heuristics`; plus the standalone Triton kernel
  (``kernels.kvarn_decode_attention``) as an extern choice for one-token decode without a
  mask; the template reads per-tile key frames (``k_plain`` + the un-rotated query);
* always on CUDA and plain CPU: ``kvarn_tile_partials_torch``, the torch implementation
  (the fallback that is always correct);
* CPU tensors in the CPU Triton mode (``_torch_compat.triton_cpu_mode``, tests): the
  template alone, two configs (``heuristics`` mode "interpret"), executed by the
  Triton interpreter.

A winner recorded in :mod:`kvarn_compile.autotune` for the same key is replayed as the only
choice.
"""

from __future__ import annotations

import math

import torch

from kvarn_compile.lowering.decisions import Offers, tune_key
from kvarn_compile.ops.attention import TILE_ARGS

__all__ = ["lower_tile_partials", "externs", "TILE_OP_NAME", "fake_tile_fill", "tile_input_gen_fns",
           "split_max_for"]

TILE_OP_NAME = "kvarn_tile_partials"


# ------------------------------------------------------------------------------ extern choices
def _present(has_frames: bool, has_bias: bool) -> list[str]:
    """The names of ``reference.TILE_ARGS`` an extern choice receives (None ones dropped)."""
    return [n for n in TILE_ARGS
            if not (n in ("q_plain", "k_plain") and not has_frames) and not (n == "bias" and not has_bias)]


def _assemble(tensors, has_frames: bool, has_bias: bool):
    """Flat extern arguments (present tensors, then lse_part) -> the op's positional arguments."""
    given = dict(zip(_present(has_frames, has_bias), tensors))
    return (*(given.get(n) for n in TILE_ARGS), tensors[-1])


def _tile_partials_torch_flat(*tensors: torch.Tensor, has_frames: bool, has_bias: bool,
                              scale: float, split_max: int) -> torch.Tensor:
    return torch.ops.kvarn.tile_partials_.default(*_assemble(tensors, has_frames, has_bias),
                                                  scale, split_max)


def _tile_partials_triton_flat(*tensors: torch.Tensor, has_frames: bool, has_bias: bool,
                               scale: float, split_max: int) -> torch.Tensor:
    return torch.ops.kvarn.tile_partials_triton_.default(
        *_assemble(tensors, has_frames, has_bias), scale, split_max)


def _creator(op_name: str):
    def create(*nodes, has_frames: bool, has_bias: bool, scale: float, split_max: int):
        """IR of an extern choice: a FallbackKernel of the mutable op (tracks the lse write)."""
        from kvarn_compile._torch_compat import inductor

        op = getattr(torch.ops.kvarn, op_name).default
        return inductor().ir.FallbackKernel.create(op, *_assemble(nodes, has_frames, has_bias),
                                                   scale, split_max)
    return create


_EXTERNS: dict[str, object] = {}


def externs() -> dict[str, object]:
    """The extern choices, created once at import of the lowering (unique names)."""
    if not _EXTERNS:
        from kvarn_compile._torch_compat import inductor

        ind = inductor()
        for name, fn, creator in (
                ("kvarn_tile_partials_torch", _tile_partials_torch_flat, _creator("tile_partials_")),
                ("kvarn_tile_partials_triton", _tile_partials_triton_flat,
                 _creator("tile_partials_triton_"))):
            _EXTERNS[name] = ind.extern_choice(fn, name, has_out_variant=False,
                                               kernel_creator=creator)
    return _EXTERNS


# ------------------------------------------------------------------------------ autotune inputs
def fake_tile_fill(n_max: int, group: int, batch: int) -> list[int]:
    """n_tiles per row for benchmarking: a deterministic fill between half and full capacity."""
    gen = torch.Generator().manual_seed(1234 + n_max * 7 + batch)
    lo = max(1, n_max // 2) if n_max else 0
    return torch.randint(lo, n_max + 1, (batch,), generator=gen).tolist() if n_max else [0] * batch


def _bias_kind(bias, tq: int) -> int:
    """The template's HAS_BIAS: 2 where one mask row serves every query row of a batch row
    (a mask shared by the query heads, one query position: a decode step), else 1."""
    from kvarn_compile._torch_compat import static_ints

    return 2 if tq == 1 and static_ints([bias.get_size()[1]]) == [1] else 1


def tile_input_gen_fns(shapes: dict[str, list[int]], group: int, names: list[str]
                       ) -> dict[int, object]:
    """Realistic inputs for benchmarking the tile kernels (index -> fn(ir node) -> tensor).

    ``names``: the inputs in order (present ``reference.TILE_ARGS``, then ``lse_part``).
    Random bytes are valid packed codes at 2/4/8 bits; row/column scales are positive
    (fp16, like a real cache), zero points centred; n_tiles fills the cache between half
    and full capacity (all zeros would benchmark empty loops: bogus winners); kv_lo = 0 and
    kv_hi = n_tiles * G (the decode visibility); the bias is 0 (attend everywhere); key
    frames mix plain and rotated tiles.
    """
    batch, n_max = shapes["k_codes"][0], shapes["k_codes"][2]
    fill = fake_tile_fill(n_max, group, batch)

    def strided(node, values: torch.Tensor) -> torch.Tensor:
        """values (contiguous, the node's size) laid out with the node's own strides: the
        compiled choices index their inputs by those (a bias can be a view into the model's
        mask, rows longer than its size)."""
        size, stride = [int(x) for x in node.get_size()], [int(x) for x in node.get_stride()]
        span = 1 + sum((n - 1) * st for n, st in zip(size, stride)) if all(size) else 0
        base = torch.zeros(span, dtype=values.dtype, device=values.device)
        once = [1 if st == 0 else n for n, st in zip(size, stride)]   # broadcast dims: one copy
        base.as_strided(once, stride).copy_(values[tuple(slice(0, n) for n in once)])
        return base.as_strided(size, stride)

    def positive(lo: float, hi: float):
        def gen(node):
            t = torch.empty(*node.get_size(), dtype=torch.float32, device=node.get_device())
            return strided(node, t.uniform_(lo, hi).to(node.get_dtype()))
        return gen

    def centred(node):
        return strided(node, (torch.randn(*node.get_size(), device=node.get_device()) * 0.1)
                       .to(node.get_dtype()))

    def tiles_filled(node):
        return torch.tensor(fill, dtype=node.get_dtype(), device=node.get_device())

    def bounds(hi: bool):
        def gen(node):
            tq = node.get_size()[1]
            vals = [[f * group if hi else 0] * int(tq) for f in fill]
            return torch.tensor(vals, dtype=node.get_dtype(), device=node.get_device())
        return gen

    def zeros(node):            # (a bool mask: True, attend)
        fill = torch.ones if node.get_dtype() == torch.bool else torch.zeros
        return strided(node, fill(*node.get_size(), dtype=node.get_dtype(),
                                  device=node.get_device()))

    def neg_inf(node):
        return torch.full(node.get_size(), float("-inf"), dtype=node.get_dtype(),
                          device=node.get_device())

    def frames(node):
        return torch.randint(0, 2, tuple(node.get_size()), dtype=torch.uint8,
                             device=node.get_device())

    by_name = {"k_row_scale": positive(0.01, 0.1), "k_row_zero": centred,
               "k_col_scale": positive(0.75, 2.0), "v_row_scale": positive(0.01, 0.1),
               "v_row_zero": centred, "v_col_scale": positive(0.75, 2.0), "k_plain": frames,
               "n_tiles": tiles_filled, "kv_lo": bounds(False), "kv_hi": bounds(True),
               "bias": zeros, "lse_part": neg_inf}
    return {i: by_name[n] for i, n in enumerate(names) if n in by_name}


# ------------------------------------------------------------------------------ lowering
def lower_tile_partials(q_rot, q_plain, k_codes, k_row_scale, k_row_zero, k_col_scale, v_codes,
                        v_row_scale, v_row_zero, v_col_scale, k_plain, n_tiles, kv_lo, kv_hi,
                        bias, lse_part, scale, split_max):
    """User lowering of ``kvarn::tile_partials_.default`` (see the module doc)."""
    from kvarn_compile import autotune
    from kvarn_compile._torch_compat import inductor, static_ints, triton_templates_available
    from kvarn_compile.kernels import CUDA_PRECISION
    from kvarn_compile.lowering import heuristics

    ind = inductor()
    has_frames, has_bias = k_plain is not None, bias is not None
    given = dict(zip(TILE_ARGS, (q_rot, q_plain, k_codes, k_row_scale, k_row_zero, k_col_scale,
                                 v_codes, v_row_scale, v_row_zero, v_col_scale, k_plain, n_tiles,
                                 kv_lo, kv_hi, bias)))
    names = _present(has_frames, has_bias)
    inputs = ind.realize_inputs(*(given[n] for n in names), lse_part)
    ind.freeze_template_inputs(inputs)
    names = names + ["lse_part"]
    node_of = dict(zip(names, inputs))
    device = q_rot.get_device()
    sizes = static_ints(q_rot.get_size())
    b, hq, tq, d = sizes if sizes is not None else (None,) * 4
    dv_size = v_col_scale.get_size()[-1]          # the values' head dim (the output's)
    dv = (static_ints([dv_size]) or [None])[0]
    layout = ind.ir.FixedLayout(device, torch.float32, [*q_rot.get_size()[:3], split_max,
                                                        dv_size])
    kwargs = {"has_frames": has_frames, "has_bias": has_bias, "scale": float(scale),
              "split_max": int(split_max)}
    choices_extern = externs()
    key = tune_key(TILE_OP_NAME, q=q_rot, k_codes=k_codes, k_col_scale=k_col_scale,
                   v_codes=v_codes, row_scale=k_row_scale, v_col_scale=v_col_scale)
    offers = Offers(autotune.DB.lookup(key) if key is not None else None)
    choices, offer = offers.choices, offers.offer
    interpreted = device.type == "cpu"     # templates on CPU tensors: the Triton interpreter
    torch_spec = {"choice": "torch"}

    def add_torch() -> None:
        choices.append(choices_extern["kvarn_tile_partials_torch"].bind(inputs, layout, **kwargs))

    shapes = {"k_codes": static_ints(k_codes.get_size()) or [0, 0, 0]}
    template_ok = (triton_templates_available(device) and sizes is not None and key is not None
                   and dv is not None and all(static_ints(t.get_size()) is not None for t in inputs))
    # Under the interpreter the torch extern would always win the benchmark (the templates
    # run ~20x slower there), so CPU Triton mode lets the templates compete alone.
    if not (template_ok and interpreted):
        offer(torch_spec, add_torch)
    if template_ok:
        from kvarn_compile._torch_compat import kvarn_sources_hash
        from kvarn_compile.kernels.triton.attention import key_part, loop_block_n, phased_decode
        from kvarn_compile.lowering import tile_templates as templates

        heads = shapes["k_codes"][1]
        group = int(k_col_scale.get_size()[-1])
        kb, vb = _code_bits(k_codes, group), _code_bits(v_codes, dv)
        tile_nodes = [node_of[n] for n in TILE_ARGS[2:10]]
        contiguous = all(_tile_contiguous(t) for t in tile_nodes)
        if contiguous and group >= 16 and group & (group - 1) == 0 and kb in (2, 4, 8) \
                and vb in (2, 4, 8) and k_row_scale.get_dtype() != torch.float8_e4m3fn:
            grp = hq // heads
            rows = grp * tq
            precision = "ieee" if interpreted else CUDA_PRECISION
            common = dict(GROUP_Q=grp, D=d, BLOCK_D=_block(d), DV=dv, BLOCK_DV=_block(dv), G=group,
                          K_BITS=kb, V_BITS=vb, SPLIT_MAX=int(split_max),
                          HAS_BIAS=_bias_kind(bias, tq) if has_bias else 0,
                          HAS_K_PLAIN=has_frames, INPUT_PRECISION=f"'{precision}'",
                          SM_SCALE=float(scale), KVARN_SRC=int(kvarn_sources_hash()[:12], 16))
            mode = "interpret" if interpreted else heuristics.tune_mode()
            few = rows <= heuristics.DECODE_ROWS_MAX
            configs = (heuristics.decode_configs(mode, group=group, rows=rows,
                                                 max_split=int(split_max)) if few
                       else heuristics.prefill_configs(
                           mode, group=group, rows=rows,
                           phased=phased_decode(precision, loop_block_n(16, group), kb, dv, vb)))
            for cfg in configs:
                phased = phased_decode(precision, cfg.block_n, kb, dv, vb)
                # a prompt's blocks score the keys in parts (attention.key_part)
                opts = dict(cfg.resolved(phased, dv).template_kwargs(), PHASED=phased,
                            KEY_PART=0 if few else key_part(_block(d)))
                offer({"choice": "decode" if few else "prefill", "config": opts},
                      lambda opts=opts: templates.decode_template().maybe_append_choice(
                          choices, input_nodes=inputs, layout=layout,
                          mutated_inputs=[inputs[-1]], call_sizes=[b * heads, rows],
                          **common, **opts))
            if few and tq == 1 and not has_bias and not interpreted:
                offer({"choice": "triton_kernel"}, lambda: choices.append(
                    choices_extern["kvarn_tile_partials_triton"].bind(inputs, layout, **kwargs)))
    offers.or_else(torch_spec, add_torch)
    gen_fns = tile_input_gen_fns(shapes, int(k_col_scale.get_size()[-1]), names) \
        if len(choices) > 1 else None
    return offers.select(TILE_OP_NAME, key, inputs, layout, gen_fns)


def _block(n: int) -> int:
    """n rounded up to a power of two >= 16 (a template's BLOCK_D / BLOCK_DV)."""
    return max(16, 1 << (n - 1).bit_length())


def _code_bits(codes, row_len: int) -> int:
    """Code width of packed rows of ``row_len`` codes; 0 where the row's bytes hold no whole
    number of bits per code (the templates then decline and the torch choice runs)."""
    nbytes = int(codes.get_size()[-1])
    return nbytes * 8 // row_len if row_len > 0 and (nbytes * 8) % row_len == 0 else 0


def _tile_contiguous(node) -> bool:
    """Contiguous inside one tile (what the shared helpers assume); B/H/N strides are free."""
    from kvarn_compile._torch_compat import static_ints

    size, stride = static_ints(node.get_size()), static_ints(node.get_stride())
    if size is None or stride is None:
        return False
    inner = 2 if len(size) == 5 else 1          # codes: [.., rows, bytes]; scales: [.., n]
    expect = 1
    for s, st in list(zip(reversed(size), reversed(stride)))[:inner]:
        if s != 1 and st != expect:
            return False
        expect *= s
    return True


def split_max_for(device: torch.device, batch_kv_heads: int, tiles: int) -> int:
    """SPLIT_MAX for a lowering: about two waves of programs on CUDA; on CPU 1, or 2 in the
    CPU Triton mode (so the interpreted templates exercise the split merge)."""
    from kvarn_compile._torch_compat import triton_templates_available
    from kvarn_compile.lowering.heuristics import split_max

    if device.type == "cpu" and triton_templates_available(device):
        return max(1, min(2, tiles))
    if device.type != "cuda" or not torch.cuda.is_available():
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    return split_max(batch_kv_heads, max(tiles, 1), sms) if not math.isnan(sms) else 1
