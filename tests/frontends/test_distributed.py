"""Tensor parallelism on two CPU ranks over gloo: every rank keeps the packed cache of its heads.

The module is also the rank program: the tests start it with ``torchrun --standalone
--nproc-per-node 2 tests/frontends/test_distributed.py ...`` in a subprocess (with a wall-clock
timeout; every collective has the process group's timeout), and while the ranks run they
compute the single-process KVarN runs of the same scenarios in the test process. Each rank
writes its tokens, logits and report (:func:`kvarn_compile.distributed.rank_report`, and
the gathered summary) to a JSON file per scenario.

Models (tiny, random weights, saved once with ``save_pretrained``): a transformers Llama
(6 query / 2 KV heads of 32 channels, 2 layers) loaded with ``tp_plan="auto"``, and the
gpt-fast example sharded by ``examples/gpt_fast_tp.py`` (functional ``all_reduce``), with 2
KV heads (split: one per rank) and with 1 (MQA, replicated on both ranks). The preset is
k4v2 with G=32 and a 60-token prompt plus 6 new tokens, so a tile is frozen while decoding.

Per scenario (transformers: ``kvarn_backend`` over the dynamic cache and over a
``StaticCache``, ``KVarNCache`` with the ``kvarn`` attention, ``inductor_pass`` under
Inductor; gpt-fast: ``kvarn_backend`` with split and with replicated KV heads; slow:
``kvarn_backend(compiler="inductor")`` on both models), asserted:

1. greedy tokens equal to the single-process KVarN run, per-step logits within 1e-3 of the
   logit scale (the row-parallel sums add in another order);
2. packed bytes per rank: split heads hold half of the single-process bytes, up to the four
   int64 counters per layer and batch row that every rank keeps; replicated: all of them;
3. no more compiled graphs (backend/pass graphs and Dynamo graphs) than single-process,
   and the same sites rewritten on every rank, none left unchanged;
4. the model's own full-precision buffers released on every rank (static caches, gpt-fast);
5. a rank that raises, or hangs, ends the run with its error or a collective timeout,
   well before the test's timeout, never a hang.

A tiny model's Inductor compile takes tens of seconds per rank, so the tests of
``kvarn_backend``'s own Inductor path on both models (``kvarn_backend(compiler="inductor")``
over a ``StaticCache``, and the gpt-fast model) are marked ``slow``; the other scenarios use
``compiler="eager"``, but for one Inductor scenario (``inductor_pass``). One two-rank run
holds every scenario of the selected tests (the slow ones only when a slow test is
selected: ``-m "not slow"`` leaves them out), so the ranks start and warm up once. The
Inductor scenarios are compared with the one-process ``compiler="eager"`` run of the same
model (``REFERENCE``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[2]
PRESET = dict(preset="k4v2", group_size=32)
MAX_LEN = 256
PROMPT = 60
NEW = 6
LOGIT_RTOL = 1e-3
#: Inductor scenarios against the one-process eager run: Inductor sums in another order, so
#: an element at a quantizer rounding boundary may take the neighbouring code (as in
#: tests/frontends/test_backend_models.py, FLIP_RTOL); the tokens must still be equal.
INDUCTOR_LOGIT_RTOL = 5e-2
#: lengths, committed, n_tiles, capacity: int64 [B] per state, kept whole on every rank
COUNTER_BYTES = 4 * 8
RUN_TIMEOUT_S = 600      # the whole two-rank run (the collectives time out after PG_TIMEOUT_S)
PG_TIMEOUT_S = 60

#: distributed ops of the Dynamo graphs (DTensor parameters, functional collectives)
COLLECTIVE_OPS = ("to_local", "from_local", "redistribute", "all_reduce", "wait_tensor")

#: One two-rank run (one torchrun) does these; one of them compiles with Inductor.
SCENARIOS = ["hf_backend_dynamic", "hf_backend_static", "hf_kvarn_cache", "hf_inductor_pass",
             "gptfast_backend", "gptfast_replicated"]
#: Marked slow (in the same run when a slow test is selected): kvarn_backend's own Inductor
#: path (its lowerings, autotuning) on the tp_plan model and on the gpt-fast model.
SLOW_SCENARIOS = ["hf_backend_static_inductor", "gptfast_inductor"]
#: The one-process run an Inductor scenario is compared with: the same model, cache and
#: preset compiled with ``compiler="eager"`` (Dynamo's graphs do not depend on the compiler,
#: and Inductor's tokens equal eager's, tests/frontends/test_backend_models.py); this spares
#: the test process the Inductor compiles.
REFERENCE = {"hf_inductor_pass": "hf_backend_static", "hf_backend_static_inductor": "hf_backend_static",
             "gptfast_inductor": "gptfast_backend"}


# ------------------------------------------------------------------------------ scenarios
def save_tiny_llama(path: pathlib.Path) -> None:
    import torch
    import transformers as tf

    from kvarn_compile.testing import tiny_config_kwargs

    torch.manual_seed(0)
    config = tf.LlamaConfig(**tiny_config_kwargs())    # the tiny Llama of the other model tests
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tf.LlamaForCausalLM(config).save_pretrained(path)


def _prompt():
    import torch

    return torch.randint(2, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def _load_hf(model_dir: str, tp: int):
    import torch
    from transformers import AutoModelForCausalLM

    from kvarn_compile.distributed import hf_tp_kwargs

    kw = hf_tp_kwargs() if tp > 1 else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     attn_implementation="sdpa", **kw).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _hf_generate(model, cache=None) -> dict:
    import torch

    from kvarn_compile.testing import cache_arg

    kw = {} if cache is None else cache_arg(model, cache)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(_prompt(), max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **kw)
    return {"tokens": out.sequences[0, PROMPT:].tolist(),
            "logits": [step[0].tolist() for step in out.logits]}


def _left(tensors) -> int:
    """Bytes of storage the model's own K/V tensors still hold in memory (a released buffer
    keeps its size but only the partial pages at its ends: counted as 0, see is_freed)."""
    from kvarn_compile.ops.buffers import is_freed

    return sum(0 if is_freed(t) else t.untyped_storage().nbytes() for t in tensors)


def hf_backend(model_dir: str, tp: int, cache_kind: str, compiler: str = "eager"):
    from kvarn_compile import kvarn_backend
    from kvarn_compile.hf import static_cache_for
    from kvarn_compile.testing import record_graphs

    model = _load_hf(model_dir, tp)
    backend = record_graphs(kvarn_backend(**PRESET, compiler=compiler, max_cache_len=MAX_LEN))
    model.compile(backend=backend)
    cache = static_cache_for(model, MAX_LEN) if cache_kind == "static" else None
    result = _hf_generate(model, cache)
    if cache is not None:
        result["cache_bytes_left"] = _left(t for layer in cache.layers
                                           for t in (layer.keys, layer.values))
    return result, backend


def hf_kvarn_cache(model_dir: str, tp: int):
    from kvarn_compile.hf import KVarNCache, use_kvarn_attention

    model = _load_hf(model_dir, tp)
    use_kvarn_attention(model)
    cache = KVarNCache(model.config, max_cache_len=MAX_LEN, **PRESET)
    return _hf_generate(model, cache), cache


def hf_inductor_pass(model_dir: str, tp: int):
    import kvarn_compile
    from kvarn_compile.hf import static_cache_for
    from kvarn_compile.testing import record_graphs

    model = _load_hf(model_dir, tp)
    kv = record_graphs(kvarn_compile.inductor_pass(**PRESET, max_cache_len=MAX_LEN))
    model.compile(options={"pre_grad_custom_pass": kv})
    cache = static_cache_for(model, MAX_LEN)
    result = _hf_generate(model, cache)
    result["cache_bytes_left"] = _left(t for layer in cache.layers for t in (layer.keys, layer.values))
    return result, kv


def _gpt_fast_tp():
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvarn_example_gpt_fast_tp",
                                                  ROOT / "examples" / "gpt_fast_tp.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def gptfast(tp: int, *, kv_heads: int = 2, compiler: str = "eager"):
    import torch
    import torch.distributed as dist

    from kvarn_compile import kvarn_backend
    from kvarn_compile.testing import record_graphs

    ex = _gpt_fast_tp()
    gf = ex.gf
    model = ex.build(gf.ModelArgs(vocab_size=128, n_head=4, n_local_heads=kv_heads))
    if tp > 1:
        ex.apply_tp(model, dist.get_rank(), tp)
    model.setup_caches(max_batch_size=1, max_seq_length=MAX_LEN)
    backend = record_graphs(kvarn_backend(**PRESET, compiler=compiler))
    steps = []

    def step(idx, pos):
        logits = compiled(idx, pos)
        steps.append(logits[0, -1].tolist())
        return logits

    compiled = torch.compile(model, backend=backend)
    tokens = gf.generate(model, _prompt() % 128, NEW, step=step)
    buffers = [b for name, b in model.named_buffers() if name.endswith(("k_cache", "v_cache"))]
    return {"tokens": tokens[0].tolist(), "logits": steps, "cache_bytes_left": _left(buffers)}, backend


def run_scenario(name: str, model_dir: str, tp: int) -> dict:
    """One scenario on this process (``tp`` ranks of an initialized group, or 1)."""
    import torch
    from torch._dynamo.utils import counters

    from kvarn_compile.distributed import gather_report, rank_report

    torch._dynamo.reset()
    counters.clear()
    if name.startswith("hf_backend_"):
        cache_kind, _, compiler = name.removeprefix("hf_backend_").partition("_")
        result, obj = hf_backend(model_dir, tp, cache_kind, compiler or "eager")
    elif name == "hf_kvarn_cache":
        result, obj = hf_kvarn_cache(model_dir, tp)
    elif name == "hf_inductor_pass":
        result, obj = hf_inductor_pass(model_dir, tp)
    elif name.startswith("gptfast_"):
        kw = {"gptfast_replicated": dict(kv_heads=1),
              "gptfast_inductor": dict(compiler="inductor")}.get(name, {})
        result, obj = gptfast(tp, **kw)
    else:
        raise ValueError(f"unknown scenario {name!r}")
    mine = rank_report(obj)
    result["report"] = mine.__dict__
    for when, at in (("before", 0), ("after", 1)):      # the pass keeps every collective
        result[f"collectives_{when}"] = {
            op: sum(graphs[at].count(op) for graphs in getattr(obj, "graph_log", ()))  # a cache: none
            for op in COLLECTIVE_OPS}
    if tp > 1:
        summary = gather_report(obj)
        result["summary"] = summary.to_dict()
        result["summary_text"] = str(summary)
    return result


def rank_main(argv: list[str] | None = None) -> int:
    """The program each rank runs under torchrun (see the module docstring)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model-dir", default="")
    p.add_argument("--scenarios", nargs="*", default=[])
    p.add_argument("--pg-timeout", type=float, default=PG_TIMEOUT_S)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-mode", choices=["raise", "hang"], default="raise")
    opts = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=opts.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = pathlib.Path(opts.out)
    if rank == opts.fail_rank:
        if opts.fail_mode == "hang":
            print(f"rank {rank}: hanging on purpose", flush=True)
            time.sleep(3600)
        raise RuntimeError(f"injected failure on rank {rank}")
    if opts.fail_rank >= 0:     # the other ranks wait in a collective for the failed one
        from kvarn_compile import kvarn_backend
        from kvarn_compile.distributed import print_report

        print_report(kvarn_backend(**PRESET, compiler="eager"))
    for name in opts.scenarios:
        t0 = time.perf_counter()
        result = run_scenario(name, opts.model_dir, world)
        result["seconds"] = time.perf_counter() - t0
        (out / f"{name}.rank{rank}.json").write_text(json.dumps(result))
        if rank == 0:
            print(f"{name}: {result['seconds']:.1f} s\n{result['summary_text']}", flush=True)
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------ launching
def launch(out: pathlib.Path, *args: str, nproc: int = 2) -> subprocess.Popen:
    """``torchrun --standalone`` (a free port) running :func:`rank_main` on ``nproc`` ranks,
    in its own process group so that a timeout can end every rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", __file__, "--out", str(out), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    log = open(out / "ranks.log", "w")        # a file: a full pipe would stall the ranks
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    proc.log_path = log.name
    log.close()
    return proc


def wait(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """(exit status, output); on a timeout every rank is killed and the test fails with the
    output so far."""
    import pytest

    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        text = pathlib.Path(proc.log_path).read_text()
        pytest.fail(f"the two-rank run did not finish in {timeout:.0f} s (killed):\n{text[-6000:]}")
    return proc.returncode, pathlib.Path(proc.log_path).read_text()


if __name__ == "__main__":
    sys.exit(rank_main())


# ------------------------------------------------------------------------------ tests
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    save_tiny_llama(path)
    return path


def _two_ranks(base: pathlib.Path, model_dir: pathlib.Path, scenarios: list[str],
               single_process=lambda: None):
    """Every rank's results per scenario; ``single_process`` runs while the ranks do."""
    import torch

    t0 = time.perf_counter()
    proc = launch(base, "--model-dir", str(model_dir), "--scenarios", *scenarios)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single_process()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
    code, text = wait(proc, max(RUN_TIMEOUT_S - (time.perf_counter() - t0), 10))
    assert code == 0, f"the two-rank run failed (exit {code}):\n{text[-8000:]}"
    return {name: [json.loads((base / f"{name}.rank{r}.json").read_text()) for r in range(2)]
            for name in scenarios}


def _slow_selected(session) -> bool:
    """Whether a test of this module marked slow is selected (not deselected by -m / -k)."""
    here = pathlib.Path(__file__).resolve()
    return any(pathlib.Path(str(item.path)).resolve() == here and item.get_closest_marker("slow")
               for item in session.items)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, model_dir):
    """(two-rank results per scenario and rank, single-process results per scenario); the
    slow scenarios are in the same two-rank run when a slow test is selected."""
    import torch

    pytest.importorskip("accelerate", reason="tp_plan='auto' needs accelerate (pip install -e '.[test]')")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    single = {}

    def single_process():
        for name in SCENARIOS:
            if name not in REFERENCE:
                single[name] = run_scenario(name, str(model_dir), 1)

    scenarios = SCENARIOS + (SLOW_SCENARIOS if _slow_selected(request.session) else [])
    ranks = _two_ranks(tmp_path_factory.mktemp("tp"), model_dir, scenarios, single_process)
    single.update({name: single[ref] for name, ref in REFERENCE.items()})
    return ranks, single


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, model_dir, runs):
    ranks, single = runs
    if all(name in ranks for name in SLOW_SCENARIOS):
        return runs
    return _two_ranks(tmp_path_factory.mktemp("tp_slow"), model_dir, SLOW_SCENARIOS), single


def _results(request, name: str):
    return request.getfixturevalue("slow_runs" if name in SLOW_SCENARIOS else "runs")


ALL = SCENARIOS + [pytest.param(name, marks=pytest.mark.slow) for name in SLOW_SCENARIOS]


def _check_logits(got: list, want: list, what: str, rtol: float = LOGIT_RTOL) -> None:
    import torch

    for step, (a, b) in enumerate(zip(got, want)):
        a, b = torch.tensor(a), torch.tensor(b)
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err <= rtol, f"{what}: step {step} logits differ by {err:.2e} > {rtol}"


@pytest.mark.parametrize("name", ALL)
def test_two_ranks_equal_single_process(request, name):
    ranks, single = _results(request, name)
    ref = single[name]
    assert len(set(ref["tokens"])) > 2, "degenerate model: the comparison would be vacuous"
    for rank, got in enumerate(ranks[name]):
        what = f"{name} rank {rank}"
        assert got["tokens"] == ref["tokens"], f"{what}: tokens differ\n{got['summary_text']}"
        _check_logits(got["logits"], ref["logits"], what,
                      INDUCTOR_LOGIT_RTOL if name in REFERENCE else LOGIT_RTOL)


@pytest.mark.parametrize("name", ALL)
def test_bytes_per_rank(request, name):
    ranks, single = _results(request, name)
    ref = single[name]["report"]
    states = len(ref["kv_heads"])
    assert states == 2 and ref["nbytes"] > 0, ref["text"]
    counters = COUNTER_BYTES * states
    replicated = name == "gptfast_replicated"
    for rank, got in enumerate(ranks[name]):
        rep = got["report"]
        if replicated:          # one KV head, on both ranks
            assert rep["kv_heads"] == ref["kv_heads"] == [1, 1]
            assert rep["nbytes"] == ref["nbytes"], rep["text"]
        else:                   # two KV heads, one per rank
            assert rep["kv_heads"] == [1, 1] and ref["kv_heads"] == [2, 2]
            assert 2 * (rep["nbytes"] - counters) == ref["nbytes"] - counters, rep["text"]
        if "cache_bytes_left" in got:       # the model's own full-precision K/V are freed
            assert got["cache_bytes_left"] == 0 and single[name]["cache_bytes_left"] == 0
            share = 1 if replicated else 2
            # whole pages are released: equal up to the partial pages at each buffer's ends
            assert ref["released_bytes"] > 0
            assert abs(rep["released_bytes"] * share - ref["released_bytes"]) <= 64 * 4096
    summary = ranks[name][0]["summary"]
    assert summary == ranks[name][1]["summary"]
    assert summary["bytes_per_rank"] == [g["report"]["nbytes"] for g in ranks[name]]
    assert summary["bytes_total"] == sum(summary["bytes_per_rank"])


@pytest.mark.parametrize("name", ALL)
def test_no_extra_graphs_and_same_sites(request, name):
    ranks, single = _results(request, name)
    ref = single[name]["report"]
    for got in ranks[name]:
        rep = got["report"]
        assert rep["graphs"] <= ref["graphs"], f"{rep['graphs']} graphs vs {ref['graphs']}"
        assert rep["dynamo_graphs"] <= ref["dynamo_graphs"], (rep["dynamo_graphs"], ref["dynamo_graphs"])
        assert rep["sites"] == ref["sites"] and rep["unchanged"] == ref["unchanged"] == 0, rep["text"]
        assert rep["rewritten"] == ref["rewritten"]
        # nothing distributed was taken for a cache write or an attention: every collective
        # and DTensor conversion is still in the rewritten graphs
        before, after = got["collectives_before"], got["collectives_after"]
        assert after == before, (before, after)
        if name != "hf_kvarn_cache":
            assert before["all_reduce"] > 0 and before["wait_tensor"] > 0, before
        if name.startswith("hf_") and name != "hf_kvarn_cache":
            assert before["to_local"] > 0, before
    assert ranks[name][0]["summary"]["consistent"]


# ------------------------------------------------------------------------------ single process
def test_heads_rule():
    from kvarn_compile.distributed import tensor_parallel_heads

    split = tensor_parallel_heads(6, 2, 2)
    assert (split.q_heads, split.kv_heads, split.kv_replicas) == (3, 1, 1)
    assert [list(split.kv_range(r)) for r in range(2)] == [[0], [1]]
    assert list(split.q_range(1)) == [3, 4, 5]
    rep = tensor_parallel_heads(8, 2, 4)                   # vLLM: one KV head per rank, replicated
    assert (rep.q_heads, rep.kv_heads, rep.kv_replicas) == (2, 1, 2)
    assert [list(rep.kv_range(r)) for r in range(4)] == [[0], [0], [1], [1]]
    # query heads h of rank r read KV head h // (heads per KV head): the one the rank holds
    for r in range(4):
        assert {h // 4 for h in rep.q_range(r)} == set(rep.kv_range(r))
    with pytest.raises(ValueError, match="tp=2. Sizes that work: 1, 3, 9"):
        tensor_parallel_heads(9, 3, 2)
    with pytest.raises(ValueError, match="KV heads must divide by it, or it must be a multiple"):
        tensor_parallel_heads(12, 3, 4)
    with pytest.raises(ValueError, match="Sizes that work: 1, 2, 4"):
        tensor_parallel_heads(8, 4, 8, replicate_kv=False)


def test_kv_heads_per_rank_without_the_transformers_helper(monkeypatch):
    """transformers releases without ``get_kv_heads_per_rank`` (5.17, the GPU image's) get
    the same answers from kvarn's own rule, where the helper exists, its answers."""
    import builtins
    import importlib

    from kvarn_compile.hf import _kv_heads_per_rank

    plans = [({"layers.*.self_attn.k_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"},
              8, 2, 4),
             ({"layers.*.self_attn.qkv_proj": "colwise"}, 6, 4, None),  # 6 heads, 4 ranks
             ({"layers.*.mlp.experts": "local"}, 8, 2, 8),     # heads not sharded
             (None, 8, 2, 8)]
    tp_module = importlib.import_module("transformers.distributed.tensor_parallel")
    helper = getattr(tp_module, "get_kv_heads_per_rank", None)
    for plan, heads, tp, want in plans:
        assert _kv_heads_per_rank(plan, heads, tp) == want
        if helper is not None:
            assert helper(plan or {}, heads, tp) == want
    real_import = builtins.__import__

    def without_helper(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "transformers.distributed.tensor_parallel" and fromlist \
                and "get_kv_heads_per_rank" in fromlist:
            raise ImportError("cannot import name 'get_kv_heads_per_rank'")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", without_helper)
    for plan, heads, tp, want in plans:
        assert _kv_heads_per_rank(plan, heads, tp) == want


def test_hf_rule_refuses_smollm2_on_two_ranks():
    import transformers as tf

    from kvarn_compile.distributed import check_hf_tensor_parallel

    smollm2 = tf.LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                             head_dim=64, num_hidden_layers=1, intermediate_size=64)
    assert check_hf_tensor_parallel(smollm2, 3).kv_heads == 1
    with pytest.raises(ValueError, match=r"LlamaConfig with 9 query / 3 KV heads cannot be "
                                         r"loaded with tp_plan='auto' on 2 ranks.*Sizes that work: 1, 3"):
        check_hf_tensor_parallel(smollm2, 2)
    with pytest.raises(ValueError, match="does not replicate KV heads"):
        check_hf_tensor_parallel(tf.LlamaConfig(num_attention_heads=8, num_key_value_heads=2,
                                                hidden_size=256, num_hidden_layers=1), 4)


def test_report_without_process_group():
    import io

    import torch

    from kvarn_compile import kvarn_backend
    from kvarn_compile.distributed import gather_report, print_report

    backend = kvarn_backend(**PRESET, compiler="eager")
    with pytest.raises(TypeError, match="Expected a kvarn_backend, an inductor_pass or a KVarNCache"):
        gather_report(object())
    fn = torch.compile(lambda x: x + 1, backend=backend)
    fn(torch.ones(2))
    buf = io.StringIO()
    report = print_report(backend, file=buf, per_rank=True)
    assert report.world_size == 1 and report.bytes_total == 0 and report.consistent
    text = buf.getvalue()
    assert text.startswith("[rank 0] KVarN rewrite report: 0 attention site(s) rewritten")
    assert "KVarN tensor-parallel report: 1 rank(s), KVarNBackend" in text
    assert "bytes per rank: 0; total 0 bytes" in text


FAIL_MODES = ["raise", "hang"]


@pytest.fixture(scope="module")
def failure_runs(tmp_path_factory):
    """mode -> (exit status, output, seconds): both two-rank runs started together (their
    ranks mostly wait), each with rank 1 failing in its way."""
    t0 = time.perf_counter()
    procs = {mode: launch(tmp_path_factory.mktemp(f"fail_{mode}"), "--fail-rank", "1",
                          "--fail-mode", mode, "--pg-timeout", "3") for mode in FAIL_MODES}
    done = {}
    try:
        for mode, proc in procs.items():
            code, text = wait(proc, max(120 - (time.perf_counter() - t0), 1))
            done[mode] = (code, text, time.perf_counter() - t0)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return done


@pytest.mark.parametrize("mode", FAIL_MODES)
def test_failure_on_one_rank_ends_the_run(failure_runs, mode):
    code, text, elapsed = failure_runs[mode]
    assert code != 0, text[-4000:]
    if mode == "raise":
        assert "RuntimeError: injected failure on rank 1" in text, text[-4000:]
    else:    # rank 0's collective times out; torchrun then ends the hanging rank
        assert "rank 1: hanging on purpose" in text
        # gloo: "RuntimeError: [...] Timed out waiting 3000ms for ... operation to complete"
        assert re.search(r"\[rank0\]: RuntimeError: .*Timed out waiting 3000ms", text), text[-4000:]
    assert elapsed < 90, f"took {elapsed:.0f} s"
