"""Context-parallel decoding on CPU ranks over gloo (``kvarn_compile.ops.context_parallel``).

The ranks are started with ``torch.multiprocessing`` (spawn) from the test; every
collective has the process group's timeout, and the test joins the ranks with its own.
Each rank computes the single-process result of the same scenario itself (same seeds, no
collective), so every comparison is exact bookkeeping against one process:

* ops: random K/V (GQA, a bool mask, a sliding window, a causal multi-token chunk,
  per-tile key frames with outlier channels, two batch rows of different lengths) appended
  as a prompt then decoded step by step; at every step the context-parallel attention is
  within float noise of the single-process ``kvarn::attention``; the rank's tiles are the
  single-process tiles of its range bit for bit; its tile slots are ceil(n / ranks);
* a tiny transformers Llama (random weights): ``KVarNCache(context_parallel=True)`` with the
  ``kvarn`` attention, ``kvarn_backend(context_parallel=True)`` over the dynamic cache (the
  default ``dynamic`` of torch.compile, as ``model.compile`` has it) and over a lazily
  initialized ``StaticCache`` (the decode graph adopts the prompt; eager compiler), and
  ``compiler="inductor"`` over an initialized ``StaticCache``: greedy tokens equal to the
  single-process KVarN run, no more compiled graphs, bytes per rank. One spawn runs every
  mode on the ranks while the test process computes the single-process runs of the same
  modes (once, instead of once per rank);
* a rank that raises ends the other rank's collective with the timeout error, not a hang.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import tempfile
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from kvarn_compile.config import get_config

PRESET = dict(preset="k4v2", group_size=32)
MAX_LEN = 320
TIMEOUT_S = 20
#: the model runs: a rank may wait in a collective while the other compiles, on a 2-core
#: machine shared with the test process's single-process runs
MODEL_TIMEOUT_S = 60
MODEL_MODES = ["kvarncache", "backend_dynamic", "backend_static", "inductor_static"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int, timeout_s: float) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


# ------------------------------------------------------------------------------ scenarios
def _ops_scenario(cp_handle) -> dict:
    """Random streams through cp_append_ / cp_attention vs the single-process ops."""
    from kvarn_compile.ops import context_parallel as cp
    from kvarn_compile.state import StateLayout, allocate_layer

    results = {}
    cases = {
        "gqa_mask": dict(cfg=dict(PRESET), heads=2, q_heads=4, batch=1, prompt=150, mask=True),
        "window": dict(cfg=dict(PRESET), heads=2, q_heads=2, batch=1, prompt=200, window=70),
        "chunks_frames_batch2": dict(cfg=dict(preset="k4v4", group_size=32), heads=2, q_heads=4,
                                     batch=2, prompt=140, chunk=5, outliers=True),
        "k2v2_g64": dict(cfg=dict(preset="k2v2", group_size=64), heads=1, q_heads=3, batch=1,
                         prompt=250),
    }
    for label, c in cases.items():
        config = get_config(c["cfg"].pop("preset"), **c["cfg"])
        gen = torch.Generator().manual_seed(0)
        b, h, hq, d = c["batch"], c["heads"], c["q_heads"], 32
        total = c["prompt"] + 12
        k_all = torch.randn(b, h, total, d, generator=gen)
        v_all = torch.randn(b, h, total, d, generator=gen)
        if c.get("outliers"):
            k_all[:, 0, :, 3] += 150.0          # a bias-like channel: plain key frames
        max_len = total + 8        # small, so the sequence reaches the last rank's tiles
        kw = dict(batch=b, kv_heads=h, head_dim=d, max_len=max_len, dtype=torch.float32)
        single = allocate_layer(config, **kw)
        mine = cp.allocate(cp_handle, config, **kw)
        args = (config.op_method, config.sinkhorn_iters, config.recent_window, 0, False, "t")
        mask_full = torch.rand(b, 1, 1, max_len, generator=gen) > 0.2 if c.get("mask") else None
        errs = []
        pos, chunk = 0, c["prompt"]
        while pos < total:
            t = min(chunk, total - pos)
            start = torch.full((b,), pos, dtype=torch.int64)
            sl = slice(pos, pos + t)
            k, v = k_all[:, :, sl].contiguous(), v_all[:, :, sl].contiguous()
            torch.ops.kvarn.append_(single.buffers, k, v, start, *args)
            torch.ops.kvarn.cp_append_(mine.buffers, k, v, start, *args, cp_handle.key)
            q = torch.randn(b, hq, t, d, generator=gen)
            mask = None if mask_full is None else mask_full.expand(b, 1, t, max_len)
            att = (q, mask, d ** -0.5, True, c.get("window", 0))
            ref = torch.ops.kvarn.attention(q, single.buffers, *att[1:])
            out = torch.ops.kvarn.cp_attention(q, mine.buffers, *att[1:], cp_handle.key)
            errs.append(float((out - ref).abs().max() / ref.abs().max()))
            pos += t
            chunk = c.get("chunk", 1)
        layout = StateLayout.of(single.buffers)
        n_local, off = mine.max_tiles, mine.tile_offset
        same = True
        for name, a, m in zip(layout.names, single.buffers, mine.buffers):
            if name in cp._PER_TILE:
                same &= torch.equal(a[:, :, off:off + n_local][:, :, :m.shape[2]],
                                    m[:, :, :max(0, min(n_local, a.shape[2] - off))])
            else:
                same &= torch.equal(a, m) if name != "capacity" else True
        results[label] = dict(max_rel_err=max(errs), same_tiles=bool(same), n_local=n_local,
                              n_single=single.max_tiles, offset=off,
                              tiles_filled=int(single.n_tiles.max()),
                              held=mine.tiles_held(), batch=b,
                              expected_held=sum(max(0, min(n - off, n_local))
                                                for n in single.n_tiles.tolist()),
                              tile_bytes=mine.tile_bytes(),
                              nbytes=mine.nbytes, nbytes_single=single.nbytes,
                              plain_tiles=int(single.k_plain.sum()) if single.k_plain is not None else 0)
    return results


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=512, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def _generate(model, ids, cache, backend=None, new=8, dynamic=False):
    from transformers import GenerationConfig

    from kvarn_compile.testing import cache_arg

    gen = GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=0)
    fwd = model.forward
    if backend is not None:
        model.forward = torch.compile(fwd, backend=backend, dynamic=dynamic)
    try:
        with torch.no_grad():
            out = model.generate(ids, generation_config=gen, **cache_arg(model, cache))
    finally:
        model.forward = fwd
    return out[0, ids.shape[1]:].tolist()


def _model_run(mode: str, cp) -> dict:
    """One generation of the tiny Llama in ``mode`` (MODEL_MODES); ``cp``: None (one
    process) or the context-parallel group."""
    import torch._dynamo
    from transformers import DynamicCache, StaticCache

    from kvarn_compile import kvarn_backend
    from kvarn_compile.hf import KVarNCache, static_cache_for, use_kvarn_attention

    model = _tiny_llama()
    # 150 + 8 tokens in a cache of 176: 4 tiles of 32 after the 32-token sink, 2 per rank,
    # 3 filled: both ranks hold tiles
    ids = torch.randint(1, 128, (1, 150), generator=torch.Generator().manual_seed(1))
    max_len = 176
    torch._dynamo.reset()
    extra = {} if cp is None else dict(context_parallel=cp)
    if mode == "kvarncache":
        use_kvarn_attention(model)
        cache = KVarNCache(model.config, max_len, **PRESET, **extra)
        toks = _generate(model, ids, cache)
        return dict(tokens=toks, nbytes=cache.nbytes, graphs=0,
                    tiles=sum(layer.state.tiles_held() for layer in cache.layers))
    backend = kvarn_backend(**PRESET, max_cache_len=max_len,
                            compiler="inductor" if mode == "inductor_static" else "eager", **extra)
    dynamic = False
    if mode == "inductor_static":     # initialized up front: the prefill is rewritten too
        cache = static_cache_for(model, max_len)
    elif mode == "backend_static":    # lazily initialized: the decode graph adopts the prompt
        cache = StaticCache(config=model.config, max_cache_len=max_len)
    elif mode == "backend_dynamic":   # torch.compile's default: the decode graph is dynamic
        cache, dynamic = DynamicCache(config=model.config), None
    else:
        raise ValueError(f"unknown mode {mode!r}")
    try:
        toks = _generate(model, ids, cache, backend, dynamic=dynamic)
        return dict(tokens=toks, nbytes=backend.nbytes, graphs=backend.report.graphs,
                    sites=sum(r.rewritten for r in backend.report.sites),
                    tiles=sum(s.tiles_held() for s in backend.states.values()))
    finally:
        torch._dynamo.reset()       # (the backend's states go with its graphs)


def _latent_run(cp) -> dict:
    """The absorbed-MLA DeepSeek-style model (its own loop) with
    ``kvarn_backend(context_parallel=...)``: its sites have no context-parallel form, so they
    must stay unchanged (full precision) and the logits equal the uncompressed model's."""
    import copy

    import torch._dynamo

    from kvarn_compile import kvarn_backend
    from kvarn_compile.testing.codebases import build, run_generate

    torch._dynamo.reset()
    model = build("deepseek", mla=(64, 32, 16, 32), absorb=True, max_len=120)
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    tokens, fp = run_generate(copy.deepcopy(model), ids, 3)
    backend = kvarn_backend(**PRESET, compiler="eager", context_parallel=cp)
    m = copy.deepcopy(model)
    _, got = run_generate(m, ids, 3, step=torch.compile(m, backend=backend), forced=tokens)
    return dict(reasons=[r.reason for r in backend.report.sites if not r.rewritten],
                rewritten=len(backend.report.rewritten),
                max_diff=max((g - f).abs().max().item() for g, f in zip(got, fp)))


def _weights_run(cp) -> dict:
    """An eager attention that also returns its weights (``output_attentions``,
    ``tests/passes/test_returned_weights.py``) with ``kvarn_backend(context_parallel=...)``:
    ``kvarn::attention_weights`` has no context-parallel form (a rank holds only its share of
    the tiles), so the site stays unchanged and the outputs equal the model's."""
    import torch._dynamo

    from kvarn_compile import kvarn_backend
    from tests.passes.test_returned_weights import EagerWeights, _steps

    torch._dynamo.reset()
    backend = kvarn_backend(**PRESET, compiler="eager", context_parallel=cp)
    module, plain = EagerWeights(), EagerWeights()
    compiled = torch.compile(module, backend=backend)
    diffs = [max((a - b).abs().max().item() for a, b in zip(compiled(*args), plain(*args)))
             for args in _steps()]
    return dict(reasons=[r.reason for r in backend.report.sites if not r.rewritten],
                rewritten=len(backend.report.rewritten), max_diff=max(diffs))


def _worker(rank: int, world: int, port: int, what: str, outdir: str) -> None:
    result: dict = {}
    try:
        _init(rank, world, port, {"failure": 6, "models": MODEL_TIMEOUT_S}.get(what, TIMEOUT_S))
        from kvarn_compile.ops import context_parallel as cp

        handle = cp.register(True)
        result["rank"], result["world"] = handle.rank, handle.world
        if what == "ops":
            result["ops"] = _ops_scenario(handle)
        elif what == "models":
            result["models"] = {mode: _model_run(mode, handle.group) for mode in MODEL_MODES}
        elif what == "latent":
            result["latent"] = _latent_run(handle.group)
            result["weights"] = _weights_run(handle.group)
        elif what == "failure":
            config = get_config(**PRESET)
            state = cp.allocate(handle, config, batch=1, kv_heads=1, head_dim=32, max_len=MAX_LEN,
                                dtype=torch.float32)
            k = torch.randn(1, 1, 100, 32)
            torch.ops.kvarn.cp_append_(state.buffers, k, k, torch.zeros(1, dtype=torch.int64),
                                       config.op_method, 8, 0, 0, False, "t", handle.key)
            if rank == 1:
                raise RuntimeError("rank 1 fails on purpose")
            t0 = time.monotonic()
            try:
                torch.ops.kvarn.cp_attention(torch.randn(1, 1, 1, 32), state.buffers, None,
                                             32 ** -0.5, True, 0, handle.key)
                result["error"] = None
            except Exception as err:   # the collective's timeout
                result["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            result["waited_s"] = time.monotonic() - t0
    except Exception:
        result["exception"] = traceback.format_exc()
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))


def _run(what: str, world: int = 2, timeout: float = 240, while_running=None) -> list[dict]:
    """Every rank's result; ``while_running`` (if any) runs in this process meanwhile."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, what, outdir)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            if while_running is not None:
                while_running()
        except BaseException:
            for p in procs:
                p.kill()
            raise
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        assert not alive, f"{what}: ranks still running after {timeout} s (a hang)"
        results = []
        for r in range(world):
            path = os.path.join(outdir, f"rank{r}.pt")
            assert os.path.exists(path), f"{what}: rank {r} wrote no result (exit code {procs[r].exitcode})"
            results.append(torch.load(path))
    return results


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("world", [2, 3])
def test_ops_match_one_process(world):
    results = _run("ops", world)
    for res in results:
        assert "exception" not in res, res["exception"]
        for label, r in res["ops"].items():
            where = f"{label}, rank {res['rank']} of {world}"
            assert r["max_rel_err"] < 2e-5, f"{where}: {r['max_rel_err']}"
            assert r["same_tiles"], f"{where}: tiles differ from the one-process tiles of its range"
            assert r["n_local"] == math.ceil(r["n_single"] / world), where
            assert r["offset"] == res["rank"] * r["n_local"], where
            assert r["held"] == r["expected_held"], where
            # the packed region per rank: n_local of the one-process n tile slots
            assert r["nbytes_single"] - r["nbytes"] == \
                r["batch"] * (r["n_single"] - r["n_local"]) * r["tile_bytes"], where
    # the streams reach the last rank's range (its tiles are compared, not only empty slots)
    assert any(results[0]["ops"][label]["tiles_filled"] > results[-1]["ops"][label]["offset"]
               for label in results[0]["ops"]), "no case fills the last rank's tiles"
    assert results[0]["ops"]["chunks_frames_batch2"]["plain_tiles"] > 0


@pytest.fixture(scope="module")
def model_runs():
    """(every rank's context-parallel runs, the single-process runs), per mode."""
    single = {}

    def single_process():          # while the ranks run, on one thread as they do
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for mode in MODEL_MODES:
                single[mode] = _model_run(mode, None)
        finally:
            torch.set_num_threads(threads)

    return _run("models", timeout=480, while_running=single_process), single


def _check_models(model_runs, modes: list[str]) -> None:
    results, single = model_runs
    for res in results:
        assert "exception" not in res, res["exception"]
        for mode in modes:
            r, ref = res["models"][mode], single[mode]
            where = f"{mode}, rank {res['rank']}"
            assert len(set(ref["tokens"])) > 2, f"{mode}: degenerate model, a vacuous comparison"
            assert r["tokens"] == ref["tokens"], where
            assert r["graphs"] <= ref["graphs"], where
            assert r["nbytes"] < ref["nbytes"], where
            assert r["tiles"] > 0, f"{where}: this rank holds no tile"
            if "sites" in r:
                assert r["sites"] == ref["sites"] > 0, where
    for mode in modes:
        held = sum(res["models"][mode]["tiles"] for res in results)
        assert held == single[mode]["tiles"], f"{mode}: the ranks together hold every tile exactly once"


def test_models_generate_the_one_process_tokens(model_runs):
    _check_models(model_runs, ["kvarncache", "backend_dynamic", "backend_static"])


def test_inductor_generates_the_one_process_tokens(model_runs):
    _check_models(model_runs, ["inductor_static"])


def test_latent_attention_and_returned_weights_stay_unchanged_under_context_parallel():
    """kvarn::latent_attention and kvarn::attention_weights have no context-parallel form:
    under ``kvarn_backend(context_parallel=...)`` an absorbed-MLA site and an attention that
    returns its weights are left in full precision with that reason (rewriting them would
    read each rank's tiles only), exactly the model."""
    for r in _run("latent"):
        assert "exception" not in r, r["exception"]
        out = r["latent"]
        assert out["rewritten"] == 0 and len(out["reasons"]) == 4, out
        assert all("no context-parallel form yet" in why for why in out["reasons"]), out
        assert out["max_diff"] < 1e-4, out
        out = r["weights"]
        assert out["rewritten"] == 0 and len(out["reasons"]) == 2, out   # prefill, decode graphs
        assert all("which context_parallel does not compute" in why for why in out["reasons"]), out
        assert out["max_diff"] < 1e-5, out


def test_a_failing_rank_ends_the_other_with_an_error():
    results = _run("failure", timeout=90)
    assert "exception" in results[1] and "fails on purpose" in results[1]["exception"]
    assert "exception" not in results[0], results[0].get("exception")
    assert results[0]["error"] is not None, "the attention of rank 0 returned without rank 1"
    assert results[0]["waited_s"] < 60


def test_register_needs_an_initialized_group():
    from kvarn_compile.ops import context_parallel as cp

    with pytest.raises(ValueError, match="init_process_group"):
        cp.register(True)
    with pytest.raises(ValueError, match="ProcessGroup or True"):
        cp.register(None)
