"""Graph-diff tests of the KVarN pass: each cache spelling and attention form, before/after.

Each case is a tiny function written the way model code writes it. The golden strings
are the normalized Dynamo graph after the rewrite (``kvarn_compile.testing.normalize_graph``);
update them with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/passes/test_rewrite.py``, never by hand.
Numerical equality with the eager reference is checked for every rewritten case
(``kvarn_compile.testing.check_numerics``).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase

from kvarn_compile.testing import check_numerics, record_graphs
from kvarn_compile import kvarn_backend
from kvarn_compile.ops.buffers import freeable_bytes, is_freed, released

B, H, HQ, D, L = 1, 2, 4, 16, 64
G = 32


def _backend(**kw):
    torch._dynamo.reset()
    return record_graphs(kvarn_backend("k4v2", group_size=G, key_bits=8, value_bits=8, compiler="eager",
                                       **kw))


def _inputs(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, t, D, generator=g)
    k = torch.randn(B, H, t, D, generator=g)
    v = torch.randn(B, H, t, D, generator=g)
    return q, k, v


def _repeat_kv(x, n):
    b, h, t, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, t, d).reshape(b, h * n, t, d)


# ----------------------------------------------------------------------------- subjects
def index_copy_sdpa(q, k, v, pos, kc, vc, mask):
    # transformers StaticCache + sdpa with repeat_kv and a bool mask
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, _repeat_kv(kc, HQ // H), _repeat_kv(vc, HQ // H),
                                          attn_mask=mask, scale=0.25)


def setitem_positions_sdpa(q, k, v, pos, kc, vc, mask):
    # gpt-fast: k_cache[:, :, input_pos] = k, repeat_interleave, sdpa with a bool mask
    kc[:, :, pos] = k
    vc[:, :, pos] = v
    return F.scaled_dot_product_attention(q, kc.repeat_interleave(HQ // H, dim=1),
                                          vc.repeat_interleave(HQ // H, dim=1), attn_mask=mask)


def narrow_copy_gqa(q, k, v, start: int, kc, vc, mask):
    # kc.narrow(2, s, T).copy_(k), enable_gqa instead of repeat_kv, additive float mask
    kc.narrow(2, start, k.shape[2]).copy_(k)
    vc.narrow(2, start, v.shape[2]).copy_(v)
    add = torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=add, enable_gqa=True)


def setitem_slice_eager(q, k, v, start: int, kc, vc, mask):
    # nanoGPT: k_cache[:, :, s:s+T] = k and the hand-written matmul/softmax chain
    kc[:, :, start:start + k.shape[2]] = k
    vc[:, :, start:start + v.shape[2]] = v
    att = (q @ _repeat_kv(kc, HQ // H).transpose(-2, -1)) * (1.0 / math.sqrt(D))
    att = att + torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
    return att @ _repeat_kv(vc, HQ // H)


def cat_sdpa(q, k, v, past_k, past_v):
    # transformers DynamicCache: cat along the sequence, decode without a mask
    keys = torch.cat([past_k, k], dim=-2)
    values = torch.cat([past_v, v], dim=-2)
    out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
    return out, keys, values


# negative cases
def no_cache_attention(q, k, v):
    return F.scaled_dot_product_attention(q, _repeat_kv(k, HQ // H), _repeat_kv(v, HQ // H))


def cache_read_elsewhere(q, k, v, pos, kc, vc, mask):
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    out = F.scaled_dot_product_attention(q, _repeat_kv(kc, HQ // H), _repeat_kv(vc, HQ // H), attn_mask=mask)
    return out, kc.sum()          # something else reads the cache


def cross_attention_fixed_cache(q, enc_k, enc_v):
    # encoder-decoder cross-attention over a fixed encoder cache: no update feeds it
    return F.scaled_dot_product_attention(q, enc_k, enc_v, enable_gqa=True)


def cross_attention_first_step(q, enc_k, enc_v, empty_k, empty_v):
    # transformers EncoderDecoderCache, first decoder step: the cross-attention cache is
    # filled once with cat([empty, encoder K/V]) (9 encoder tokens for 1 decoder query)
    keys = torch.cat([empty_k, enc_k], dim=-2)
    values = torch.cat([empty_v, enc_v], dim=-2)
    return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True), keys, values


def softcapped_eager(q, k, v, pos, kc, vc, mask):
    # Gemma 2 eager attention: soft-capped logits (tanh), not a recognized form
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    s = torch.tanh((q @ _repeat_kv(kc, HQ // H).transpose(2, 3)) * 0.25 / 5.0) * 5.0
    s = s + torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    return F.softmax(s, dim=-1) @ _repeat_kv(vc, HQ // H)


# ----------------------------------------------------------------------------- helpers
def _static_run(fn, backend, t=6, start=0, steps=2, positions_kind="tensor"):
    """Run fn compiled over a growing static cache: a prefill of t tokens then decode steps."""
    kc, vc = torch.zeros(B, H, L, D), torch.zeros(B, H, L, D)
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    outs, ref_kv = [], []
    pos0 = start
    for step in range(steps):
        n = t if step == 0 else 1
        q, k, v = _inputs(n, seed=step)
        ref_kv.append((k, v))
        pos = torch.arange(pos0, pos0 + n) if positions_kind == "tensor" else pos0
        mask = causal[None, None, pos0:pos0 + n, :]
        outs.append((compiled(q, k, v, pos, kc, vc, mask), q, mask))
        pos0 += n
    return outs, ref_kv, (kc, vc)


class TestGraphRewrites(TestCase):
    maxDiff = None

    def _after(self, backend, i=-1):
        return backend.graph_log[i][1]

    def _rewrite_matching_eager(self, fn, **static_run_kw):
        """Compile ``fn``; check every step's output against the eager KVarN ops and full
        precision on the true K/V (check_numerics); return the rewritten graph."""
        be = _backend()
        outs, history, _ = _static_run(fn, be, **static_run_kw)
        self.assertEqual(len(be.report.rewritten), len(be.report.sites))
        for step, (out, q, mask) in enumerate(outs):
            check_numerics(be.config, out, history[:step + 1], q, mask, D ** -0.5, cap=L)
        return self._after(be)

    def test_index_copy_sdpa(self):
        be = _backend()
        outs, history, (kc, _) = _static_run(index_copy_sdpa, be)
        self.assertEqual(len(be.report.rewritten), len(be.report.sites))
        self.assertTrue(is_freed(kc))                             # fp buffer released
        for step, (out, q, mask) in enumerate(outs):
            check_numerics(be.config, out, history[:step + 1], q, mask, 0.25, cap=L)
        self.assertExpectedInline(self._after(be), """\
# 9 inputs + 17 kvarn state buffers
v0 = kvarn.positions_start(in1, 1)
v1 = kvarn.append_from_([<17 state buffers>], in2, in4, v0, 'kvarn', 8, 0, 0, False, 'index_copy_sdpa', in0, in3, True)
v2 = kvarn.attention(in5, [<17 state buffers>], in8, 0.25, True, 0)
return (v2,)""")

    def test_setitem_positions_sdpa(self):
        self.assertExpectedInline(self._rewrite_matching_eager(setitem_positions_sdpa), """\
# 9 inputs + 17 kvarn state buffers
v0 = kvarn.positions_start(in2, 1)
v1 = kvarn.append_from_([<17 state buffers>], in1, in4, v0, 'kvarn', 8, 0, 0, False, 'setitem_positions_sdpa', in0, in3, True)
v2 = kvarn.attention(in5, [<17 state buffers>], in8, 0.25, True, 0)
return (v2,)""")

    def test_narrow_copy_enable_gqa_float_mask(self):
        self.assertExpectedInline(self._rewrite_matching_eager(narrow_copy_gqa, positions_kind="int"), """\
# 9 inputs + 17 kvarn state buffers
v0 = full((1,), in2, dtype=int64, device='cpu')
v1 = kvarn.append_from_([<17 state buffers>], in1, in4, v0, 'kvarn', 8, 0, 0, False, 'narrow_copy_gqa', in0, in3, True)
v2 = zeros_like(in8, dtype=float32)
v3 = operator.invert(in8)
v4 = .masked_fill(v2, v3, -inf)
v5 = kvarn.attention(in5, [<17 state buffers>], v4, 0.25, True, 0)
return (v5,)""")

    def test_setitem_slice_eager_chain(self):
        self.assertExpectedInline(self._rewrite_matching_eager(setitem_slice_eager, positions_kind="int"), """\
# 9 inputs + 17 kvarn state buffers
v0 = full((1,), in1, dtype=int64, device='cpu')
v1 = kvarn.append_from_([<17 state buffers>], in0, in3, v0, 'kvarn', 8, 0, 0, False, 'setitem_slice_eager', in2, in4, True)
v2 = zeros_like(in8, dtype=float32)
v3 = operator.invert(in8)
v4 = .masked_fill(v2, v3, -inf)
v5 = kvarn.attention(in5, [<17 state buffers>], v4, 0.25, True, 0)
return (v5,)""")

    def test_cat_cache_returns_zero_storage_handles(self):
        be = _backend(max_cache_len=L)
        compiled = torch.compile(cat_sdpa, backend=be)
        past_k = past_v = torch.zeros(B, H, 0, D)
        history = []
        for step, n in enumerate((6, 1, 1)):
            q, k, v = _inputs(n, seed=step)
            history.append((k, v))
            out, past_k, past_v = compiled(q, k, v, past_k, past_v)
            self.assertEqual(past_k.shape, (B, H, 6 + step, D))
            self.assertLessEqual(past_k.untyped_storage().nbytes(), 4)   # no fp copy grows
            # mask-free over a cat cache: every written key, not causal (the model's semantics)
            check_numerics(be.config, out, history, q, None, D ** -0.5, causal=False, cap=L)
        self.assertEqual([s.cache for s in be.report.rewritten],
                         ["torch.cat([past, new], dim=-2)"] * len(be.report.sites))
        self.assertExpectedInline(self._after(be), """\
# 7 inputs + 17 kvarn state buffers
v0 = .numel(in1)
v1 = operator.floordiv(v0, 32)
v2 = full((1,), v1, dtype=int64, device='cpu')
v3 = kvarn.append_([<17 state buffers>], in2, in5, v2, 'kvarn', 8, 0, 0, False, 'cat_sdpa')
v4 = arange(1, dtype=float32, device='cpu')
v5 = .view(v4, 1, 1, 1, 1)
v6 = .numel(in1)
v7 = operator.floordiv(v6, 32)
v8 = .size(in2, 2)
v9 = operator.add(v7, v8)
v10 = .expand(v5, 1, 2, v9, 16)
v11 = arange(1, dtype=float32, device='cpu')
v12 = .view(v11, 1, 1, 1, 1)
v13 = .numel(in4)
v14 = operator.floordiv(v13, 32)
v15 = .size(in5, 2)
v16 = operator.add(v14, v15)
v17 = .expand(v12, 1, 2, v16, 16)
v18 = kvarn.attention(in6, [<17 state buffers>], None, 0.25, False, 0)
return (v18, v10, v17)""")


class TestLeftUnchanged(TestCase):
    """Sites the pass must not rewrite: the graph stays exactly as Dynamo produced it."""

    def _check_unchanged(self, fn, *args, reason):
        be = _backend()
        eager = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        out = torch.compile(fn, backend=be)(*args)
        before, after = be.graph_log[-1]
        self.assertEqual(before, after)
        (site,) = be.report.sites
        self.assertFalse(site.rewritten)
        self.assertIn(reason, site.reason)
        for a, b in zip(eager if isinstance(eager, tuple) else (eager,), out if isinstance(out, tuple) else (out,)):
            torch.testing.assert_close(a, b)

    def test_attention_without_cache(self):
        self._check_unchanged(no_cache_attention, *_inputs(5), reason="do not come from a recognized KV-cache update")

    def test_cache_read_by_something_else(self):
        q, k, v = _inputs(5)
        mask = torch.tril(torch.ones(L, L, dtype=torch.bool))[None, None, :5]
        self._check_unchanged(cache_read_elsewhere, q, k, v, torch.arange(5), torch.zeros(B, H, L, D),
                              torch.zeros(B, H, L, D), mask, reason="the cache is also read by")

    def test_cross_attention_over_fixed_encoder_cache(self):
        q = torch.randn(B, HQ, 3, D)
        self._check_unchanged(cross_attention_fixed_cache, q, torch.randn(B, H, 9, D), torch.randn(B, H, 9, D),
                              reason="do not come from a recognized KV-cache update")

    def test_cross_attention_cache_filled_once(self):
        empty = torch.zeros(B, H, 0, D)
        self._check_unchanged(cross_attention_first_step, torch.randn(B, HQ, 1, D),
                              torch.randn(B, H, 9, D), torch.randn(B, H, 9, D), empty, empty,
                              reason="writes 9 tokens for 1 queries: not a self-attention cache")

    def test_unrecognized_softcapped_attention_is_reported(self):
        q, k, v = _inputs(5)
        mask = torch.tril(torch.ones(L, L, dtype=torch.bool))[None, None, :5]
        self._check_unchanged(softcapped_eager, q, k, v, torch.arange(5), torch.zeros(B, H, L, D),
                              torch.zeros(B, H, L, D), mask,
                              reason="not recognized: softmax over a q·kᵀ product (matmul -> mul -> "
                                     "truediv -> tanh -> mul -> add -> softmax)")


def test_report_lists_every_site_and_is_readable():
    be = _backend()
    _static_run(index_copy_sdpa, be)
    text = str(be.report)
    assert text.startswith("KVarN rewrite report: 2 attention site(s) rewritten, 0 left unchanged, in 2 graph(s)")
    assert "[rewritten] index_copy_sdpa@test_rewrite.py:" in text
    assert ": scaled_dot_product_attention over index_copy_ via repeat_kv" in text
    assert "released" in text


def test_backend_accepts_torch_compile_keywords():
    be = _backend()
    compiled = torch.compile(no_cache_attention, backend=be)
    torch.testing.assert_close(compiled(*_inputs(3)), no_cache_attention(*_inputs(3)))
    assert be.report.graphs == 1 and not be.report.rewritten
    be2 = kvarn_backend("k4v2", compiler="eager", mode="reduce-overhead")
    torch._dynamo.reset()
    torch.compile(no_cache_attention, backend=be2)(*_inputs(3))
    assert any("ignored on CPU" in n for n in be2.report.notes)


@pytest.mark.parametrize("bad", [dict(compiler="tvm"), dict(max_cache_len=0), dict(key_bits=5)])
def test_backend_rejects_bad_options(bad):
    with pytest.raises(ValueError, match="Expected|expected"):
        kvarn_backend("k4v2", **bad)


@pytest.mark.parametrize("value", [0, -8, True, 4096.0, "8192"])
def test_every_entry_point_rejects_the_same_bad_max_cache_len(value):
    import transformers as tf

    import kvarn_compile
    from kvarn_compile.hf import KVarNCache, static_cache_for

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = tf.LlamaForCausalLM(cfg)
    makers = [lambda v: kvarn_backend("k4v2", max_cache_len=v),
              lambda v: kvarn_compile.inductor_pass("k4v2", max_cache_len=v),
              lambda v: KVarNCache(cfg, max_cache_len=v),
              lambda v: static_cache_for(model, v)]
    for make in makers:
        with pytest.raises(ValueError, match=f"max_cache_len to be a positive int.*{value!r}"):
            make(value)
    with pytest.raises(ValueError, match="batch to be a positive int"):
        static_cache_for(model, 16, batch=0)


def test_torch_logs_shows_graphs_before_and_after(capfd):
    import logging
    torch._logging.set_logs(modules={"kvarn_compile": logging.DEBUG})
    try:
        be = _backend()
        _static_run(index_copy_sdpa, be, steps=1)
    finally:
        torch._logging.set_logs()
    err = capfd.readouterr().err
    assert "kvarn graph 1 before rewrite" in err and "kvarn graph 1 after rewrite" in err
    assert "torch.ops.kvarn.attention.default" in err


def test_non_contiguous_cache_positions_are_refused():
    be = _backend()
    kc, vc = torch.zeros(B, H, L, D), torch.zeros(B, H, L, D)
    q, k, v = _inputs(3)
    mask = torch.ones(1, 1, 3, L, dtype=torch.bool)
    compiled = torch.compile(index_copy_sdpa, backend=be)
    with pytest.raises(ValueError, match="one contiguous run"):
        compiled(q, k, v, torch.tensor([0, 2, 4]), kc, vc, mask)


# ----------------------------------------------------------------------------- cache hand-over
def _prefill_then_decode(fn, backend, *, compiled_prefill: bool, steps: int = 3):
    """A 6-token prefill (compiled, or the plain function writing the fp cache) then decode
    steps through the compiled function; returns the decode outputs and the caches."""
    kc, vc = torch.zeros(B, H, L, D), torch.zeros(B, H, L, D)
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    q, k, v = _inputs(6, seed=0)
    (compiled if compiled_prefill else fn)(q, k, v, torch.arange(6), kc, vc, causal[None, None, :6])
    outs = []
    for step in range(1, steps + 1):
        q, k, v = _inputs(1, seed=step)
        pos = 5 + step
        outs.append(compiled(q, k, v, torch.tensor([pos]), kc, vc, causal[None, None, pos:pos + 1]))
    return outs, (kc, vc)


@pytest.mark.parametrize("release", [True, False])
def test_prompt_written_by_an_uncompiled_forward_is_adopted(release):
    # transformers' generate(compile_config=...) runs the prefill eagerly on its fp cache and
    # compiles only the decoding step: the first compiled step adopts the prompt (append_from_).
    ref = _backend()
    want, _ = _prefill_then_decode(index_copy_sdpa, ref, compiled_prefill=True)
    (s_ref,) = ref.states.values()
    ref_buffers = [t.clone() for t in s_ref.buffers]   # torch._dynamo.reset() calls ref.reset()
    be = _backend(release_buffers=release)
    got, (kc, vc) = _prefill_then_decode(index_copy_sdpa, be, compiled_prefill=False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    (s_got,) = be.states.values()
    assert all(torch.equal(a, b) for a, b in zip(ref_buffers, s_got.buffers))
    assert s_got.lengths.tolist() == [9]
    if release:
        assert is_freed(kc) and is_freed(vc)
        assert be.report.released_bytes == freeable_bytes(kc) + freeable_bytes(vc) > 0
    else:   # kept: the state continues at each step, the prompt is adopted once
        assert not released(kc) and kc.abs().sum() > 0
        assert be.report.released_bytes == 0


# ----------------------------------------------------------------------------- keyed mode
def _pass_as_backend(kv):
    """Run the Inductor pre-grad pass on Dynamo's graph and execute it eagerly (no Inductor)."""
    def backend(gm, example_inputs, **kwargs):
        kv(gm.graph)
        return gm.forward
    return backend


def test_inductor_pass_keyed_rewrite_matches_backend():
    from kvarn_compile import inductor_pass

    torch._dynamo.reset()
    kv = record_graphs(inductor_pass("k4v2", group_size=G, key_bits=8, value_bits=8))
    got, (kc, vc) = _prefill_then_decode(index_copy_sdpa, _pass_as_backend(kv), compiled_prefill=True)
    ref = _backend()
    want, _ = _prefill_then_decode(index_copy_sdpa, ref, compiled_prefill=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    (s_ref,), (s_got,) = ref.states.values(), kv.states.values()
    assert all(torch.equal(a, b) for a, b in zip(s_ref.buffers, s_got.buffers))
    assert is_freed(kc) and is_freed(vc)
    assert kv.report.released_bytes == freeable_bytes(kc) + freeable_bytes(vc) > 0
    assert kv.nbytes == ref.nbytes == kv.report.sites[0].state_bytes
    assert len(kv.report.rewritten) == len(kv.report.sites) == 2     # prefill + decode graph
    after = kv.graph_log[-1][1].replace(kv.store.namespace, "NS")
    assert after == """\
v0 = kvarn.positions_start(in1, 1)
v1 = kvarn.append_keyed(in2, in4, v0, in0, in3, 'NS/index_copy_sdpa', 64, 'kvarn', 8, 0, 0, False, True)
v2 = kvarn.attention_keyed(in5, v1, in8, 'NS/index_copy_sdpa', 0.25, True, 0)
return (v2,)"""


def test_inductor_pass_adopts_an_eager_prompt():
    from kvarn_compile import inductor_pass

    torch._dynamo.reset()
    kv = inductor_pass("k4v2", group_size=G, key_bits=8, value_bits=8)
    got, (kc, _) = _prefill_then_decode(index_copy_sdpa, _pass_as_backend(kv), compiled_prefill=False)
    ref = _backend()
    want, _ = _prefill_then_decode(index_copy_sdpa, ref, compiled_prefill=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert is_freed(kc)


def test_inductor_pass_uuid_and_keys_are_per_object():
    from kvarn_compile import inductor_pass
    from kvarn_compile._torch_compat import custom_graph_pass_base
    from kvarn_compile.ops.keyed import resolve

    a, b = inductor_pass("k4v2"), inductor_pass("k4v2")
    assert isinstance(a, custom_graph_pass_base())
    assert a.uuid() == a.uuid() and a.uuid() != b.uuid()
    assert resolve(a.store.key("x.y")) == (a.store, "x.y")
    a.close()
    with pytest.raises(RuntimeError, match="no packed-state store"):
        resolve(a.store.key("x.y"))
