"""transformers' own Cache / generate contract tests, adapted to KVarN, in two modes.

Each test rewrites one upstream test (the comment above it names the upstream file, test and
commit; the index holds one version of each file, so the two files come from two commits) for
a tiny random-weight decoder-only model, and runs it twice:

* ``backend``: the model compiled with ``kvarn_backend`` (8-bit codes, ``compiler="eager"``)
  on transformers' own caches (DynamicCache, StaticCache, ``cache_implementation="static"``);
* ``kvarncache``: ``use_kvarn_attention(model)`` with a ``KVarNCache`` passed as ``cache=``.

Outputs are compared with the uncompressed model (an untouched copy) by teacher forcing: the
uncompressed model runs on the produced tokens, and the largest logit difference, relative to
the largest |logit|, must stay below ``RTOL`` or, where the preset itself errs more on those
tokens (a whole-sequence KVarNCache over them; up to ~0.024 on this model), below ``MARGIN``
times that error + 0.005 (the criterion of ``kvarn_compile.testing.flows``). With 8-bit codes a
cache that lost or misplaced tokens is far off (errors of 0.3 and more). Prompts of ~60 tokens
plus the new ones cross position 64, where the first tile of the k4v2/G=32 layout freezes.
Besides the numbers, each test checks that the cache stayed KVarN-packed (``Subject.assert_kvarn``).
A refusal passes only where the upstream contract allows one, and only as a one-line error
starting with ``KVarN`` or ``kvarn_backend``.

Compiled models are shared by the tests of one batch size, in this module and in
``test_upstream_contract_generate.py`` (batch-1 tests here and first there, then batch 2, then
the tests that compile their own model): a compile per test would not fit the time budget.
Dynamo's automatic-dynamic state is per frame (``Module._call_impl``, shared by every compiled
model, not per model): once any compiled model ran with batch 1, a graph compiled for batch 2
gets a dynamic batch dimension, which the pass treats apart. Tests of another batch size
therefore start from a ``torch._dynamo.reset()`` (``Pool``), so that each test sees its own
batch size from the start; ``test_second_batch_size_on_one_compiled_model`` and
``test_batch_repeat_interleave_and_select_indices`` change it on purpose. A failure in a shared subject can spill over into later tests of
the same mode: rerun a failing test alone (``-k``) before reading much into it.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from transformers import DynamicCache, StaticCache

from kvarn_compile import kvarn_backend
from kvarn_compile.hf import KVarNCache, KVarNLayer, output_cache, use_kvarn_attention
from kvarn_compile.ops.buffers import is_freed
from kvarn_compile.testing.models import cache_arg, tiny_model, tiny_prompt

pytestmark = pytest.mark.usefixtures("one_thread")

CACHE_UTILS = "00b1f96ad09c1137cfe75e453c4b2bc1dd2abe1e"   # tests/utils/test_cache_utils.py
GEN_UTILS = "cf63921b9648e760a9a72a3c84bf797f17d1e140"     # tests/generation/test_utils.py
MAX_LEN = 512
PRESET = dict(preset="k4v2", key_bits=8, value_bits=8, group_size=32)
RTOL = 0.02
MARGIN = 3.0     # times the preset's own error (kvarn_compile.testing.flows.MARGIN)
PROMPT = 58
NEW = 8


# ------------------------------------------------------------------------------ subjects
class Subject:
    """One tiny model in one mode, next to its uncompressed twin ``fp``."""

    def __init__(self, mode: str, family: str = "llama", attn: str = "sdpa", seed: int = 0):
        self.mode = mode
        self.fp = tiny_model(family, attn, seed)
        self.model = copy.deepcopy(self.fp)
        self.backend = None
        if mode == "backend":
            self.backend = kvarn_backend(compiler="eager", max_cache_len=MAX_LEN, **PRESET)
            self.model.compile(backend=self.backend)
        else:
            use_kvarn_attention(self.model)
        self.q = copy.deepcopy(self.fp)            # the preset's own error: a whole-sequence KVarNCache
        use_kvarn_attention(self.q)
        self.config = self.model.config

    def cache(self, kind: str = "dynamic", max_len: int = MAX_LEN):
        if self.mode == "kvarncache":
            return KVarNCache(self.config, max_cache_len=max_len, **PRESET)
        if kind == "static":
            return StaticCache(config=self.config, max_cache_len=max_len)
        return DynamicCache(config=self.config)

    def generate(self, ids=None, *, cache="new", model=None, **kw):
        """``generate`` (greedy unless told); ``cache="new"``: transformers' default cache in
        backend mode, a fresh KVarNCache in kvarncache mode."""
        if isinstance(cache, str):
            cache = self.cache() if self.mode == "kvarncache" else None
        model = model or self.model
        if cache is not None:
            kw.update(cache_arg(model, cache))
        kw.setdefault("do_sample", False)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return model.generate(ids, **kw)

    def forward(self, ids, cache, **kw):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.model(ids, **cache_arg(self.model, cache), use_cache=True, **kw)

    def mark(self) -> int:
        return len(self.backend.report.sites) if self.backend else 0

    def assert_kvarn(self, cache, since: int = 0) -> None:
        """The cache holds KVarN-packed K/V: kvarncache mode, KVarN layers with a state; backend
        mode, every site compiled since ``since`` rewritten and the cache's own tensors
        zero-storage handles (dynamic) or released buffers (static)."""
        if self.mode == "kvarncache":
            assert all(isinstance(layer, KVarNLayer) and layer.state is not None
                       for layer in cache.layers), cache.layers
            return
        # documented (kvarn_compile.hf.static_cache_for): the prefill into a lazily initialized
        # StaticCache stays in full precision and the next compiled call adopts it (checked
        # below: its buffers are released)
        # and a graph whose batch size Dynamo made dynamic says it runs "each batch size [in] its
        # own graph ... with the cache packed" (those graphs' sites are rewritten)
        lazy = isinstance(cache, StaticCache)
        left = [x for x in self.backend.report.sites[since:] if not x.rewritten and not (
            lazy and x.reason.startswith("the graph returns the cache tensor itself"))
            and "with the cache packed" not in x.reason]
        assert not left, "\n".join(x.line() for x in left)
        for i, layer in enumerate(cache.layers):
            for t in (layer.keys, layer.values):
                if isinstance(cache, StaticCache):
                    assert is_freed(t), f"layer {i}: the full-precision StaticCache buffer is kept"
                else:
                    n = t.untyped_storage().nbytes()
                    assert n <= 16, (f"layer {i} holds a {tuple(t.shape)} tensor of {n} bytes, not a "
                                     "zero-storage handle of the packed cache")


class Pool:
    """Subjects shared by the tests of one batch size in one mode (see the module docstring)."""

    def __init__(self, mode: str):
        self.mode, self.batch, self.shared = mode, None, {}

    def get(self, family="llama", *, attn="sdpa", seed=0, batch=1, fresh=False) -> Subject:
        if self.mode == "backend" and (fresh or batch != self.batch):
            torch._dynamo.reset()
            self.shared.clear()
            self.batch = None if fresh else batch
        if fresh:
            return Subject(self.mode, family, attn, seed)
        key = (family, attn, seed)
        if key not in self.shared:
            self.shared[key] = Subject(self.mode, family, attn, seed)
        return self.shared[key]


#: one Pool per mode for the process: test_upstream_contract_generate.py continues with the
#: subjects (and compiled graphs) this module leaves
_POOLS: dict[str, Pool] = {}


@pytest.fixture(scope="module", params=["backend", "kvarncache"])
def pool(request):
    if request.param not in _POOLS:
        torch._dynamo.reset()
        _POOLS[request.param] = Pool(request.param)
    return _POOLS[request.param]


@pytest.fixture(autouse=True)
def _recompile_limit():
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=4096):
        yield


# ------------------------------------------------------------------------------ checks
def rel_err(got, want) -> float:
    got, want = got.float(), want.float()
    return ((got - want).abs().max() / want.abs().max()).item()


def positions(mask):
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def references(s: Subject, seqs, mask=None, **kw):
    """The uncompressed model over ``seqs`` (left padding: ``mask`` and its positions), and
    the same tokens through a whole-sequence KVarNCache of the preset (its own error)."""
    if mask is not None:
        mask = torch.cat([mask, mask.new_ones(seqs.shape[0], seqs.shape[1] - mask.shape[1])], 1)
        kw.update(attention_mask=mask, position_ids=positions(mask))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = KVarNCache(s.config, max_cache_len=MAX_LEN, **PRESET)
        return s.fp(seqs, **kw), s.q(seqs, **cache_arg(s.q, cache), **kw)


def assert_close(got, fp, quantized, what: str) -> float:
    """``got`` within max(RTOL, MARGIN x the preset's own error + 0.005) of ``fp``, relative to
    the largest |fp| (the project's criterion, kvarn_compile.testing.flows._compare)."""
    err, own = rel_err(got, fp), rel_err(quantized, fp)
    bound = max(RTOL, MARGIN * own + 0.005)
    assert err <= bound, (f"{what}: off by {err:.3g} (relative) > {bound:.3g} (the preset's own "
                          f"error on these tokens: {own:.3g})")
    return err


def assert_teacher_forced(s: Subject, out, prompt_len: int, mask=None, what="generate") -> float:
    """Every step's logits against the uncompressed model fed the produced tokens."""
    steps = torch.stack(out.logits, 1)
    window = slice(prompt_len - 1, prompt_len - 1 + steps.shape[1])
    fp, quantized = (r.logits[:, window] for r in references(s, out.sequences, mask))
    assert steps.shape == fp.shape, f"{what}: logits {tuple(steps.shape)} vs {tuple(fp.shape)}"
    return assert_close(steps, fp, quantized, what)


def assert_forward_logits(s: Subject, got, seqs, start: int, what="forward") -> float:
    fp, quantized = (r.logits[:, start:start + got.shape[1]] for r in references(s, seqs))
    return assert_close(got, fp, quantized, what)


def is_refusal(err: BaseException) -> bool:
    """A one-line error of the project (``KVarN ...`` / ``kvarn_backend ...``)."""
    while err is not None:
        text = str(err).strip()
        if text.startswith(("KVarN", "kvarn_backend")):
            return "\n" not in text
        err = err.__cause__
    return False


@contextlib.contextmanager
def two_constant_assistant_tokens(model):
    """Upstream's setting b): the assistant always proposes two tokens."""
    config = model.generation_config
    saved = config.num_assistant_tokens, config.num_assistant_tokens_schedule
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = 2, "constant"
    try:
        yield
    finally:
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = saved


def gen_kw(**kw):
    return dict(max_new_tokens=NEW, return_dict_in_generate=True, output_logits=True) | kw


def check_hidden_states(s: Subject, out, prompt_len: int) -> None:
    """Shapes as upstream's _check_hidden_states_for_generate (use_cache), values against the
    uncompressed model's hidden states at the same positions."""
    hidden = s.config.hidden_size
    fp, quantized = (r.hidden_states for r in references(s, out.sequences, output_hidden_states=True))
    assert len(out.hidden_states) == out.sequences.shape[1] - prompt_len
    for step, layers in enumerate(out.hidden_states):
        assert len(layers) == s.config.num_hidden_layers + 1
        pos = slice(0, prompt_len) if step == 0 else slice(prompt_len + step - 1, prompt_len + step)
        for i, h in enumerate(layers):
            assert h.shape == (1, pos.stop - pos.start, hidden), (step, i, h.shape)
            assert_close(h, fp[i][:, pos], quantized[i][:, pos], f"step {step} hidden state {i}")


def check_similar(a, b, prompt_len: int) -> None:
    """Upstream's _check_similar_generate_outputs: same tokens, or the scores at the first
    mismatch nearly equal (here within RTOL: two KVarN runs may freeze tiles differently)."""
    if a.sequences.tolist() == b.sequences.tolist():
        return
    first = int((a.sequences[0] != b.sequences[0]).int().argmax()) - prompt_len
    err = rel_err(b.scores[first], a.scores[first])
    assert err < RTOL, f"tokens differ at new token {first} and so do the scores ({err:.3g})"


def check_beam_log_probs(s: Subject, out, prompt_len: int) -> None:
    """Each returned beam's per-token log-probabilities against the uncompressed model's."""
    got = s.model.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
    new = out.sequences[:, prompt_len:]
    fp, quantized = (torch.log_softmax(r.logits[:, prompt_len - 1:-1].float(), -1)
                     .gather(-1, new[..., None])[..., 0] for r in references(s, out.sequences))
    assert_close(got[:, :new.shape[1]], fp, quantized, "beam log-probabilities")


# ------------------------------------------------------------------------------ cache API (batch 1)
# upstream: tests/utils/test_cache_utils.py::SyntheticCacheTest::test_dynamic_cache @ 00b1f96ad09c1137cfe75e453c4b2bc1dd2abe1e
def test_dynamic_cache(pool):
    s = pool.get()
    since = s.mark()
    ids = tiny_prompt(11, length=66)
    cache = s.cache()
    s.forward(ids[:, :63], cache)                              # prefill, then one token at a time
    assert cache.get_seq_length() == 63
    for t in (63, 64, 65):                                     # position 64 freezes a tile
        got = s.forward(ids[:, t:t + 1], cache).logits
        assert_forward_logits(s, got, ids[:, :t + 1], t, f"token {t}")
        assert [cache.get_seq_length(i) for i in range(len(cache.layers))] == [t + 1] * len(cache.layers)
    s.assert_kvarn(cache, since)


# upstream: tests/utils/test_cache_utils.py::SyntheticCacheTest::test_static_cache @ 00b1f96ad09c1137cfe75e453c4b2bc1dd2abe1e
def test_static_cache(pool):
    s = pool.get()
    since = s.mark()
    ids = tiny_prompt(12, length=64)
    cache = s.cache("static", max_len=64)
    s.forward(ids[:, :62], cache)
    for t in (62, 63):                                         # near capacity, then full
        got = s.forward(ids[:, t:t + 1], cache).logits
        assert_forward_logits(s, got, ids[:, :t + 1], t, f"token {t}")
        assert cache.get_seq_length() == t + 1
    assert cache.get_max_length() == 64
    s.assert_kvarn(cache, since)


# upstream: tests/utils/test_cache_utils.py::SyntheticCacheTest::test_static_cache_out_of_bounds @ 00b1f96ad09c1137cfe75e453c4b2bc1dd2abe1e
def test_static_cache_out_of_bounds(pool):
    s = pool.get()
    ids = tiny_prompt(13, length=65)
    cache = s.cache("static", max_len=64)
    s.forward(ids[:, :64], cache)
    with pytest.raises(Exception) as caught:                   # position 64 >= max_cache_len
        s.forward(ids[:, 64:], cache)
    assert isinstance(caught.value, IndexError) or is_refusal(caught.value), repr(caught.value)


# upstream: tests/utils/test_cache_utils.py::CacheHardIntegrationTest::test_cache_copy @ 00b1f96ad09c1137cfe75e453c4b2bc1dd2abe1e
@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_cache_copy(pool, kind):
    """Prefix caching as documented: prefill a prompt once, deepcopy it per request."""
    s = pool.get()
    since = s.mark()
    prefix = tiny_prompt(14, length=40)
    prompt_cache = s.cache(kind)
    s.forward(prefix, prompt_cache)
    for seed in (15, 16):
        ids = torch.cat([prefix, tiny_prompt(seed, length=18)], 1)
        cache = copy.deepcopy(prompt_cache)
        out = s.generate(ids, cache=cache, **gen_kw())
        assert out.sequences.shape == (1, 58 + NEW)
        assert_teacher_forced(s, out, 58, what=f"continuation {seed}")
        s.assert_kvarn(cache, since)
    assert prompt_cache.get_seq_length() == 40                 # the prefix itself is untouched


# upstream: tests/utils/test_cache_utils.py::CacheIntegrationTest::test_cache_extra_left_padding @ 00b1f96ad09c1137cfe75e453c4b2bc1dd2abe1e
def test_cache_extra_left_padding(pool):
    s = pool.get()
    since = s.mark()
    ids = tiny_prompt(17, length=56)
    plain = s.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw(max_new_tokens=10))
    padded_ids = torch.cat([torch.zeros(1, 8, dtype=torch.long), ids], 1)    # to a multiple of 32
    mask = torch.ones_like(padded_ids)
    mask[:, :8] = 0
    padded = s.generate(padded_ids, attention_mask=mask, **gen_kw(max_new_tokens=10))
    assert_teacher_forced(s, plain, 56, what="no padding")
    assert_teacher_forced(s, padded, 64, mask=mask, what="extra left padding")
    assert padded.sequences[:, 8:].tolist() == plain.sequences.tolist()
    s.assert_kvarn(output_cache(padded), since)


# upstream: tests/generation/test_utils.py::GenerationTesterMixin::test_assisted_decoding_matches_greedy_search @ cf63921b9648e760a9a72a3c84bf797f17d1e140
# (crop contract: transformers.cache_utils.DynamicLayer.crop, crop(-n) drops the newest n; neither upstream file tests crop alone)
def test_crop_then_continue(pool):
    s = pool.get()
    since = s.mark()
    ids, other = tiny_prompt(27, length=70), tiny_prompt(28, length=3)
    cache = s.cache()
    s.forward(ids, cache)                                       # tile 32..63 frozen
    cache.crop(-8)                                              # back to 62: into that tile
    assert cache.get_seq_length() == 62
    got = s.forward(other, cache).logits
    assert_forward_logits(s, got, torch.cat([ids[:, :62], other], 1), 62, "crop(-8), continue")
    s.assert_kvarn(cache, since)
    # crop(n > 0): upstream raises (DynamicLayer: ValueError); the legacy meaning keeps n
    try:
        cache.crop(40)
    except (ValueError, RuntimeError):
        return
    assert cache.get_seq_length() == 40, "crop(40) neither raised nor kept 40 tokens"
    got = s.forward(other, cache).logits
    assert_forward_logits(s, got, torch.cat([ids[:, :40], other], 1), 40, "crop(40), continue")


# upstream: tests/generation/test_utils.py::GenerationTesterMixin::test_assisted_decoding_matches_greedy_search @ cf63921b9648e760a9a72a3c84bf797f17d1e140
# (contract: transformers.cache_utils.Cache.is_croppable, "crop can put the whole cache back as it was")
def test_is_croppable_tells_the_truth(pool):
    s = pool.get()
    ids, draft, fix = tiny_prompt(29, length=60), tiny_prompt(30, length=10), tiny_prompt(31, length=2)
    cache, clean = s.cache(), s.cache()
    s.forward(ids, cache)
    s.forward(ids, clean)
    if not cache.is_croppable:
        return                                                  # honest: transformers refuses assisted decoding
    s.forward(draft, cache)                                     # 70 tokens: tile 32..63 frozen
    cache.crop(-10)
    assert cache.get_seq_length() == 60
    got, want = s.forward(fix, cache).logits, s.forward(fix, clean).logits
    fp, quantized = (r.logits[:, 60:] for r in references(s, torch.cat([ids, fix], 1)))
    assert_close(want, fp, quantized, "never saw the draft")
    assert_close(got, fp, quantized, "draft appended, crop(-10), continue")
    # no trace beyond the preset's own error: against the cache that never saw the draft
    trace, bound = rel_err(got, want), max(RTOL, MARGIN * rel_err(quantized, fp) + 0.005)
    assert trace <= bound, f"the rollback left a trace of {trace:.3g} (relative) > {bound:.3g}"
