"""The Triton templates of the lowering, rendered, autotuned and executed on CPU.

Inductor runs kvarn's ``TritonTemplate`` choices on CPU tensors through the Triton
interpreter inside ``_torch_compat.triton_cpu_mode()`` (``KVARN_TRITON_CPU=1`` for
``kvarn_backend``). In that mode the lowering of ``kvarn::tile_partials_`` offers two
configs of the decode or prefill template and nothing else, so every test here checks that

* the generated code defines and launches the rendered template kernel (Inductor names
  it ``triton_tem_*``; the template's ``# kvarn_decode template`` line identifies it),
* autotuning benchmarked at least two configs and recorded the winner,
* the result equals the eager reference op within a stated tolerance (fp32: summation order
  over scores that reach |s| ~ 1e3 with a bias-like key channel, 1e-4 of the output scale;
  fp16 queries: the output's fp16 rounding, 2e-3),

over presets k4v2 / k4v4 / k2v2, head dims 64 and 128, GQA and MHA, batch 2 with rows of
different lengths, prompts crossing tile boundaries, per-tile key frames, masks, and fp16
and fp32 queries (bf16 is wrong in the interpreter, triton#11584: GPU only). The winner
exports to the autotune database and replays without benchmarking; an edited template
never runs from Inductor's caches. The interpreter is slow: shapes are tiny.

Keys and values of different head dims (MLA decompressed: D = 192, Dv = 128; and 64 / 128):
two more cases of the above (the values' rotation is a second graph constant of the
lowering), the template texts rendered standalone against the reference tile partials, and
the ``tile_partials_`` lowering on its own offering them with a Dv-wide output.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import copy
import textwrap

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from kvarn_compile import _torch_compat, autotune, lowering
from kvarn_compile.config import get_config
from kvarn_compile.lowering.heuristics import query_bucket
from kvarn_compile.ops import append as append_ref, attention as attention_ref, regions
from kvarn_compile.state import allocate_layer

G = 32
CASES = {
    # name: template, preset, head_dim, (q heads, kv heads), query dtype, query tokens, extras
    "decode-k4v2-d64-gqa-fp32-frames": ("decode", "k4v2", 64, (4, 2), torch.float32, 1, {"frames": True}),
    "decode-k2v2-d128-mha-fp16": ("decode", "k2v2", 128, (2, 2), torch.float16, 1, {}),
    "decode-k4v4-d64-mha-fp32-mask": ("decode", "k4v4", 64, (2, 2), torch.float32, 1, {"mask": True}),
    "prefill-k4v2-d128-gqa-fp32": ("prefill", "k4v2", 128, (4, 2), torch.float32, 40, {}),
    "prefill-k4v4-d64-mha-fp16-frames": ("prefill", "k4v4", 64, (2, 2), torch.float16, 72, {"frames": True}),
    "prefill-k2v2-d64-gqa-fp32-mask": ("prefill", "k2v2", 64, (4, 2), torch.float32, 40, {"mask": True}),
    # values of another head dim (MLA decompressed): output [B, Hq, Tq, Dv]
    "decode-k4v2-d192v128-gqa-fp32": ("decode", "k4v2", 192, (4, 2), torch.float32, 1, {"dv": 128}),
    "prefill-k4v4-d64v128-gqa-fp16-mask": ("prefill", "k4v4", 64, (4, 2), torch.float16, 40,
                                           {"dv": 128, "mask": True}),
}


def packed(preset: str, head_dim: int, kv_heads: int, lengths: list[int], tq: int,
           frames: bool = False, seed: int = 0, value_head_dim: int | None = None):
    """Batch rows of different lengths, the newest ``tq`` tokens of each written by a second
    append (a prefill of ``tq`` tokens crosses tile boundaries and freezes tiles itself).
    ``value_head_dim``: values of another head dim than the keys (default: the same)."""
    gen = torch.Generator().manual_seed(seed)
    dv = head_dim if value_head_dim is None else value_head_dim
    cfg = get_config(preset, group_size=G, key_frame="auto" if frames else "rotated")
    st = allocate_layer(cfg, batch=len(lengths), kv_heads=kv_heads, head_dim=head_dim,
                        value_head_dim=dv, max_len=max(lengths) + 8, dtype=torch.float32)
    for row, n in enumerate(lengths):
        k = torch.randn(1, kv_heads, n, head_dim, generator=gen)
        v = torch.randn(1, kv_heads, n, dv, generator=gen)
        if frames:               # a bias-like huge key channel in head 0: its tiles go plain
            k[:, 0, :, 3] += 300.0
        sub = [t[row:row + 1] for t in st.buffers]
        for start, stop in ((0, n - tq), (n - tq, n)):
            if stop > start:
                append_ref.append_(sub, k[:, :, start:stop], v[:, :, start:stop], torch.tensor([start]))
    if frames:
        plain = st.fields.k_plain
        assert bool(plain.any()) and not bool(plain.all()), "expected a mix of key frames"
    return st


def _attend(q, mask, *buffers):
    return torch.ops.kvarn.attention(q, list(buffers), mask, 0.3, True, 0)


def _compile_and_run(st, q, mask):
    first = len(lowering.DECISIONS)
    with lowering.use_path("split"), _torch_compat.triton_cpu_mode():
        fn = torch.compile(_attend, fullgraph=True)
        out, code = run_and_get_code(fn, q, mask, *st.buffers)
    tiles = [d for d in lowering.DECISIONS[first:] if d.op == "kvarn_tile_partials"]
    return out, "\n".join(code), tiles


def _case_inputs(name: str):
    template, preset, d, (hq, h), dtype, tq, extra = CASES[name]
    lengths = [150, 97] if tq == 1 else [150, 100]       # rows of different lengths
    assert (query_bucket(hq, h, tq) == "decode") == (template == "decode"), name
    st = packed(preset, d, h, lengths, tq, frames=extra.get("frames", False),
                value_head_dim=extra.get("dv"))
    q = torch.randn(2, hq, tq, d).to(dtype)
    mask = None
    if extra.get("mask"):
        mask = torch.rand(2, 1, tq, st.max_len, generator=torch.Generator().manual_seed(3)) > 0.2
    return template, st, q, mask


def _calls_template(source: str, template: str) -> bool:
    """The output code defines a rendered kvarn template kernel and launches it (one
    template, ``kvarn_decode``, serves the "decode" and "prefill" choices)."""
    import re

    assert template in ("decode", "prefill"), template
    marker = "# kvarn_decode template"
    for kernel in re.findall(r"def (triton_tem_\w+)\(", source):
        body = source[source.index(f"def {kernel}("):]
        if marker in body.split("\ndef ", 1)[0] and f"{kernel}.run(" in source:
            return True
    return False


def _check(template: str, st, q, mask, out, source, tiles) -> float:
    assert _calls_template(source, template), "the generated code does not call the template"
    assert tiles, "the tile op was not lowered"
    decision = tiles[-1]
    assert decision.winner.startswith(template), decision.line()
    assert len(decision.timings_ms) >= 2 and all(c.startswith(template) for c in decision.timings_ms), \
        decision.line()
    want = attention_ref.attention(q, st.buffers, mask, 0.3, True, 0)
    assert out.dtype == q.dtype and out.shape == want.shape == (*q.shape[:3], st.value_head_dim)
    scale = want.float().abs().max().item()
    err = (out.float() - want.float()).abs().max().item() / scale
    tol = 1e-4 if q.dtype == torch.float32 else 2e-3
    assert err <= tol, f"{template}: max error {err:.2e} of the output scale > {tol}"
    return err


@pytest.mark.parametrize("name", list(CASES))
def test_template_runs_autotunes_and_matches_the_reference(name, fresh_inductor):
    template, st, q, mask = _case_inputs(name)
    out, source, tiles = _compile_and_run(st, q, mask)
    err = _check(template, st, q, mask, out, source, tiles)
    print(f"\n  {name}: winner {tiles[-1].winner}, max error {err:.1e}")


def test_the_winner_exports_and_replays_without_benchmarking(fresh_inductor, tmp_path, monkeypatch):
    template, st, q, mask = _case_inputs("decode-k4v2-d64-gqa-fp32-frames")
    out, source, tiles = _compile_and_run(st, q, mask)
    _check(template, st, q, mask, out, source, tiles)
    winner = tiles[-1].winner
    path = tmp_path / "exported.json"
    assert autotune.DB.export(path) >= 1
    entries = json.loads(path.read_text())["entries"]
    assert any(e["key"]["op"] == "kvarn_tile_partials" and e["winner"]["choice"] == template
               for e in entries)

    autotune.DB.clear()                      # a new process: empty DB, empty Inductor cache
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-2"))
    torch._dynamo.reset()
    assert autotune.DB.load(path).loaded >= 1
    out2, source2, tiles2 = _compile_and_run(st, q, mask)
    replay = tiles2[-1]
    assert replay.replayed and len(replay.offered) == 1 and not replay.timings_ms, replay.line()
    assert replay.winner == winner
    assert _calls_template(source2, template)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_kvarn_backend_runs_both_templates_in_a_tiny_model(fresh_inductor, monkeypatch):
    """The product path: kvarn_backend(compiler="inductor") on a tiny Llama over a StaticCache
    (KVARN_TRITON_CPU=1): the prefill graph calls the prefill template, the decode graph the
    decode template, and the tokens equal the eager KVarN model's."""
    import transformers as tf

    from kvarn_compile import kvarn_backend
    from kvarn_compile.hf import KVarNCache, static_cache_for, use_kvarn_attention
    from kvarn_compile.testing import cache_arg

    monkeypatch.setenv("KVARN_TRITON_CPU", "1")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=256, attn_implementation="sdpa")
    model = tf.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 96, (1, 70), generator=torch.Generator().manual_seed(1))
    preset = dict(preset="k4v2", group_size=G)

    eager = tf.LlamaForCausalLM(copy.deepcopy(cfg)).eval()    # its own config: kvarn attention
    eager.load_state_dict(model.state_dict())
    use_kvarn_attention(eager)
    with torch.no_grad():
        want = eager.generate(ids, max_new_tokens=3, do_sample=False,
                              **cache_arg(eager, KVarNCache(eager.config, max_cache_len=96, **preset)))

    backend = kvarn_backend(**preset, compiler="inductor")
    model.compile(backend=backend)
    with torch.no_grad(), lowering.use_path("split"):
        got, code = run_and_get_code(lambda: model.generate(
            ids, max_new_tokens=3, do_sample=False, **cache_arg(model, static_cache_for(model, 96))))
    source = "\n".join(code)
    assert _calls_template(source, "prefill") and _calls_template(source, "decode")
    assert len(backend.report.rewritten) == len(backend.report.sites) > 0
    assert got.tolist() == want.tolist()
    templates = [d.winner for d in backend.report.lowerings if d.op == "kvarn_tile_partials"]
    assert any(w.startswith("prefill[") for w in templates) and any(w.startswith("decode[") for w in templates)


_STALE_PROBE = textwrap.dedent("""
    import json, os, sys, torch
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code
    from kvarn_compile import lowering
    from kvarn_compile.config import get_config
    from kvarn_compile.ops import append as append_ref, attention as attention_ref
    from kvarn_compile.state import allocate_layer
    lowering.register()
    st = allocate_layer(get_config("k4v2", group_size=32), batch=1, kv_heads=1, head_dim=16,
                        max_len=96, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    append_ref.append_(st.buffers, torch.randn(1, 1, 80, 16, generator=g),
                      torch.randn(1, 1, 80, 16, generator=g), torch.tensor([0]))
    def f(q, *b):
        return torch.ops.kvarn.attention(q, list(b), None, 0.3, True, 0)
    with lowering.use_path("reference"):
        out, code = run_and_get_code(torch.compile(f), torch.randn(1, 2, 1, 16), *st.buffers)
    print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"],
                      "miss": counters["inductor"]["fxgraph_cache_miss"]}))
""")


def test_an_edited_template_never_runs_from_inductors_caches(tmp_path):
    """Three fresh processes share one Inductor cache: the second hits it; after a template
    edit in a copy of the package, the third misses (the lowering's cache tag hashes every
    kvarn source, templates included)."""
    package = pathlib.Path(_torch_compat.__file__).parent
    copy = tmp_path / "src" / "kvarn_compile"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(copy.parent), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind"),
               KVARN_AUTOTUNE_DB=str(tmp_path / "db.json"))
    script = tmp_path / "probe.py"
    script.write_text(_STALE_PROBE)

    def run() -> dict:
        res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    first = run()
    assert first["miss"] >= 1 and first["hit"] == 0
    assert run()["hit"] >= 1, "the probe cannot tell a cache hit (the test would be vacuous)"
    template = copy / "lowering" / "templates" / "kvarn_decode.py.jinja"
    template.write_text(template.read_text() + "\n# edited\n")
    third = run()
    assert third["hit"] == 0 and third["miss"] >= 1, third


# ------------------------------------------------------------------ values of another head dim
#: (template, preset, D, Dv, (q heads, kv heads), query tokens, extras)
DV_CASES = {
    "decode-k4v2-d192v128-gqa": ("decode", "k4v2", 192, 128, (4, 2), 1, {}),
    "decode-k4v4-d192v128-gqa-frames": ("decode", "k4v4", 192, 128, (4, 2), 1, {"frames": True}),
    "decode-k4v2-d64v128-gqa-mask": ("decode", "k4v2", 64, 128, (4, 2), 1, {"mask": True}),
    "decode-k4v4-d64v64-gqa": ("decode", "k4v4", 64, 64, (4, 2), 1, {}),
    "prefill-k4v2-d192v128-gqa-mask": ("prefill", "k4v2", 192, 128, (4, 2), 40, {"mask": True}),
    "prefill-k4v4-d64v128-mha-frames": ("prefill", "k4v4", 64, 128, (2, 2), 40, {"frames": True}),
    "prefill-k4v2-d16v16-gqa": ("prefill", "k4v2", 16, 16, (4, 2), 40, {}),
    # a prompt at D = 128 as transformers runs one (a bool mask, key frames): the phased
    # loop's keys in four parts of 32 (attention.key_part)
    "prefill-k4v2-d128v128-gqa-mask-frames": ("prefill", "k4v2", 128, 128, (4, 2), 40,
                                              {"mask": True, "frames": True}),
}


def _dv_case(name: str):
    template, preset, d, dv, (hq, h), tq, extra = DV_CASES[name]
    lengths = [150, 97] if tq == 1 else [150, 100]
    st = packed(preset, d, h, lengths, tq, frames=extra.get("frames", False), value_head_dim=dv)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, hq, tq, d, generator=gen)
    mask = None
    if extra.get("mask"):
        mask = torch.rand(2, 1, tq, st.max_len, generator=gen) > 0.2
    return template, st, q, mask


@pytest.mark.parametrize("name", list(DV_CASES))
def test_template_texts_with_value_head_dims_match_the_reference_tiles(name, tmp_path):
    """Each template rendered standalone (its text, the constexprs the lowering passes: D,
    BLOCK_D, DV, BLOCK_DV) and run by the interpreter: the per-split partials [.., Dv] merged
    by lse equal the reference tile partials; split slots no program owns stay -inf."""
    import triton

    from kvarn_compile.lowering.tile_templates import (launch_standalone, render_standalone,
                                                       standalone_tensors)

    template, st, q, mask = _dv_case(name)
    d, dv = st.head_dim, st.value_head_dim
    b, hq, tq = q.shape[:3]
    h = st.kv_heads
    ins = attention_ref.tile_inputs(q, st.buffers, mask, True, 0)
    q_rot, qp, kc, krs, krz, kcs, vc, vrs, vrz, vcs, kp, nt, lo, hi, bias = ins
    frames = kp is not None
    decode = template == "decode"
    split = 2 if decode else 1
    split_max = split + 1
    tensors = standalone_tensors(ins, split_max)
    out = torch.full((b, hq, tq, split_max, dv), float("nan"))
    block_m = 16
    ce = dict(GROUP_Q=hq // h, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), DV=dv,
              BLOCK_DV=max(16, triton.next_power_of_2(dv)), G=G, BLOCK_N=16 if decode else 32,
              K_BITS=st.config.key_bits, V_BITS=st.config.value_bits, SPLIT=split,
              SPLIT_MAX=split_max, BLOCK_M=block_m, PREFETCH=1, HAS_BIAS=bias is not None,
              HAS_K_PLAIN=frames, INPUT_PRECISION="ieee", SM_SCALE=0.3, KVARN_SRC=1)
    kernel = render_standalone("kvarn_decode.py.jinja", tensors, ce, tmp_path)
    grid = (b * h, split, triton.cdiv(hq // h * tq, block_m))
    launch_standalone(kernel, tensors, out, grid, ce)
    ref_o, ref_lse = attention_ref.tile_partials(*ins, 0.3, 1)
    assert ref_o.shape[-1] == dv
    got_o, got_lse = regions.combine_splits(out[:, :, :, :split], tensors["LSE"][..., :split])
    fin = torch.isfinite(ref_lse[..., 0])
    assert torch.equal(torch.isfinite(got_lse), fin) and bool(fin.any())
    scale = ref_o.abs().max().item()
    torch.testing.assert_close(got_o, ref_o[:, :, :, 0], atol=2e-5 * scale, rtol=0)
    torch.testing.assert_close(got_lse[fin], ref_lse[..., 0][fin], atol=2e-5, rtol=1e-5)
    assert torch.isinf(tensors["LSE"][..., split:]).all(), "unused split slots must stay -inf"


@pytest.mark.parametrize("name", [n for n in DV_CASES if n.startswith("decode")]
                         + ["prefill-k4v2-d192v128-gqa-mask", "prefill-k4v4-d64v128-mha-frames",
                            "prefill-k4v2-d128v128-gqa-mask-frames"])
def test_decode_template_text_runs_the_phased_fp16_loop(name, tmp_path):
    """The decode template as the lowering renders it for a GPU (fp16 code matmuls, BLOCK_N
    = G, PHASED from ``phased_decode``, the phased loop's warps and no prefetch; a prompt's
    keys in parts, KEY_PART) run by the interpreter: the partials merged by lse equal the
    reference tile partials up to the fp16 rounding of the operands (window masks, key
    frames, unequal head dims included)."""
    import triton

    from kvarn_compile.kernels.triton.attention import DECODE_PREFETCH, key_part, phased_decode
    from kvarn_compile.lowering.tile_templates import (launch_standalone, render_standalone,
                                                       standalone_tensors)

    template, st, q, mask = _dv_case(name)
    d, dv = st.head_dim, st.value_head_dim
    b, hq, tq = q.shape[:3]
    h = st.kv_heads
    kb, vb = st.config.key_bits, st.config.value_bits
    assert phased_decode("fp16", G, kb, dv, vb)
    ins = attention_ref.tile_inputs(q, st.buffers, mask, True, 0)
    split, split_max, block_m = 2, 3, 16
    tensors = standalone_tensors(ins, split_max)
    out = torch.full((b, hq, tq, split_max, dv), float("nan"))
    ce = dict(GROUP_Q=hq // h, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), DV=dv,
              BLOCK_DV=max(16, triton.next_power_of_2(dv)), G=G, BLOCK_N=G, K_BITS=kb,
              V_BITS=vb, SPLIT=split, SPLIT_MAX=split_max, BLOCK_M=block_m,
              PREFETCH=int(DECODE_PREFETCH[True]), HAS_BIAS=ins[-1] is not None,
              HAS_K_PLAIN=ins[10] is not None, INPUT_PRECISION="fp16", PHASED=True,
              KEY_PART=key_part(max(16, triton.next_power_of_2(d))) if template == "prefill"
              else 0, SM_SCALE=0.3, KVARN_SRC=1)
    kernel = render_standalone("kvarn_decode.py.jinja", tensors, ce, tmp_path)
    launch_standalone(kernel, tensors, out, (b * h, split, triton.cdiv(hq // h * tq, block_m)), ce)
    ref_o, ref_lse = attention_ref.tile_partials(*ins, 0.3, 1)
    got_o, got_lse = regions.combine_splits(out[:, :, :, :split], tensors["LSE"][..., :split])
    fin = torch.isfinite(ref_lse[..., 0])
    assert torch.equal(torch.isfinite(got_lse), fin) and bool(fin.any())
    scale = ref_o.abs().max().item()
    torch.testing.assert_close(got_o, ref_o[:, :, :, 0], atol=3e-3 * scale, rtol=0)
    torch.testing.assert_close(got_lse[fin], ref_lse[..., 0][fin], atol=3e-3, rtol=1e-3)


def _tile_partials_call(split_max: int):
    def fn(*tensors):
        *ins, lse = tensors
        o = torch.ops.kvarn.tile_partials_(*ins, lse, 0.3, split_max)
        return o, lse
    return fn


@pytest.mark.parametrize("name", ["decode-k4v2-d192v128-gqa", "prefill-k4v2-d192v128-gqa-mask"])
def test_tile_lowering_offers_the_templates_for_value_head_dims(name, fresh_inductor):
    """``kvarn::tile_partials_`` compiled on its own (CPU Triton mode): the lowering offers the
    template configs with a [.., Dv] output and DV constexprs, autotunes them and the winner's
    partials equal the reference's."""
    template, st, q, mask = _dv_case(name)
    ins = attention_ref.tile_inputs(q, st.buffers, mask, True, 0)
    lse = torch.full((*q.shape[:3], 2), float("-inf"))
    first = len(lowering.DECISIONS)
    with _torch_compat.triton_cpu_mode():
        (o, lse_out), code = run_and_get_code(torch.compile(_tile_partials_call(2), fullgraph=True),
                                              *ins, lse)
    tiles = [d for d in lowering.DECISIONS[first:] if d.op == "kvarn_tile_partials"]
    source = "\n".join(code)
    assert _calls_template(source, template) and "DV : tl.constexpr = 128" in source
    assert tiles and tiles[-1].winner.startswith(template) and len(tiles[-1].timings_ms) >= 2
    assert o.shape == (*q.shape[:3], 2, st.value_head_dim)
    got_o, got_lse = regions.combine_splits(o, lse_out)
    ref_o, ref_lse = attention_ref.tile_partials(*ins, 0.3, 1)
    fin = torch.isfinite(ref_lse[..., 0])
    assert torch.equal(torch.isfinite(got_lse), fin) and bool(fin.any())
    torch.testing.assert_close(got_o, ref_o[:, :, :, 0], atol=2e-5 * ref_o.abs().max().item(), rtol=0)
    torch.testing.assert_close(got_lse[fin], ref_lse[..., 0][fin], atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_templates_on_cuda(name, dtype, fresh_inductor):
    """On a GPU (compiled Triton, not the interpreter): the same cases in bf16 and fp16; the
    templates compete with the torch extern (and the standalone kernel for decode)."""
    template, st, q, mask = _case_inputs(name)
    cuda = [t.cuda() for t in st.buffers]
    st = type(st)(config=st.config, buffers=cuda, max_len=st.max_len)
    q = q.to(dtype).cuda()
    mask = None if mask is None else mask.cuda()
    first = len(lowering.DECISIONS)
    out, code = run_and_get_code(torch.compile(_attend, fullgraph=True), q, mask, *st.buffers)
    tiles = [d for d in lowering.DECISIONS[first:] if d.op == "kvarn_tile_partials"]
    assert tiles and any(c.startswith(template) for c in tiles[-1].offered), tiles
    want = attention_ref.attention(q, st.buffers, mask, 0.3, True, 0)
    err = (out.float() - want.float()).abs().max().item() / want.float().abs().max().item()
    assert err <= (1e-2 if dtype == torch.bfloat16 else 3e-3), f"{name}: {err:.2e} ({tiles[-1].winner})"


@pytest.mark.parametrize("phased,block_m,block_n,warps", [(True, 16, 128, 2), (False, 64, 64, 4)])
def test_prompt_configs_take_the_loops_own_block(phased, block_m, block_n, warps):
    """A prompt's default config (and the one-launch op's block) is the loop's own: the phased
    fp16 loop runs the decode step's 16-row block (every warp unpacks the whole tile for its
    rows, so larger blocks only spilled); the byte loop up to 64 rows (its warps share the
    unpack). The autotuner still offers the other block sizes."""
    from kvarn_compile.kernels.triton.attention import DECODE_PREFETCH, default_block_m
    from kvarn_compile.lowering.heuristics import prefill_configs

    rows = 4 * 256                                       # 4 query heads a kv head, 256 queries
    assert default_block_m(rows, phased) == block_m
    (default,) = prefill_configs("default", group=128, rows=rows, phased=phased)
    assert (default.block_m, default.block_n, default.split) == (block_m, block_n, 1)
    resolved = default.resolved(phased)
    assert (resolved.num_warps, resolved.prefetch) == (warps, DECODE_PREFETCH[phased])
    tuned = prefill_configs("autotune", group=128, rows=rows, phased=phased)
    assert tuned[0] == default and {c.block_m for c in tuned} >= {16, 32, 64, 128}
    # the 16-row block also at 4 warps: no spills on sm_90 with triton 3.6 or 3.9
    assert {c.resolved(phased).num_warps for c in tuned if c.block_m == 16} >= {warps, 4}


def test_value_rows_past_128_channels_run_the_loop_at_4_warps():
    """The decode loop's default warps (``loop_warps``): the phased loop's 2 for a block of up
    to 16 rows whose value rows fit 128 channels, 4 past them (head dim 256: at 2 warps the
    loop spilled on sm_90), as the eager launchers and the template's configs resolve it."""
    from kvarn_compile.kernels.triton.attention import loop_warps
    from kvarn_compile.lowering.heuristics import DecodeConfig

    assert [loop_warps(True, 16, dv) for dv in (64, 128, 192, 256)] == [2, 2, 4, 4]
    assert loop_warps(True, 64, 128) == loop_warps(False, 16, 128) == 4
    cfg = DecodeConfig(block_n=128, block_m=16, split=1, num_warps=None, num_stages=1)
    assert cfg.resolved(True, 128).num_warps == 2 and cfg.resolved(True, 256).num_warps == 4
