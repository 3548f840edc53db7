"""Public model code that keeps its own KV cache, each with its own generation loop, under
``kvarn_backend``: rewritten with logits within the preset's quantization error of the
uncompressed model, or left unchanged with the true reason (the must-not-match twins).

The models are ``kvarn_compile.testing.codebases``: tiny random-weight models written in the
spelling of each codebase (none of their code). Each runs its own greedy loop (a 66-token
prefill that freezes a packed tile, then decode steps) compiled with ``kvarn_backend(preset,
group_size=32, compiler="eager")``; the uncompressed model and the same model reading its K/V
through a whole-sequence cache of the preset (``codebases.reference``: the preset's own
error) are fed the same tokens. A step passes when its logits are within ``MARGIN`` times that
error (+ ``RTOL`` of the largest logit) of the uncompressed ones.

    codebase (spelling)                         k4v4 / k4v2        twin (left unchanged because)
    torchtune (cache_pos buffer, setitem)       rewritten          V written one position later:
    torchtune (cache_pos buffer, index_copy_)   rewritten            "positions the pass cannot
                                                                     prove equal"
    stacked [L, B, S, H, D] (mistral-inference, rewritten          mistral-inference's own flat
      nanochat; llama-style slices)                                  view(-1, H, D).index_copy_(0, ...)
    gemma_pytorch (index_copy_(1, ...), list    rewritten          Gemma 2 soft-capping (tanh)
      of caches, q.mul_, local mask)
    DeepSeek-V3 naive (einsum bshd,bthd->bsht)  rewritten          softmax over the heads axis
      also as latent attention decompressed     rewritten          values read as the key cache's
      (K 48 = nope + rope channels, V 32)                            first 32 channels
      absorbed (q·latentᵀ + q_pe·peᵀ over       rewritten          values read one position
      [B, S, C] caches: a latent state)                              further on than the scores
    HF DeepseekV2 absorbed (madsys-dev patch:   rewritten          the RoPE part scaled twice
      [B, 1, T, C] cat caches, matmul + .mT)
    per-layer windows k[:, :, max(0, e-W):e]    rewritten          newest W by a negative slice
      (also a sequence shorter than the window
      that grows past it while decoding)
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from kvarn_compile import kvarn_backend
from kvarn_compile.testing.codebases import build, reference, run_generate

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")

PROMPT, NEW = 66, 4          # sink 0..31, tile 32..63 frozen by the prefill, tail 64..
MARGIN, RTOL = 3.0, 0.005
PRESETS = ["k4v4", "k4v2"]

#: name -> (build keywords, prompt, new tokens, every site's cache spelling / read spelling)
CASES = {
    "torchtune-setitem": (dict(name="torchtune"), PROMPT, NEW,
                          r"scaled_dot_product_attention over setitem\[positions\] via repeat_kv"),
    "torchtune-index_copy": (dict(name="torchtune", write="index_copy"), PROMPT, NEW,
                             r"scaled_dot_product_attention over index_copy_ via repeat_kv"),
    "stacked": (dict(name="stacked"), PROMPT, NEW,
                r"matmul-softmax-matmul over setitem\[a:b\] \(layer \d of a cache stacked over "
                r"layers\) via positions \[:(66|n)\] \+ repeat_kv \+ transpose\(1, 2\)"),
    "gemma": (dict(name="gemma"), PROMPT, NEW,
              r"matmul-softmax-matmul over index_copy_ via repeat_interleave\(2, dim=2\) \+ transpose\(1, 2\)"),
    "deepseek": (dict(name="deepseek"), PROMPT, NEW,
                 r"einsum-softmax-einsum over setitem\[a:b\] via positions \[:(66|n)\]"),
    # multi-head latent attention decompressed: K = nope 32 + rope 16 = 48 channels, V 32
    "deepseek-mla": (dict(name="deepseek", mla=(64, 32, 16, 32)), PROMPT, NEW,
                     r"einsum-softmax-einsum over setitem\[a:b\] via positions \[:(66|n)\]"),
    # absorbed (DeepSeek's default): the latent [B, S, 64] and the RoPE key [B, S, 16] cached
    "deepseek-absorbed": (dict(name="deepseek", mla=(64, 32, 16, 32), absorb=True), PROMPT, NEW,
                          r"absorbed multi-head latent attention over setitem\[a:b\] via "
                          r"positions \[:(66|n)\]"),
    # HF-style absorbed MLA (madsys-dev/deepseekv2-profile): [B, 1, T, C] cat caches, matmul
    "latent-hf": (dict(name="latent-hf", mla=(64, 32, 16, 32)), PROMPT, NEW,
                  r"absorbed multi-head latent attention over torch\.cat\(\[past, new\], "
                  r"dim=-2\) via squeeze\(1\) \+ unsqueeze\(-3\)"),
    "window": (dict(name="window"), PROMPT, NEW,
               r"scaled_dot_product_attention over setitem\[a:b\] via positions \[(18|lo)?:(66|n)\]"),
    "window-short": (dict(name="window"), 44, 24,
                     r"scaled_dot_product_attention over setitem\[a:b\] via positions \[(lo)?:(44|n)\]"),
}

#: name -> (build keywords, {layer: the reason regex} (others rewritten))
TWINS = {
    "torchtune": (dict(name="torchtune", write="late_v"),
                  {0: r"^keys and values are written at positions the pass cannot prove equal$",
                   1: r"^keys and values are written at positions the pass cannot prove equal$"}),
    "stacked": (dict(name="stacked", twin=True),
                {i: r"^its key cache is written by \.index_copy_\(\) \(codebases\.py:\d+\), which the "
                    r"pass does not recognize as a KV-cache update$" for i in (0, 1)}),
    "gemma": (dict(name="gemma", twin=True),
              {i: r"^not recognized: softmax over a q·kᵀ product \(matmul -> truediv -> tanh -> mul "
                  r"-> add -> float -> softmax\): tanh \(codebases\.py:\d+\) between the product "
                  r"and the softmax is not one of the steps the pass follows; " for i in (0, 1)}),
    "deepseek": (dict(name="deepseek", twin=True),
                 {i: r"^not recognized: softmax over a q·kᵀ product \(einsum -> mul -> softmax\): "
                     r"the softmax runs over the heads axis of the scores \(einsum "
                     r"'bshd,bthd->bsth'\), not over the keys; " for i in (0, 1)}),
    "deepseek-mla": (dict(name="deepseek", mla=(64, 32, 16, 32), twin=True),
                     {i: r"^its values come from the KV cache written by x\[\.\.\.\] = \.\.\. "
                         r"\(codebases\.py:\d+\), but reach the attention through x\[\.\.\.\] "
                         r"\(codebases\.py:\d+\), which reads part of the heads or head dim" for i in (0, 1)}),
    "deepseek-absorbed": (dict(name="deepseek", mla=(64, 32, 16, 32), absorb=True, twin=True),
                          {i: r"^the scores and the ·v product read the latent (up to|from) "
                              r"different positions$" for i in (0, 1)}),
    "latent-hf": (dict(name="latent-hf", mla=(64, 32, 16, 32), twin=True),
                  {i: r"^not recognized: softmax over a q·kᵀ product \(matmul -> mul -> add -> add "
                      r"-> softmax\): the scores add two q·kᵀ products \(add \(codebases\.py:\d+\)\) "
                      r"in a way the pass does not follow; " for i in (0, 1)}),
    "window": (dict(name="window", twin=True),
               {1: r"^its keys come from the KV cache written by x\[\.\.\.\] = \.\.\. \(codebases\.py:"
                   r"\d+\), but reach the attention through x\[\.\.\.\] \(codebases\.py:\d+\), which "
                   r"reads the newest positions \(-48:\) of an axis, not a prefix; the pass does "
                   r"not follow that step$"}),
}

RESULTS: dict[tuple[str, str], tuple[float, float]] = {}


def _prompt(n: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(1))


def _run(preset: str, name: str, prompt: int, new: int, **cfg):
    """(backend, per-step logits: compiled, uncompressed, through a whole-sequence cache of
    the preset), all with the compiled run's tokens."""
    torch._dynamo.reset()
    model = build(name, **cfg)
    ids = _prompt(prompt)
    backend = kvarn_backend(preset, group_size=32, compiler="eager")
    m = copy.deepcopy(model)
    tokens, got = run_generate(m, ids, new, step=torch.compile(m, backend=backend))
    _, fp = run_generate(copy.deepcopy(model), ids, new, forced=tokens)
    with reference(backend.config):
        _, quantized = run_generate(copy.deepcopy(model), ids, new, forced=tokens)
    assert len(set(tokens[0].tolist())) > 1 or new == 1, "degenerate model"
    return backend, got, fp, quantized


def _errors(got, fp, quantized) -> tuple[float, float]:
    """Largest relative logit error of the compiled run and of the preset itself; asserts
    every step within MARGIN x the preset's error + RTOL."""
    worst = own = 0.0
    for step, (g, f, q) in enumerate(zip(got, fp, quantized)):
        scale = f.abs().max().item()
        err, ref = (g - f).abs().max().item(), (q - f).abs().max().item()
        assert err <= MARGIN * ref + RTOL * scale, \
            f"step {step}: logit error {err:.3g} > {MARGIN} x the preset's {ref:.3g} + {RTOL} x {scale:.3g}"
        worst, own = max(worst, err / scale), max(own, ref / scale)
    return worst, own


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("case", list(CASES))
def test_codebase_is_rewritten_within_the_quantization_error(case, preset):
    kw, prompt, new, spelling = CASES[case]
    backend, got, fp, quantized = _run(preset, prompt=prompt, new=new, **kw)
    report = backend.report
    assert report.sites and not report.unchanged, str(report)
    assert {s.name for s in report.sites} == {"layers.0.attn", "layers.1.attn"}, str(report)
    for site in report.sites:
        assert re.fullmatch(spelling, f"{site.attention} over {site.cache} via {site.read}"), site.line()
    err, own = _errors(got, fp, quantized)
    assert own > 1e-4, "the preset changed nothing: the comparison would be vacuous"
    RESULTS[(case, preset)] = (err, own)


@pytest.mark.parametrize("twin", list(TWINS))
def test_twin_is_left_unchanged_with_the_true_reason(twin):
    kw, reasons = TWINS[twin]
    backend, got, fp, quantized = _run("k4v2", prompt=PROMPT, new=NEW, **kw)
    report = backend.report
    assert report.sites, str(report)
    for site in report.sites:
        layer = int(site.name.split(".")[1])
        if layer in reasons:
            assert not site.rewritten and re.search(reasons[layer], site.reason), site.line()
        else:
            assert site.rewritten, site.line()
    if len(reasons) == 2:       # nothing rewritten: exactly the uncompressed model
        for g, f in zip(got, fp):
            torch.testing.assert_close(g, f, rtol=1e-5, atol=1e-5)
    else:
        _errors(got, fp, quantized)


def test_absorbed_latent_attention_computes_the_decompressed_form():
    """DeepSeek's default latent attention, absorbed (the up-projection folded into the
    queries and the output, scores = q_lat·latentᵀ + q_pe·peᵀ over caches with no heads axis),
    uncompressed, computes what the decompressed form computes with the same weights: the
    "deepseek-absorbed" case above compares the packed run with the model itself."""
    ids = _prompt(PROMPT)
    tokens, fp = run_generate(build("deepseek", mla=(64, 32, 16, 32), absorb=True), ids, NEW)
    _, naive = run_generate(build("deepseek", mla=(64, 32, 16, 32)), ids, NEW, forced=tokens)
    for a, b in zip(fp, naive):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_einsum_bsht_mask_is_permuted_for_the_queries():
    """DeepSeek's mask [S, T] reaches the [B, S, H, T] scores as mask.unsqueeze(1): the
    rewritten attention takes it as [1, 1, S, T] (a prefill of a second request, T > S)."""
    torch._dynamo.reset()
    model = build("deepseek")
    backend = kvarn_backend("k4v2", group_size=32, key_bits=8, value_bits=8, compiler="eager")
    m = copy.deepcopy(model)
    step = torch.compile(m, backend=backend)
    fp = copy.deepcopy(model)
    with torch.no_grad():
        for start, n in ((0, 40), (40, 30)):           # a chunked prefill: T = 70 > S = 30
            ids = _prompt(70)[:, start:start + n]
            got, want = step(ids, start), fp(ids, start)
    assert backend.report.sites and not backend.report.unchanged, str(backend.report)
    # 8-bit codes: a mask applied along the wrong axis would move the logits far more
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()


def teardown_module():
    if RESULTS:
        print("\ncodebase             preset  max rel. logit err  preset's own")
        for (case, preset), (err, own) in sorted(RESULTS.items()):
            print(f"{case:20s} {preset:6s}  {err:18.3g}  {own:12.3g}")


def test_a_stacked_cache_keeps_its_packed_layers_when_another_cache_runs_in_between():
    """Two sequences on one compiled model, each in its own stacked cache ([L, B, S, H, D]
    buffers swapped on the model, as a server keeps one cache per request): the packed
    states follow the cache tensor and its layer, not the site name. Sequence A continues
    after B ran (B longer than A, so a state keyed by name would take A's next step as a
    rollback into B's tokens: other logits, no error) with A's own logits, the logits of
    an uninterrupted run."""
    def steps(model, step, ids, start, tokens):
        with torch.no_grad():
            out = [step(ids, start)[:, -1]]
            for i, t in enumerate(tokens):
                out.append(step(t.view(1, 1), start + ids.shape[1] + i)[:, -1])
        return out

    a = _prompt(40)
    b = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(2))
    forced = torch.randint(0, 128, (6,), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    alone = build("stacked")
    want = steps(alone, torch.compile(alone, backend=kvarn_backend("k4v4", group_size=32,
                                                                      compiler="eager")),
                 a, 0, forced)
    torch._dynamo.reset()
    model = build("stacked")
    step = torch.compile(model, backend=kvarn_backend("k4v4", group_size=32, compiler="eager"))
    got = steps(model, step, a, 0, forced[:3])
    cache_a = (model.cache_k, model.cache_v)
    model.cache_k, model.cache_v = torch.zeros_like(cache_a[0]), torch.zeros_like(cache_a[1])
    steps(model, step, b, 0, forced[:2])                       # request B, 72 tokens
    model.cache_k, model.cache_v = cache_a
    with torch.no_grad():
        for i, t in enumerate(forced[3:]):
            got.append(step(t.view(1, 1), a.shape[1] + 3 + i)[:, -1])
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item(),
                                   msg=f"step {i}")


def test_a_stacked_cache_read_in_full_precision_by_another_graph_stops_before_it_runs():
    """A graph the pass does not rewrite that reads a stacked cache whose layers are packed
    (here a plain function over the model's buffer, compiled with the same backend) would
    read stale values: it stops with a one-line error before running."""
    torch._dynamo.reset()
    model = build("stacked")
    backend = kvarn_backend("k4v4", group_size=32, compiler="eager")
    with torch.no_grad():
        torch.compile(model, backend=backend)(_prompt(40), 0)
    peek = torch.compile(lambda cache: cache[0, :, :40].float().sum(), backend=backend)
    with pytest.raises(RuntimeError, match=r"layer \d of a cache stacked over layers\) in full precision"):
        peek(model.cache_k)
    other = torch.zeros_like(model.cache_k)            # a cache no graph packs: runs
    assert float(peek(other)) == 0.0


def test_an_uncompiled_forward_over_a_packed_stacked_cache_stops_before_it_runs():
    """The compiled graphs keep a stacked cache's layers packed and never write the model's
    buffer, so an uncompiled forward over it (``set_stance("force_eager")``) would read zeros
    as the prompt's keys (relative logit error 0.39, no error, before). Its buffers are
    typed between calls: that forward stops with a one-line error before it runs, and the
    compiled model continues as if it had not been tried. A new cache made like the buffer
    (``zeros_like``) and a whole-buffer reset (``zero_()``) read nothing and pass; after
    the reset the next compiled prompt starts a new sequence."""
    from kvarn_compile.cache_book import PackedBuffer

    def compiled():
        torch._dynamo.reset()
        model = build("stacked")
        return model, torch.compile(model, backend=kvarn_backend("k4v4", group_size=32,
                                                                     compiler="eager"))

    ids = _prompt(42)
    twin, twin_step = compiled()
    with torch.no_grad():
        want = [twin_step(ids[:, :40], 0), twin_step(ids[:, 40:41], 40)]
    model, step = compiled()
    with torch.no_grad():
        got = [step(ids[:, :40], 0)]
        assert type(model.cache_k) is PackedBuffer and type(model.cache_v) is PackedBuffer
        with torch.compiler.set_stance("force_eager"), pytest.raises(
                RuntimeError, match=r"^kvarn_backend: __setitem__\(\) outside the compiled model "
                                    r"touches the KV cache of .*cannot take tokens written there back"):
            step(ids[:, 40:41], 40)
        got.append(step(ids[:, 40:41], 40))
        for i, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, rtol=0, atol=0, msg=f"step {i}")
        assert type(torch.zeros_like(model.cache_k)) is torch.Tensor
        model.reset()                                     # zero_() on both buffers
        torch.testing.assert_close(step(ids[:, :40], 0), want[0], rtol=0, atol=0)


def test_deepseek_own_loop_under_inference_mode_in_bf16():
    """DeepSeek-V3's generate runs under ``torch.inference_mode`` in bf16, two prompts in a
    cache sized for more rows: Inductor's aliases of the model's buffers are inference
    tensors there (no version counter), and the adoption step must not trip over them."""
    torch._dynamo.reset()
    model = build("deepseek", mla=(64, 32, 16, 32), absorb=True, max_batch=4).to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    backend = kvarn_backend("k4v4", group_size=32)
    m = copy.deepcopy(model)
    with torch.inference_mode():
        tokens, got = m.generate(ids, NEW, step=torch.compile(m, backend=backend))
        _, fp = copy.deepcopy(model).generate(ids, NEW, forced=tokens)
        with reference(backend.config):
            _, quantized = copy.deepcopy(model).generate(ids, NEW, forced=tokens)
    assert len(backend.report.rewritten) == 4 and not backend.report.unchanged, str(backend.report)
    _errors([g.float() for g in got], [f.float() for f in fp], [q.float() for q in quantized])


def test_absorbed_latent_cache_read_by_an_eager_call_in_between():
    """A compiled prefill packs the absorbed model's [B, S, C] latent buffers; a decode step
    run uncompiled reads them: they are dequantized into the model's buffers first (the
    report says so), and the next compiled steps pack them again. Every step stays close to
    the uncompressed model (a step reading the released buffers would be ~100% off)."""
    torch._dynamo.reset()
    model = build("deepseek", mla=(64, 32, 16, 32), absorb=True)
    ids = _prompt(70)
    fp, m = copy.deepcopy(model), copy.deepcopy(model)
    backend = kvarn_backend("k4v4", group_size=32, compiler="eager")
    step = torch.compile(m, backend=backend)
    with torch.no_grad():
        for start, end, fn in ((0, PROMPT, step), (PROMPT, PROMPT + 1, m),
                               (PROMPT + 1, PROMPT + 2, step), (PROMPT + 2, PROMPT + 3, step)):
            got, want = fn(ids[:, start:end], start), fp(ids[:, start:end], start)
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < 0.05, (start, rel)
    # every graph rewritten: prefill and decode (torch 2.13 traces the decode once more after
    # the eager call gave the buffers back their type, and compiles it for itself: its inputs
    # have symbolic shapes)
    assert len(backend.report.rewritten) >= 4 and not backend.report.unchanged, str(backend.report)
    assert any("was dequantized into the model's buffer" in n for n in backend.report.notes)
