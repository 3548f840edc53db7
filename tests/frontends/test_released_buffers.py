"""Model-owned K/V buffers that ``kvarn_backend`` released stay safe to use.

The rewritten graphs never read or write a model's own preallocated K/V buffers (the packed
state holds the tokens), so the backend frees their memory after every call
(``kvarn_compile.ops.keyed.release_storage``: on CPU the pages go back to the operating
system, the tensor keeps its storage and reads zeros). What users still do with them must
work:

* the model's generation flows: a warm-up ``generate``, a cache reset (``zero_()``, a
  ``reset_caches()`` method, ``StaticCache.reset()``), ``generate`` again; an uncompiled
  prefill into the model's buffers followed by compiled decoding, then a second request;
  two prompts of different lengths on one compiled model. Each gives the tokens of a fresh
  run, and the buffers are freed again afterwards.
* any eager access to a released buffer, in a child process so that a crash (a segfault
  reading freed memory) fails the test instead of killing the run: reset, index writes,
  copies, reductions, printing, ``.numpy()``, serialization, an uncompiled forward. The
  first eager access to a buffer whose tokens are packed gets them dequantized into it
  (``cache_book.PackedBuffer``); a buffer freed again reads zeros.
* the memory saving: the process's resident set drops by the buffers' bytes, also after a
  reset wrote them again.
"""

from __future__ import annotations

import copy
import json
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch
import transformers as tf

from kvarn_compile import kvarn_backend
from kvarn_compile.ops.buffers import is_freed, releasable, released
from kvarn_compile.testing import (
    EAGER_RTOL, EagerOracle, assert_same_generation, cache_arg, fp_prefill_then_kvarn,
    gpt_fast_model, llama_ref_model, tiny_generate, tiny_model, tiny_prompt, tiny_static_cache,
)
from kvarn_compile.testing import TINY_MAX_LEN as MAX_LEN, TINY_PRESET as PRESET

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")

ROOT = pathlib.Path(__file__).resolve().parents[2]
EIGHT_BIT = dict(PRESET, key_bits=8, value_bits=8)      # tokens equal full precision


# ------------------------------------------------------------------------------ examples
def _llama_ref():
    lm, model = llama_ref_model()
    buffers = [t for layer in model.layers for t in (layer.attention.cache_k, layer.attention.cache_v)]
    return lm, model, model.reset_caches, buffers


def _gpt_fast_model():
    gf, model = gpt_fast_model()
    buffers = [t for layer in model.layers
               for t in (layer.attention.kv_cache.k_cache, layer.attention.kv_cache.v_cache)]

    def reset():
        for t in buffers:
            t.zero_()
    return gf, model, reset, buffers


def _eager_prefill_generate(module, model, step, prompt, new):
    """The prompt through the uncompiled model (it writes the model's own buffers), the
    decoding steps through the compiled one."""
    t = prompt.shape[1]
    pos = (lambda a, b: torch.arange(a, b)) if module.__name__.endswith("gpt_fast_model") \
        else (lambda a, b: a)
    with torch.no_grad():
        out = [model(prompt, pos(0, t))[:, -1].argmax(-1, keepdim=True)]
        for i in range(new - 1):
            out.append(step(out[-1], pos(t + i, t + i + 1))[:, -1].argmax(-1, keepdim=True))
    return torch.cat(out, 1)


@pytest.mark.parametrize("example", ["llama_ref", "gpt_fast"])
def test_example_generation_flows(example):
    module, model, reset, buffers = _llama_ref() if example == "llama_ref" else _gpt_fast_model()
    fp_model = copy.deepcopy(model)
    backend = kvarn_backend(**EIGHT_BIT, compiler="eager")
    step = torch.compile(model, backend=backend)
    prompts = [tiny_prompt(seed, length=n) % 128 for seed, n in ((1, 60), (2, 60), (3, 45))]
    want = []
    for p in prompts:                     # full precision: at 8 bits the tokens are the same
        want.append(module.generate(fp_model, p, 6))
    assert len(set(want[0][0].tolist())) > 2, "degenerate model: the comparison would be vacuous"

    # a warm-up generate, a reset of the model's caches, generate again
    assert module.generate(model, prompts[0], 6, step=step).tolist() == want[0].tolist()
    assert all(is_freed(t) for t in buffers)
    reset()
    assert not any(is_freed(t) for t in buffers)     # zero_() wrote every page again
    assert module.generate(model, prompts[0], 6, step=step).tolist() == want[0].tolist()
    assert all(is_freed(t) for t in buffers)

    # an uncompiled prefill into the model's buffers, compiled decoding; a second request
    for p, w in zip(prompts[:2], want[:2]):
        assert _eager_prefill_generate(module, model, step, p, 6).tolist() == w.tolist()
        assert all(is_freed(t) for t in buffers)

    # a prompt of another length on the same compiled model
    assert module.generate(model, prompts[2], 6, step=step).tolist() == want[2].tolist()
    assert not backend.report.unchanged, str(backend.report)
    assert backend.report.released_bytes > 0.9 * sum(t.numel() * t.element_size() for t in buffers)


# ------------------------------------------------------------------------------ StaticCache
def test_static_cache_reset_and_reuse():
    """transformers' StaticCache, early-initialized (its buffers are graph inputs): generate,
    ``cache.reset()`` (``zero_()`` on the released buffers), generate again on the same
    cache, then a prompt of another length on a new one."""
    model = tiny_model("llama", "sdpa")
    oracle = EagerOracle(model, "llama")
    backend = kvarn_backend(**PRESET, compiler="eager", max_cache_len=MAX_LEN)
    model.compile(backend=backend)
    cache = tiny_static_cache(model, 1)
    ids = tiny_prompt(1)
    first = tiny_generate(model, ids, cache=cache, new=5)
    assert_same_generation(first, oracle(ids, new=5), EAGER_RTOL, "first request")
    layers = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert all(is_freed(t) for t in layers)
    cache.reset()
    again = tiny_generate(model, ids, cache=cache, new=5)
    assert_same_generation(again, oracle(ids, new=5), EAGER_RTOL, "after reset()")
    assert all(is_freed(t) for t in layers)
    short = tiny_prompt(2, length=41)
    assert_same_generation(tiny_generate(model, short, cache=tiny_static_cache(model, 1), new=5),
                 oracle(short, new=5), EAGER_RTOL, "another prompt length")
    assert not backend.report.unchanged, str(backend.report)


def test_compile_config_second_request_on_the_same_cache():
    """``generate(compile_config=...)``: transformers prefills eagerly into its StaticCache
    and compiles the decoding step; the compiled step adopts the prompt and frees the
    buffers. A second request on the same (reset) cache writes the released buffers eagerly
    and is adopted again."""
    model = tiny_model("llama", "sdpa")
    backend = kvarn_backend(**PRESET, compiler="eager", max_cache_len=MAX_LEN)
    cc = tf.CompileConfig(backend=backend, fullgraph=False)
    cc._compile_all_devices = True          # transformers compiles on CUDA only by default
    cache = tiny_static_cache(model, 1)
    for seed in (1, 2):
        ids = tiny_prompt(seed)
        cache.reset()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.generate(ids, max_new_tokens=5, do_sample=False, **cache_arg(model, cache),
                                 compile_config=cc, output_logits=True,
                                 return_dict_in_generate=True)
        tokens, logits = fp_prefill_then_kvarn(model, ids, 5)
        assert out.sequences.tolist() == tokens.tolist()
        for a, b in zip(out.logits, logits):
            assert (a - b).abs().max().item() <= EAGER_RTOL * b.abs().max().item()
        assert all(is_freed(t) for layer in cache.layers for t in (layer.keys, layer.values))
    assert backend.report.rewritten and not backend.report.unchanged, str(backend.report)


# ------------------------------------------------------------------------------ no crash
_ACCESSES = r"""
import io, json, sys
import torch
import torch.nn.functional as F
sys.path.insert(0, {examples!r})
import gpt_fast_model as gf
from kvarn_compile import kvarn_backend
from kvarn_compile.ops import buffers as registry
from kvarn_compile.ops.append import materialize

torch.manual_seed(0)
model = gf.Transformer(gf.ModelArgs(vocab_size=64, n_layer=1)).eval()
model.setup_caches(max_batch_size=1, max_seq_length=256)
cache = model.layers[0].attention.kv_cache
kc, vc = cache.k_cache, cache.v_cache
backend = kvarn_backend("k4v2", group_size=32, compiler="eager")
step = torch.compile(model, backend=backend)
prompt = torch.randint(0, 64, (1, 40))
gf.generate(model, prompt, 3, step=step)
assert registry.released(kc) and registry.released(vc), "not released"
seen = {{}}

def released():
    registry.release_storage(kc)
    registry.release_storage(vc)

def run(name, fn):
    released()
    print(name, flush=True)
    seen[name] = fn()

d = kc.shape[-1]
(state,) = backend.states.values()
seen["packed"] = [float(x.sum()) for x in materialize(state.buffers, dtype=kc.dtype)]
seen["typed"] = type(kc).__name__
# the first eager read gets the packed tokens dequantized into the buffer, a plain tensor
# from then on (freed again by each run() below: reads zeros)
seen["first sum"] = [kc.sum().item(), vc.sum().item()]
seen["plain"] = type(kc).__name__
run("sum", lambda: kc.sum().item())
run("clone", lambda: kc.clone().abs().max().item())
run("numpy", lambda: float(kc.numpy().sum()))
run("print", lambda: len(str(kc)) > 0 and len(repr(vc)) > 0)
run("tolist", lambda: len(kc[0, 0, :2].tolist()))
run("save", lambda: len(torch.save(kc, io.BytesIO()) or b"x"))
run("matmul", lambda: (kc @ vc.transpose(-1, -2)).abs().max().item())
run("sdpa", lambda: F.scaled_dot_product_attention(torch.randn(1, 2, 1, d), kc, vc).isfinite().all().item())
run("zero_", lambda: kc.zero_().sum().item())
run("fill_", lambda: kc.fill_(1.0).mean().item())
run("setitem", lambda: kc.__setitem__((slice(None), slice(None), 3), 2.0) or kc[0, 0, 3, 0].item())
run("index_copy_", lambda: kc.index_copy_(2, torch.tensor([5]), torch.ones(1, 2, 1, d))[0, 0, 5, 0].item())
run("index_put_", lambda: torch.ops.aten.index_put_(vc, [None, None, torch.tensor([7])], torch.ones(1, 2, 1, d))[0, 0, 7, 0].item())
run("copy_", lambda: kc.copy_(torch.ones_like(kc)).sum().item())
run("add_", lambda: kc.add_(1.0).max().item())
run("to", lambda: kc.to(torch.float16).sum().item())
run("eager forward", lambda: model(prompt, torch.arange(40))[0, -1].isfinite().all().item())
run("compiled again", lambda: gf.generate(model, prompt, 3, step=step).tolist())
print("DONE " + json.dumps(seen), flush=True)
"""


def test_no_eager_access_to_a_released_buffer_crashes():
    script = _ACCESSES.format(examples=str(ROOT / "examples"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, (f"exit {proc.returncode} after: {proc.stdout.splitlines()[-1:]}"
                                  f"\n{proc.stderr[-3000:]}")
    seen = json.loads(proc.stdout.split("DONE ", 1)[1])
    # a packed buffer's first eager read gets its tokens dequantized (not zeros); released
    # buffers read zeros; writes land and are read back
    assert seen["typed"] == "PackedBuffer" and seen["plain"] == "Tensor"
    assert seen["first sum"] == pytest.approx(seen["packed"]) and seen["packed"][0] != 0.0
    assert seen["sum"] == seen["clone"] == seen["numpy"] == seen["matmul"] == 0.0
    assert seen["zero_"] == 0.0 and seen["fill_"] == 1.0 and seen["setitem"] == 2.0
    assert seen["index_copy_"] == seen["index_put_"] == 1.0 and seen["add_"] == 1.0
    assert seen["sdpa"] and seen["eager forward"] and seen["print"]


_RSS = r"""
import json, os, sys
import torch
sys.path.insert(0, {examples!r})
import llama_ref_model as lm
from kvarn_compile import kvarn_backend

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

torch.manual_seed(0)
args = lm.ModelArgs(vocab_size=64, dim=64, n_layers=2, n_heads=2, n_kv_heads=2, max_batch_size=1,
                    max_seq_len=16384)
model = lm.Transformer(args).eval()
buffers = [t for layer in model.layers for t in (layer.attention.cache_k, layer.attention.cache_v)]
fp_bytes = sum(t.numel() * t.element_size() for t in buffers)
backend = kvarn_backend("k4v2", group_size=32, compiler="eager", max_cache_len=16384)
step = torch.compile(model, backend=backend)
prompt = torch.randint(0, 64, (1, 40))
lm.generate(model, prompt, 3, step=step)          # compiles; the buffers are freed
after = rss()
model.reset_caches()                               # zero_(): every page written again
reset = rss()
lm.generate(model, prompt, 3, step=step)           # the next calls free them again
again = rss()
print(json.dumps(dict(fp_bytes=fp_bytes, after=after, reset=reset, again=again,
                      released=backend.report.released_bytes)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_release_returns_the_memory():
    script = _RSS.format(examples=str(ROOT / "examples"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    assert m["fp_bytes"] == 16 * 2 ** 20
    assert m["released"] >= m["fp_bytes"] - 4 * 2 * 4096             # all but the partial end pages
    assert m["reset"] - m["after"] >= 0.9 * m["fp_bytes"], m       # zero_() committed them again
    assert m["reset"] - m["again"] >= 0.9 * m["fp_bytes"], m       # and the next call freed them


def test_buffers_that_cannot_be_freed_in_place_are_kept_and_noted():
    """Buffers ``release_storage`` cannot free without making an access illegal (shared or
    pinned memory here; CUDA memory likewise) are kept as they are: same tokens, the report
    says why, and an uncompiled prefill into them is still adopted."""
    module, model, reset, buffers = _gpt_fast_model()
    fp_model = copy.deepcopy(model)
    for t in buffers:
        t.share_memory_()
    backend = kvarn_backend(**EIGHT_BIT, compiler="eager")
    step = torch.compile(model, backend=backend)
    prompt = tiny_prompt(1, length=60) % 128
    want = module.generate(fp_model, prompt, 6)
    assert module.generate(model, prompt, 6, step=step).tolist() == want.tolist()
    assert _eager_prefill_generate(module, model, step, prompt, 6).tolist() == want.tolist()
    assert not any(released(t) for t in buffers) and backend.report.released_bytes == 0
    assert any("K/V buffers are kept in full precision" in n for n in backend.report.notes)
    assert not releasable(torch.zeros(4, 4, device="meta"))
    assert not releasable(torch.zeros(4, 4)[:2])             # a view into a larger buffer


def test_decode_steps_reuse_their_states_until_the_cache_changes(monkeypatch):
    """A static cache's decode graph resolves its states once and reuses them while each call
    passes the same untouched buffers (``cache_book.CallMemo``); a reset of the buffers (an
    in-place write) or an uncompiled prefill into them makes the next call resolve again, and
    the tokens stay those of full precision throughout (8 bits: equal)."""
    from kvarn_compile import cache_book

    lm, model = llama_ref_model()
    fp_model = copy.deepcopy(model)
    answers = []
    real = cache_book.CallMemo.states_for
    monkeypatch.setattr(cache_book.CallMemo, "states_for",
                        lambda self, args: answers.append(r := real(self, args)) or r)
    step = torch.compile(model, backend=kvarn_backend(**EIGHT_BIT, compiler="eager"))
    prompt = tiny_prompt(1, length=60) % 128
    want = lm.generate(fp_model, prompt, 8)
    assert lm.generate(model, prompt, 8, step=step).tolist() == want.tolist()
    reused = sum(r is not None for r in answers)
    assert reused >= 5, answers                       # the decode steps after the first
    answers.clear()
    model.reset_caches()                              # zero_() on the released buffers
    assert lm.generate(model, prompt, 8, step=step).tolist() == want.tolist()
    assert answers[0] is None and sum(r is not None for r in answers) >= 5, answers
    answers.clear()
    assert _eager_prefill_generate(lm, model, step, prompt, 8).tolist() == want.tolist()
    assert answers[0] is None, answers                # the prompt the uncompiled call wrote


def test_state_buffers_are_checked_by_the_backend_not_by_every_call():
    """A graph whose states never grow (a static cache) is generated without Inductor's
    per-call size/stride assertion on each state buffer (the backend's own tensors, 17 per
    layer; every model input keeps its assertion); instead the backend checks the buffers
    against the layout the graph was compiled for whenever it hands the graph other ones,
    and a mismatch stops with a one-line error before the graph runs."""
    import re

    from torch._inductor.utils import run_and_get_code

    lm, model = llama_ref_model()
    fp_model = copy.deepcopy(model)
    backend = kvarn_backend(**EIGHT_BIT, compiler="inductor")
    step = torch.compile(model, backend=backend)
    prompt = tiny_prompt(1, length=60) % 128
    got, codes = run_and_get_code(lambda: lm.generate(model, prompt, 4, step=step))
    assert got.tolist() == lm.generate(fp_model, prompt, 4).tolist()
    graphs = [c for c in codes if "kvarn.append_from_" in c or "kvarn_attention" in c]
    assert graphs
    for code in graphs:
        states = {n for group in re.findall(r"append_from_\.default\(\[([^\]]*)\]", code)
                  for n in re.findall(r"arg\d+_1", group)}
        asserted = set(re.findall(r"assert_size_stride\((arg\d+_1),", code))
        assert states and not states & asserted, sorted(states & asserted)[:5]
        assert asserted                                   # the model's inputs still are
    # the check the generated code no longer makes, made when the graph gets other buffers
    from kvarn_compile.backend import _layout_of, _SiteStates

    state = next(iter(backend.states.values()))
    flat = _SiteStates([_layout_of(b) for b in state.buffers], graph=7)
    assert flat.buffers([state]) == state.buffers
    i = next(j for j, b in enumerate(state.buffers) if b.dim() == 4)
    state.buffers[i] = state.buffers[i][:, :, :1].clone()     # not what the graph reads
    state.version += 1
    with pytest.raises(RuntimeError, match=r"^kvarn_backend: graph 7 was compiled for KV state "
                                           rf"buffer {i} of shape .*; this is a kvarn_compile bug"):
        flat.buffers([state])
