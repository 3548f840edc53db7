"""The Inductor lowering of ``kvarn::latent_attention`` (``lowering/latent.py``) and its
Triton template ``kvarn_latent`` (``templates/kvarn_latent.py.jinja``), on CPU tensors.

* the reference partials of the internal op ``kvarn::latent_tile_partials_``
  (``ops.attention.latent_tile_partials``: per key frame, every tile slot, static shapes)
  merge to the reference tile region (``ops.attention.latent_tile_region``);
* the template text, rendered standalone (``tile_templates.render_standalone``) and run by
  the Triton interpreter, equals those partials: per frame and merged, with per-tile key
  frames, fp8 scales, masks (one mask row for every query head), windows, causal bounds
  inside the tiles, one and several query tokens, several splits and channel blocks;
* the decomposition ``decompose.latent_attention_split``, traced by ``make_fx``, equals the
  reference op (and keeps the tile op opaque);
* in the CPU Triton mode (``_torch_compat.triton_cpu_mode``) a compiled graph with
  ``kvarn::latent_attention`` inlines the decomposition, autotunes two template configs and
  launches the rendered template, and its output equals the reference;
* without that mode (plain CPU), the compiled graph still calls the op, whose CPU kernel
  is the C++ latent kernel: the lowering changes nothing there.

Shapes are tiny (latent 64, RoPE key 16, 6 query heads over one kv head, tiles of 32): the
interpreter runs each program in numpy.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from kvarn_compile import _torch_compat, lowering
from kvarn_compile.config import LATENT_ROPE_BITS, get_config
from kvarn_compile.lowering import decompose, latent
from kvarn_compile.ops import attention as attention_ref, regions
from kvarn_compile.quant.rotation import rotation_matrix
from kvarn_compile.state import unpack
from kvarn_compile.testing import PackedSequence, latent_rows, no_graph_caches

pytestmark = pytest.mark.usefixtures("one_thread")

RANK, ROPE, HEADS, CAP, G = 64, 16, 6, 256, 32
SCALE = 0.1

#: name: query tokens, per-tile key frames, fp8 scales, a mask, the window
CASES = {
    "decode": dict(tq=1),
    "decode-frames-mask": dict(tq=1, frames=True, mask=True),
    "multi-frames-fp8-mask-window": dict(tq=3, frames=True, fp8=True, mask=True, window=70),
    "multi-fp8-mask": dict(tq=5, fp8=True, mask=True),
}

#: the template's input names by ``LATENT_TILE_ARGS`` name (render_standalone's tensors)
TEMPLATE_INPUTS = dict(
    q_rot="Q", q_plain="QP", q_pe_rot="QPE", k_codes="KC", k_row_scale="KRS", k_row_zero="KRZ",
    k_col_scale="KCS", v_codes="VC", v_row_scale="VRS", v_row_zero="VRZ", v_col_scale="VCS",
    k_row_factor="KRF", k_col_factor="KCF", v_row_factor="VRF", v_col_factor="VCF",
    tile_ids="IDS", tile_count="CNT", n_tiles="NT", kv_lo="KVLO", kv_hi="KVHI", bias="BIAS")


def latent_state(*, tq: int = 1, frames: bool = False, fp8: bool = False) -> PackedSequence:
    """:func:`kvarn_compile.testing.latent_rows` (fp8 scales with ``fp8``)."""
    extra = {"scale_dtype": "float8_e4m3fn"} if fp8 else {}
    return latent_rows(tq=tq, frames=frames, rank=RANK, rope=ROPE, group=G, max_len=CAP, **extra)


def case_inputs(name: str, seed: int = 1):
    c = CASES[name]
    tq = c["tq"]
    seq = latent_state(tq=tq, frames=c.get("frames", False), fp8=c.get("fp8", False))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, HEADS, tq, RANK, generator=gen)
    q_pe = torch.randn(2, HEADS, tq, ROPE, generator=gen)
    mask = (torch.rand(2, 1, tq, CAP, generator=gen) > 0.2) if c.get("mask") else None
    return seq, q, q_pe, mask, c.get("window", 0)


def tile_inputs(seq, q, q_pe, mask, window):
    return decompose.latent_tile_inputs(q, q_pe, seq.buffers, mask, True, window,
                                        rotation_matrix(RANK), rotation_matrix(ROPE))


def assert_partials_match(o_part, lse_part, want_o, want_lse, *, tol=1e-5):
    """Merged partials (out [B, Hq, Tq, D] in the original frame, lse) against the wanted."""
    got_o, got_lse = decompose.merge_latent_frames(o_part, lse_part, rotation_matrix(RANK))
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(got_lse), fin) and bool(fin.any())
    torch.testing.assert_close(got_lse[fin], want_lse[fin], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(got_o, want_o, rtol=0, atol=tol * want_o.abs().max().item())


# ------------------------------------------------------------------------------ the reference
@pytest.mark.parametrize("name", list(CASES))
def test_reference_partials_merge_to_the_reference_tile_region(name):
    """``latent_tile_partials`` (per frame, split 0 holding it all, the others empty) merged
    equals ``latent_tile_region``; each frame holds only its own tiles."""
    seq, q, q_pe, mask, window = case_inputs(name)
    f = unpack(seq.buffers)
    ins = tile_inputs(seq, q, q_pe, mask, window)
    o_part, lse_part = attention_ref.latent_tile_partials(*ins, SCALE, 3)
    nf = 2 if f.k_plain is not None else 1
    assert o_part.shape == (2, HEADS, q.shape[2], nf, 3, RANK)
    assert bool((lse_part[..., 1:] == float("-inf")).all()) and bool((o_part[..., 1:, :] == 0).all())
    want_o, want_lse = attention_ref.latent_tile_region(q, q_pe, f, mask, SCALE, True, window,
                                                        int(f.n_tiles.max()))
    assert_partials_match(o_part, lse_part, want_o, want_lse)
    if nf == 2:   # frame 1 (plain tiles): the tile region with the rotated tiles masked out
        hide = f.k_plain.bool().logical_not()[:, 0].repeat_interleave(G, -1)        # [B, N*G]
        m = torch.ones(2, 1, q.shape[2], CAP, dtype=torch.bool) if mask is None else mask.clone()
        sink = f.sink_k.shape[2]
        m[..., sink:sink + hide.shape[-1]] &= ~hide[:, None, None, :]
        ref_o, ref_lse = attention_ref.latent_tile_region(q, q_pe, f, m, SCALE, True, window,
                                                          int(f.n_tiles.max()))
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse_part[:, :, :, 1, 0]), fin)
        torch.testing.assert_close(o_part[:, :, :, 1, 0][fin], ref_o[fin], rtol=0,
                                   atol=1e-5 * ref_o.abs().max().item())


# ------------------------------------------------------------------------------ the template text
def _render_and_run(tensors: dict, out_shape, ce: dict, tmp_path):
    import triton

    from kvarn_compile.lowering.tile_templates import launch_standalone, render_standalone

    out = torch.full(out_shape, float("nan"))
    kernel = render_standalone(latent.TEMPLATE_FILE, tensors, ce, tmp_path, out_rank=6)
    b, hq, tq = out_shape[:3]
    h = tensors["KC"].shape[1]
    grid = (b * h, ce["NF"] * ce["SPLIT"], triton.cdiv(hq // h * tq, ce["BLOCK_M"]))
    launch_standalone(kernel, tensors, out, grid, ce)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_template_text_matches_the_reference_partials_under_the_interpreter(name, tmp_path):
    """The template rendered standalone with the constexprs the lowering passes, two splits
    of three slots, the latent in two channel blocks, 16-token steps: its partials merged
    equal the reference partials merged (per frame too); the slots no program owns keep
    lse = -inf."""
    seq, q, q_pe, mask, window = case_inputs(name)
    ins = tile_inputs(seq, q, q_pe, mask, window)
    tensors = {TEMPLATE_INPUTS[n]: t for n, t in zip(attention_ref.LATENT_TILE_ARGS, ins)
               if t is not None}
    b, hq, tq = q.shape[:3]
    nf = 2 if "IDS" in tensors else 1
    split, split_max = 2, 3
    tensors["LSE"] = torch.full((b, hq, tq, nf, split_max), float("-inf"))
    cfg = get_config("k4v2", group_size=G, value_bits=LATENT_ROPE_BITS)
    ce = dict(GROUP_Q=hq, D=RANK, BLOCK_D=RANK, BLOCK_DC=32, DV=ROPE, BLOCK_DV=ROPE, G=G,
              BLOCK_N=16, K_BITS=cfg.key_bits, V_BITS=cfg.value_bits, NF=nf, SPLIT=split,
              SPLIT_MAX=split_max, BLOCK_M=16, PREFETCH=1, HAS_BIAS="BIAS" in tensors,
              HAS_FACTORS="KRF" in tensors, INPUT_PRECISION="ieee", SM_SCALE=SCALE, KVARN_SRC=1)
    if mask is not None:
        assert tensors["BIAS"].shape[1] == 1, "one mask row for every query head"
    out = _render_and_run(tensors, (b, hq, tq, nf, split_max, RANK), ce, tmp_path)
    lse = tensors["LSE"]
    assert torch.isinf(lse[..., split:]).all(), "unused split slots must stay -inf"
    ref_o, ref_lse = attention_ref.latent_tile_partials(*ins, SCALE, 1)
    want_o, want_lse = decompose.merge_latent_frames(ref_o, ref_lse, rotation_matrix(RANK))
    assert_partials_match(out[..., :split, :], lse[..., :split], want_o, want_lse)
    for frame in range(nf):      # each frame on its own (its own frame of reference)
        o_f, lse_f = regions.combine_splits(out[:, :, :, frame, :split],
                                                          lse[:, :, :, frame, :split])
        fin = torch.isfinite(ref_lse[:, :, :, frame, 0])
        assert torch.equal(torch.isfinite(lse_f), fin)
        torch.testing.assert_close(o_f[fin], ref_o[:, :, :, frame, 0][fin], rtol=0,
                                   atol=1e-5 * ref_o.abs().max().item())


def test_the_template_opens_with_a_glossary_and_imports_the_kernels_loop():
    from kvarn_compile.kernels.triton import latent_attention as kernels
    from kvarn_compile.lowering.tile_templates import template_source

    text = template_source(latent.TEMPLATE_FILE)
    assert text.startswith("# KVarN")
    glossary = text.split("{{def_kernel")[0]
    for constexpr in ("GROUP_Q", "BLOCK_N", "BLOCK_M", "BLOCK_DC", "NF", "SPLIT", "SPLIT_MAX",
                      "G", "K_BITS", "HAS_BIAS", "HAS_FACTORS", "INPUT_PRECISION"):
        assert f"#   {constexpr}" in glossary, constexpr
    assert "_latent_range" in text.split(
        "from kvarn_compile.kernels.triton.latent_attention import")[1]
    # one loop body, not a copy: the standalone kernel calls the same jit function
    assert "_latent_range(" in inspect.getsource(kernels._latent_tiles_kernel.fn)
    assert "@triton.jit" not in text and "def _latent_range" not in text
    assert latent.kvarn_latent_grid.__doc__.startswith("How is this kernel parallelized?")


def test_template_configs_start_with_the_launchers_default_and_fit_the_shape():
    from kvarn_compile.kernels.triton.latent_attention import default_config

    cuda = torch.device("cuda")          # (a device object only: no GPU needed)
    for d, group in ((512, 64), (64, 32), (48, 128)):
        want = default_config(d, 16, cuda)
        for mode, least in (("interpret", 2), ("default", 2), ("autotune", 8), ("exhaustive", 16)):
            cfgs = latent.latent_configs(mode, d=d, rows=16, group=group, max_split=8, device=cuda)
            assert len(cfgs) >= least and len(set(cfgs)) == len(cfgs), (mode, cfgs)
            base = cfgs[0]
            assert (base.block_m, base.block_dc, base.num_warps, base.split) == (
                want["block_m"], min(want["block_dc"], latent._block(d)), want["num_warps"], 8)
            assert base.block_n == min(group, want["block_n"])
            assert all(group % c.block_n == 0 and latent._block(d) % c.block_dc == 0
                       and 1 <= c.split <= 8 for c in cfgs)


# ------------------------------------------------------------------------------ decomposition
@pytest.mark.parametrize("name", [*CASES, "no-tile-slots"])
def test_the_split_decomposition_traced_with_make_fx_equals_the_op(name):
    from torch.fx.experimental.proxy_tensor import make_fx

    if name == "no-tile-slots":   # a state allocated for fewer than sink + one tile positions
        cfg = get_config("k4v2", group_size=G, value_bits=LATENT_ROPE_BITS)
        seq = PackedSequence(cfg, heads=1, head_dim=RANK, value_head_dim=ROPE, max_len=40)
        seq.write(30)
        assert unpack(seq.buffers).k.codes.shape[2] == 0
        q, q_pe, mask, window = torch.randn(2, HEADS, 1, RANK), torch.randn(2, HEADS, 1, ROPE), None, 0
    else:
        seq, q, q_pe, mask, window = case_inputs(name)
    args = (q, q_pe, *seq.buffers, *([mask] if mask is not None else []),
            rotation_matrix(RANK), rotation_matrix(ROPE))
    kw = dict(n_buffers=len(seq.buffers), has_mask=mask is not None, scale=SCALE, causal=True,
              window=window, split_max=3)
    gm = make_fx(lambda *a: decompose.latent_attention_split(*a, **kw))(*args)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    has_tiles = name != "no-tile-slots"
    assert ("kvarn.latent_tile_partials_.default" in targets) == has_tiles, targets
    assert "kvarn.latent_attention.default" not in targets
    want = attention_ref.latent_attention(q, q_pe, seq.buffers, mask, SCALE, True, window)
    got = gm(*args)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


# ------------------------------------------------------------------------------ lowering
def _latent(q, q_pe, mask, *buffers, window=0):
    return torch.ops.kvarn.latent_attention(q, q_pe, list(buffers), mask, SCALE, True, window)


def _calls_template(source: str) -> bool:
    """The output code defines the rendered kvarn_latent template kernel and launches it."""
    for kernel in re.findall(r"def (triton_tem_\w+)\(", source):
        body = source[source.index(f"def {kernel}("):].split("\ndef ", 1)[0]
        if "# kvarn_latent template" in body and f"{kernel}.run(" in source:
            return True
    return False


@pytest.mark.parametrize("name", ["decode", "multi-frames-fp8-mask-window"])
def test_cpu_triton_mode_compiles_the_template_and_matches_the_reference(name, fresh_inductor):
    seq, q, q_pe, mask, window = case_inputs(name)
    first = len(lowering.DECISIONS)

    def fn(q, q_pe, mask, *buffers):
        return _latent(q, q_pe, mask, *buffers, window=window)

    with _torch_compat.triton_cpu_mode():
        out, code = run_and_get_code(torch.compile(fn, fullgraph=True), q, q_pe, mask, *seq.buffers)
    source = "\n".join(code)
    assert _calls_template(source), "the generated code does not launch the latent template"
    assert "kvarn.latent_attention.default(" not in source
    assert "kvarn.latent_tile_partials_.default(" not in source
    decisions = lowering.DECISIONS[first:]
    split = [d for d in decisions if d.op == latent.LATENT_OP_NAME]
    tiles = [d for d in decisions if d.op == latent.LATENT_TILE_OP_NAME]
    assert split and split[-1].winner == "split", decisions
    assert tiles and tiles[-1].winner.startswith("latent["), tiles
    assert len(tiles[-1].timings_ms) >= 2 and all(c.startswith("latent[") for c in tiles[-1].timings_ms)
    want = attention_ref.latent_attention(q, q_pe, seq.buffers, mask, SCALE, True, window)
    assert out.shape == want.shape and out.dtype == want.dtype
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("tq", [1, 5])
def test_plain_cpu_compile_still_calls_the_cpp_latent_kernel(tq, monkeypatch):
    """Without the CPU Triton mode the lowering leaves the op alone: the compiled graph
    calls ``kvarn::latent_attention``, whose CPU kernel is the C++ latent kernel, and
    nothing is decided or tuned for it."""
    from kvarn_compile.kernels.cpu import attention as cpu_attention

    if not cpu_attention.available():
        pytest.skip("the C++ kernel does not build here")
    lowering.register()
    seq = latent_state(tq=tq, frames=True)
    q, q_pe = torch.randn(2, HEADS, tq, RANK), torch.randn(2, HEADS, tq, ROPE)
    calls = []
    real = cpu_attention.latent_attention_state
    monkeypatch.setattr(cpu_attention, "latent_attention_state",
                        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    first = len(lowering.DECISIONS)
    torch._dynamo.reset()
    with no_graph_caches():
        out, code = run_and_get_code(torch.compile(_latent, backend="inductor", fullgraph=True),
                                     q, q_pe, None, *seq.buffers)
    torch._dynamo.reset()
    source = "\n".join(code)
    assert "torch.ops.kvarn.latent_attention.default(" in source
    assert "latent_tile_partials_" not in source and "triton" not in source.lower()
    assert calls and all(s == q.shape for s in calls), calls
    assert not [d for d in lowering.DECISIONS[first:] if "latent" in d.op]
    want = attention_ref.latent_attention(q, q_pe, seq.buffers, None, SCALE, True, 0)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_the_reference_path_keeps_the_op_call_in_cpu_triton_mode(fresh_inductor):
    """``KVARN_LOWERING_PATH=reference`` (``lowering.use_path``): no lowering even where the
    template could run; the compiled graph calls the op itself (its own kernel)."""
    seq, q, q_pe, mask, window = case_inputs("decode")
    first = len(lowering.DECISIONS)
    with _torch_compat.triton_cpu_mode(), lowering.use_path("reference"):
        out, code = run_and_get_code(torch.compile(_latent, fullgraph=True), q, q_pe, None,
                                     *seq.buffers)
    assert "torch.ops.kvarn.latent_attention.default(" in "\n".join(code)
    assert not [d for d in lowering.DECISIONS[first:] if "latent" in d.op]
    want = attention_ref.latent_attention(q, q_pe, seq.buffers, None, SCALE, True, 0)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5 * want.abs().max().item())


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_latent_lowering_on_cuda(name, fresh_inductor):
    """On a GPU (compiled Triton): the template configs compete with the torch extern; the
    output equals the reference within the fp16 operands' rounding."""
    seq, q, q_pe, mask, window = case_inputs(name)
    buffers = [t.cuda() for t in seq.buffers]
    q, q_pe = q.cuda(), q_pe.cuda()
    mask = None if mask is None else mask.cuda()
    first = len(lowering.DECISIONS)

    def fn(q, q_pe, mask, *buffers):
        return _latent(q, q_pe, mask, *buffers, window=window)

    out, code = run_and_get_code(torch.compile(fn, fullgraph=True), q, q_pe, mask, *buffers)
    tiles = [d for d in lowering.DECISIONS[first:] if d.op == latent.LATENT_TILE_OP_NAME]
    assert tiles and any(c.startswith("latent[") for c in tiles[-1].offered), tiles
    assert "torch" in tiles[-1].offered
    want = attention_ref.latent_attention(q, q_pe, buffers, mask, SCALE, True, window)
    err = (out - want).abs().max().item() / want.abs().max().item()
    assert err <= 5e-3, f"{name}: {err:.2e} ({tiles[-1].winner})"
