"""kvarn_compile.hf: KVarNCache under transformers' generate, on tiny random-weight models.

Models are built from configs on the spot (no hub access). G=32 tiles, so prompts of
40-75 tokens already exercise the sink, frozen tiles and the tail.

Two attention paths are checked against each other and against a manual computation:

* sdpa (unmodified model): KVarNCache.update hands a transient dequantized K/V of the layer;
* fused (``use_kvarn_attention``): the model's attention runs ``torch.ops.kvarn.attention``
  over the packed state; nothing full precision is built.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers as T
from transformers import AttentionInterface

from kvarn_compile import hf
from kvarn_compile.hf import KVarNCache, KVarNLayer, use_kvarn_attention
from kvarn_compile.ops.append import materialize
from kvarn_compile.state import BUF
from kvarn_compile.testing import cache_arg, oracle_attention

pytestmark = pytest.mark.usefixtures("one_thread")

G = 32
VOCAB = 128
LLAMA = dict(vocab_size=VOCAB, hidden_size=192, head_dim=32, num_attention_heads=6,
             num_key_value_heads=2, num_hidden_layers=2, intermediate_size=256)
HANDOFF_WARNING = "transient dequantized K/V"


def build(kind="llama", **overrides):
    """A tiny eval-mode model with sdpa attention and its own config object."""
    torch.manual_seed(0)
    if kind == "llama":
        cfg, cls = T.LlamaConfig(**LLAMA, **overrides), T.LlamaForCausalLM
    elif kind == "qwen2":
        cfg, cls = T.Qwen2Config(**{k: v for k, v in LLAMA.items() if k != "head_dim"},
                                 **overrides), T.Qwen2ForCausalLM
    elif kind == "mistral":
        cfg, cls = T.MistralConfig(**LLAMA, **overrides), T.MistralForCausalLM
    elif kind == "gpt2":
        cfg = T.GPT2Config(vocab_size=VOCAB, n_embd=192, n_head=6, n_layer=2, n_positions=256,
                           bos_token_id=0, eos_token_id=1, **overrides)
        cls = T.GPT2LMHeadModel
    elif kind == "mimo":                        # K 48 / V 32 channels; eager attention only
        cfg = T.MiMoV2FlashConfig(**{**LLAMA, "head_dim": 48}, v_head_dim=32,
                                  layer_types=["full_attention"] * 2,
                                  mlp_layer_types=["dense"] * 2, **overrides)
        cls = T.MiMoV2FlashForCausalLM
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager" if kind == "mimo" else "sdpa"
    model = cls(cfg).eval()
    model.generation_config.eos_token_id = None           # always generate max_new_tokens
    return model


def fused_copy(model):
    """The same weights with its own config object, switched to the fused kvarn attention."""
    other = copy.deepcopy(model)
    use_kvarn_attention(other)
    assert model.config._attn_implementation in ("sdpa", "eager")   # the original keeps its own
    return other


def new_cache(model, max_len=128, preset="k4v2", **kw):
    return KVarNCache(model.config, max_cache_len=max_len, preset=preset, group_size=G, **kw)


def generate(model, ids, cache, n, **kw):
    with torch.no_grad():
        return model.generate(ids, **cache_arg(model, cache), max_new_tokens=n, do_sample=False,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                              **kw)


def prompt(n, seed=1, batch=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (batch, n), generator=g)


@pytest.fixture()
def fresh_warning(monkeypatch):
    """The handoff warning is once per process; let this test see it."""
    monkeypatch.setattr(KVarNLayer, "_warned", False, raising=False)


@pytest.fixture()
def checked_attention(monkeypatch):
    """Wrap the ``kvarn`` attention function: every call is also computed by hand over
    ``materialize`` in float64 and the largest relative difference recorded."""
    original = hf.kvarn_attention_forward
    diffs = []

    def checking(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        out, w = original(module, query, key, value, attention_mask, scaling=scaling,
                          dropout=dropout, **kw)
        state = getattr(key, hf._STATE_ATTR)
        ref = oracle_attention(query, state.buffers, attention_mask, scale=scaling,
                               window=kw.get("sliding_window") or 0).transpose(1, 2)
        diffs.append(((out.double() - ref).abs().max() / ref.abs().max()).item())
        return out, w

    monkeypatch.setattr(hf, "kvarn_attention_forward", checking)  # use_kvarn_attention registers it
    yield diffs
    AttentionInterface.register("kvarn", original)


# ------------------------------------------------------------------------------ generate
def test_generate_sdpa_handoff_and_fused_paths_agree(fresh_warning, checked_attention):
    sdpa = build()
    fused = fused_copy(sdpa)
    ids = prompt(40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out_sdpa = generate(sdpa, ids, new_cache(sdpa), 40)
    handoff = [w for w in caught if HANDOFF_WARNING in str(w.message)]
    assert len(handoff) == 1                            # once, not per layer or per step
    assert "use_kvarn_attention" in str(handoff[0].message)

    cache = new_cache(fused)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out_fused = generate(fused, ids, cache, 40)
    assert not [w for w in caught if HANDOFF_WARNING in str(w.message)]
    assert torch.equal(out_sdpa.sequences, out_fused.sequences)
    assert cache.get_seq_length() == 79                 # the last token is never fed back
    assert [layer.state.n_tiles.tolist() for layer in cache.layers] == [[1], [1]]

    # every fused attention call (prefill, 39 decode steps, 2 layers) equals softmax
    # attention over the dequantized cache to float32 precision
    assert len(checked_attention) == 2 * 40
    assert max(checked_attention) < 1e-5
    # Logits: identical until the first tile freezes. From then on the two paths' layer-0
    # outputs differ by float32 noise (~1e-7), which can flip a 2-4 bit rounding when
    # layer 1 freezes its tile, so they only agree to ~1e-4.
    first_freeze = 64 - 40
    for step, (a, b) in enumerate(zip(out_sdpa.logits, out_fused.logits)):
        tol = 1e-5 if step < first_freeze else 1e-3
        torch.testing.assert_close(a, b, rtol=0, atol=tol * a.abs().max().item())


def test_fused_decode_matches_manual_attention_at_every_step(checked_attention):
    """A manual prefill + decode loop (no generate), with a left-padded batch mask."""
    fused = fused_copy(build())
    cache = new_cache(fused, max_len=96)
    ids = prompt(45, batch=2)
    mask = torch.ones(2, 45, dtype=torch.long)
    mask[0, :10] = 0
    with torch.no_grad():
        out = fused(ids, attention_mask=mask, **cache_arg(fused, cache))
        for _ in range(25):                             # 45 -> 70 crosses the 64 edge
            nxt = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
            out = fused(nxt, attention_mask=mask, **cache_arg(fused, cache))
    assert cache.layers[0].state.lengths.tolist() == [70, 70]
    assert cache.layers[0].state.n_tiles.tolist() == [1, 1]
    assert len(checked_attention) == 2 * 26 and max(checked_attention) < 1e-5


def test_cache_built_before_use_kvarn_attention_follows_the_model(fresh_warning,
                                                                  checked_attention):
    """The handoff/fused choice is made per update from the model config, not at init."""
    model = build()
    cache = new_cache(model)                            # built while the model is on sdpa
    use_kvarn_attention(model)
    ids = prompt(40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = generate(model, ids, cache, 10).sequences
    assert not [w for w in caught if HANDOFF_WARNING in str(w.message)]
    assert len(checked_attention) == 2 * 10            # the fused attention ran every step
    model.set_attn_implementation("sdpa")               # and back: the handoff path again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = generate(model, ids, new_cache(model), 10).sequences
    assert [w for w in caught if HANDOFF_WARNING in str(w.message)]
    assert len(checked_attention) == 2 * 10
    assert torch.equal(fused, again)


# ------------------------------------------------------------------------------ storage
def _all_tensors(obj, seen=None):
    """Every tensor reachable from obj's attributes, lists, tuples and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, T.PretrainedConfig)):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in _all_tensors(item, seen)]


@pytest.mark.parametrize("path", ["sdpa", "fused"])
def test_no_full_precision_cache_is_kept(path):
    model = build()
    if path == "fused":
        model = fused_copy(model)
    cache = new_cache(model, max_len=200)
    generate(model, prompt(60), cache, 30)
    buffers = [t for layer in cache.layers for t in layer.state.buffers]
    held = _all_tensors(cache)
    assert held and all(any(t is b for b in buffers) for t in held)
    for layer in cache.layers:
        assert layer.keys is None and layer.values is None
        st = layer.state
        exact = [st.buffers[BUF[n]] for n in ("sink_k", "sink_v", "tail_k", "tail_v")]
        # the high-precision part is one sink tile + one tail tile, not max_cache_len tokens
        assert sum(t.shape[2] for t in exact) == 4 * G
    assert cache.nbytes == sum(t.numel() * t.element_size() for t in buffers)
    fp16 = 2 * 2 * 2 * 200 * 32 * 2                      # layers * (K,V) * heads * tokens * D * 2 B
    assert cache.nbytes < fp16


def test_fused_update_returns_storage_free_placeholders():
    model = fused_copy(build())
    cache = new_cache(model, max_len=100)
    k, v = torch.randn(1, 2, 7, 32), torch.randn(1, 2, 7, 32)
    keys, values = cache.update(k, v, 0)
    for t in (keys, values):
        assert t.shape == (1, 2, 100, 32)
        assert t.untyped_storage().nbytes() == t.element_size()
        assert getattr(t, hf._STATE_ATTR) is cache.layers[0].state
    assert cache.get_seq_length() == 7


def test_cache_keyword_and_output_cache_on_this_transformers():
    """The cache goes in under the name this transformers' forward takes (also through a
    ``torch.compile`` wrapper, whose own signature is ``*args, **kwargs``), and comes back out
    of the model's output and of ``generate``'s result as the same object."""
    import inspect

    model = fused_copy(build())
    name = hf.cache_kwarg(model)
    assert name in inspect.signature(model.forward).parameters
    assert hf.cache_kwarg(torch.compile(model, backend="eager")) == name
    cache = new_cache(model)
    with torch.no_grad():
        out = model(prompt(5), use_cache=True, **cache_arg(model, cache))
    assert hf.output_cache(out) is cache and cache.get_seq_length() == 5
    assert hf.output_cache(generate(model, prompt(5), cache, 2)) is cache
    with pytest.raises(TypeError, match=r"^output_cache: expected a model output .* got tuple\.$"):
        hf.output_cache((out.logits, cache))


# ------------------------------------------------------------------------------ cache API
def test_lengths_and_mask_sizes():
    model = fused_copy(build())
    cache = new_cache(model, max_len=100)
    assert cache.get_seq_length() == 0
    assert cache.get_max_length() == 100
    assert cache.get_mask_sizes(5, 0) == (100, 0)
    with torch.no_grad():
        model(prompt(37), **cache_arg(model, cache))
    assert cache.get_seq_length() == 37 == cache.get_seq_length(1)
    assert cache.get_max_length() == 100 and cache.layers[0].get_max_length() == 100
    assert cache.get_mask_sizes(1, 1) == (100, 0)
    cache.reset()
    assert cache.get_seq_length() == 0
    with torch.no_grad():                                   # reusable after reset
        model(prompt(5), **cache_arg(model, cache))
    assert cache.get_seq_length() == 5


def test_reorder_cache_permutes_rows_in_place():
    model = fused_copy(build())
    cache = new_cache(model, max_len=100)
    with torch.no_grad():
        model(prompt(70, batch=3), **cache_arg(model, cache))
    before = [[t.clone() for t in layer.state.buffers] for layer in cache.layers]
    ptrs = [[t.data_ptr() for t in layer.state.buffers] for layer in cache.layers]
    idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(idx)
    for layer, old, ptr in zip(cache.layers, before, ptrs):
        assert [t.data_ptr() for t in layer.state.buffers] == ptr
        for now, then in zip(layer.state.buffers, old):
            assert torch.equal(now, then[idx])
    # generate's batch expansion / selection helpers (new tensors, rows copied; the state's
    # version says so to whoever holds its buffer list)
    versions = [layer.state.version for layer in cache.layers]
    cache.batch_select_indices(torch.tensor([1, 2]))
    cache.batch_repeat_interleave(2)
    assert [layer.state.version for layer in cache.layers] == [v + 2 for v in versions]
    for layer, old in zip(cache.layers, before):
        for now, then in zip(layer.state.buffers, old):
            assert torch.equal(now, then[idx][[1, 2]][[0, 0, 1, 1]])
    with torch.no_grad():                                   # and the cache keeps working
        model(prompt(1, batch=4), **cache_arg(model, cache))
    assert cache.get_seq_length() == 71


def test_beam_search_reorders_in_place_and_paths_agree(monkeypatch):
    sdpa = build()
    fused = fused_copy(sdpa)
    calls = []
    original = KVarNLayer.reorder_cache

    def spy(self, beam_idx):
        ptrs = [t.data_ptr() for t in self.state.buffers]
        original(self, beam_idx)
        calls.append(ptrs == [t.data_ptr() for t in self.state.buffers])

    monkeypatch.setattr(KVarNLayer, "reorder_cache", spy)
    ids = prompt(40)
    outs = [generate(m, ids, new_cache(m), 30, num_beams=2).sequences for m in (sdpa, fused)]
    assert calls and all(calls)
    assert outs[0].shape == (1, 70)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("path", ["sdpa", "fused"])
def test_left_padded_batch_rows_match_single_prompts(path):
    """Rows are independent. What is asserted:

    * the unpadded row equals that prompt alone, token for token;
    * the left-padded row equals the same padded prompt run alone (batch 1), token for token;
    * against the *unpadded* prompt alone, the padded row agrees (logits to float noise,
      tokens exactly) only while neither run has frozen a tile: the pad tokens occupy
      cache positions (masked, but stored), so tile boundaries fall on different tokens
      and the quantized caches legitimately differ afterwards.
    """
    model = build()
    if path == "fused":
        model = fused_copy(model)
    a, b = prompt(30, seed=2), prompt(45, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 15, dtype=torch.long), a], 1), b])
    mask = torch.ones(2, 45, dtype=torch.long)
    mask[0, :15] = 0
    n = 25                                                # row 0 freezes a tile at step 19
    both = generate(model, batch, new_cache(model), n, attention_mask=mask)
    alone_b = generate(model, b, new_cache(model), n)
    alone_padded_a = generate(model, batch[:1], new_cache(model), n, attention_mask=mask[:1])
    alone_a = generate(model, a, new_cache(model), n)
    assert torch.equal(both.sequences[1], alone_b.sequences[0])
    assert torch.equal(both.sequences[0], alone_padded_a.sequences[0])
    exact_steps = 64 - 45
    assert torch.equal(both.sequences[0, 45:45 + exact_steps], alone_a.sequences[0, 30:30 + exact_steps])
    for step in range(exact_steps):
        torch.testing.assert_close(both.logits[step][0], alone_a.logits[step][0], rtol=0, atol=1e-4)


# ------------------------------------------------------------------------------ crop
def test_crop_rolls_back_the_tail_and_revises_tiles():
    model = fused_copy(build())
    cache = new_cache(model, max_len=128, spec_tokens=8)
    ref_cache = new_cache(model, max_len=128, spec_tokens=8)
    ids = prompt(60)
    draft = prompt(5, seed=4)
    fix = prompt(2, seed=5)
    with torch.no_grad():
        model(ids, **cache_arg(model, cache))
        model(draft, **cache_arg(model, cache))              # 65 tokens; the draft is uncommitted
        assert cache.layers[0].state.n_tiles.tolist() == [0]
        cache.crop(0)                                      # transformers' "remove nothing"
        assert cache.get_seq_length() == 65
        cache.crop(-3)                                     # reject the last 3 draft tokens
        assert cache.get_seq_length() == 62
        got = model(fix, **cache_arg(model, cache)).logits   # continue at position 62
        model(ids, **cache_arg(model, ref_cache))            # same tokens, never seeing the rejects
        model(draft[:, :2], **cache_arg(model, ref_cache))
        want = model(fix, **cache_arg(model, ref_cache)).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    for layer, ref in zip(cache.layers, ref_cache.layers):
        assert layer.state.lengths.tolist() == ref.state.lengths.tolist() == [64]
        assert layer.state.committed.tolist() == ref.state.committed.tolist()

    # without spec tokens everything is committed and tile [32, 64) is frozen at once
    cache = new_cache(model, max_len=128)
    with torch.no_grad():
        model(prompt(70), **cache_arg(model, cache))
    assert cache.layers[0].state.n_tiles.tolist() == [1]
    cache.crop(-6)                                         # 64: still in the tail
    assert cache.get_seq_length() == 64
    assert cache.is_croppable
    with pytest.raises(ValueError, match="expected a negative number of tokens"):
        cache.crop(64)                                     # transformers' layers refuse it too
    assert cache.get_seq_length() == 64
    # into the packed tile: it goes back to the tail, dequantized, and continues like a cache
    # that was filled with those dequantized tokens
    k_hat, _ = materialize(cache.layers[0].state.buffers, dtype=torch.float32)
    cache.crop(-10)
    assert cache.get_seq_length() == 54
    assert cache.layers[0].state.n_tiles.tolist() == [0]
    k_cut, _ = materialize(cache.layers[0].state.buffers, dtype=torch.float32)
    torch.testing.assert_close(k_cut[:, :, :54], k_hat[:, :, :54], rtol=2e-3, atol=2e-3)
    more = prompt(12, seed=6)
    full = torch.cat([prompt(70)[:, :54], more], 1)
    with torch.no_grad():
        got = model(more, **cache_arg(model, cache)).logits
        want = build()(full).logits[:, 54:]
        once = model(full, **cache_arg(model, new_cache(model, max_len=128)))  # never cropped
        once = once.logits[:, 54:]
    assert cache.layers[0].state.n_tiles.tolist() == [1]   # the tile froze again at 64
    err = float((got - want).abs().max() / want.abs().max())
    err_once = float((once - want).abs().max() / want.abs().max())
    assert err < 1.5 * err_once + 0.01, (err, err_once)


def test_prompt_lookup_assisted_decoding_with_spec_tokens(monkeypatch):
    """Assisted decoding writes drafts, crops rejected ones and continues."""
    model = fused_copy(build(initializer_range=0.1))
    ids = torch.cat([prompt(20)] * 2, 1)                  # repeated n-grams: drafts get proposed
    greedy = generate(model, ids, new_cache(model, spec_tokens=8), 40).sequences
    cache = new_cache(model, spec_tokens=8)
    crops = []
    original = KVarNLayer.crop

    def spy(self, n):
        crops.append(n)
        original(self, n)

    monkeypatch.setattr(KVarNLayer, "crop", spy)
    assisted = generate(model, ids, cache, 40, prompt_lookup_num_tokens=4).sequences
    assert any(n < 0 for n in crops)                       # some drafts were rejected
    assert cache.get_seq_length() == assisted.shape[1] - 1
    # held draft tokens stay exact until accepted, so tiles freeze at other moments than in
    # plain decoding; before the first tile (position 64) both runs see the same cache
    assert torch.equal(assisted[:, :64], greedy[:, :64])


def test_assisted_decoding_with_default_settings_revises_tiles():
    """An assistant that disagrees with the model: rejected drafts are cropped out of frozen
    tiles too (no spec_tokens needed), and every step stays as close to the uncompressed
    model as plain decoding over the same cache kind."""
    fp = build()
    model = fused_copy(fp)
    assistant = build(initializer_range=0.1)              # other weights: drafts get rejected
    ids = prompt(60)
    cache = new_cache(model)
    crops = []
    original = KVarNLayer.crop

    def spy(self, n):
        crops.append(n)
        original(self, n)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KVarNLayer, "crop", spy)
        got = generate(model, ids, cache, 12, assistant_model=assistant)
    assert cache.is_croppable and any(n < 0 for n in crops)
    assert cache.get_seq_length() == got.sequences.shape[1] - 1
    plain = generate(model, ids, new_cache(model), 12)
    with torch.no_grad():
        want = fp(got.sequences).logits[:, 59:-1]
        want_plain = fp(plain.sequences).logits[:, 59:-1]
    err = float((torch.stack(got.logits, 1) - want).abs().max() / want.abs().max())
    err_plain = float((torch.stack(plain.logits, 1) - want_plain).abs().max() / want_plain.abs().max())
    assert err < 2 * err_plain + 0.01, (err, err_plain)


# ------------------------------------------------------------------------------ limits
def test_generation_past_capacity_raises_a_clear_error():
    model = fused_copy(build())
    with pytest.raises(ValueError, match="would hold 61 tokens, but the cache was allocated for 60"):
        generate(model, prompt(40), new_cache(model, max_len=60), 30)
    cache = new_cache(model, max_len=30)
    with pytest.raises(ValueError, match="allocated for 30"):
        generate(model, prompt(40), cache, 5)
    assert cache.get_seq_length() == 0                     # nothing was written


def test_unsupported_configs_raise():
    with pytest.raises(NotImplementedError, match="sliding_attention"):
        KVarNCache(T.Gemma2Config(num_hidden_layers=2), max_cache_len=64)
    with pytest.raises(NotImplementedError, match="sliding_attention"):
        KVarNCache(T.Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=16,
                                 max_window_layers=1), max_cache_len=64)
    with pytest.raises(ValueError, match="kivi"):
        KVarNCache(T.LlamaConfig(**LLAMA), max_cache_len=64, method="kivi")


def _deepseek_v3():
    """A tiny DeepSeek-V3 (multi-head latent attention: a 64-channel latent and a 16-channel
    RoPE key cached per token, 4 heads of 48-channel keys and 32-channel values)."""
    cfg = T.DeepseekV3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                             moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=64,
                             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                             n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
                             max_position_embeddings=1024)
    torch.manual_seed(0)
    model = T.DeepseekV3ForCausalLM(cfg).eval()
    for p in model.parameters():            # sharper logits than the default init
        if p.dim() == 2:
            p.data.mul_(2.0)
    return model


def test_latent_attention_cache_packs_the_latent_and_keeps_the_model_close():
    """transformers' DeepSeek-V3 caches the normed MLA latent as keys and the shared RoPE key
    as values: the latent packed at the preset's key bits, the RoPE key at 8 bits (never the
    preset's 2-bit values); the model reads them back through its own up-projections. Teacher
    forced over 200 tokens after a 300-token prompt, it stays close to the uncompressed model."""
    model = _deepseek_v3()
    ids = prompt(500)
    cache = new_cache(model, max_len=512)
    with torch.no_grad():
        ref = model(ids).logits[0, 299:499]
        got = [model(ids[:, :300], **cache_arg(model, cache)).logits[0, -1:]]
        for t in range(300, 499):
            got.append(model(ids[:, t:t + 1], **cache_arg(model, cache)).logits[0])
        plain = T.DynamicCache(config=model.config)
        model(ids[:, :499], **cache_arg(model, plain))       # the latents, uncompressed
    got = torch.cat(got)
    for layer in cache.layers:
        st = layer.state
        assert layer.latent and (st.head_dim, st.value_head_dim, st.kv_heads) == (64, 16, 1)
        assert (st.geometry.key_bits, st.geometry.value_bits) == (4, 8)
        assert int(st.n_tiles[0]) == (499 - G) // G         # most of the latent is packed
    # layer 0 caches what the uncompressed model caches (later layers see quantized inputs)
    latent, rope = (x[:, :, :499].float() for x in materialize(cache.layers[0].state.buffers))
    rel = [((a - b.float()).norm() / b.float().norm()).item()
           for a, b in ((latent, plain.layers[0].keys), (rope, plain.layers[0].values))]
    assert 0 < rel[0] < 0.15 and 0 < rel[1] < 0.01, rel      # 4-bit latent, 8-bit RoPE key
    lp, lq = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert top1 >= 0.9 and kl < 1e-3, (top1, kl)
    assert kl > 0, "nothing was quantized: the comparison would be vacuous"
    with pytest.raises(ValueError, match="attends over keys and values it projects from a multi-head"):
        use_kvarn_attention(copy.deepcopy(model))


@pytest.mark.parametrize("cache_kind, attn", [("dynamic", "sdpa"), ("static", "sdpa"),
                                              ("dynamic", "eager")])
def test_deepseek_v3_under_kvarn_backend_absorbs_its_latent_attention(cache_kind, attn):
    """Under ``kvarn_backend``, transformers' DeepSeek-V3 attention (the latent and the RoPE
    key cached, keys and values decompressed from them on read by kv_b_proj) is rewritten into
    kvarn::latent_attention over the packed latent, with the up-projection folded into the
    queries and the output: every site of the prefill and the decode graphs. It reads the
    same packed latent as KVarNCache (which hands the model the latents dequantized), so the
    logits equal that eager run to float rounding, every step."""
    from kvarn_compile import kvarn_backend
    from kvarn_compile.hf import static_cache_for
    from kvarn_compile.testing import record_graphs

    torch._dynamo.reset()
    model = _deepseek_v3()
    model.config._attn_implementation = attn
    model.generation_config.eos_token_id = None
    ids = prompt(70)
    want = generate(model, ids, new_cache(model, max_len=100, preset="k4v4"), 6)
    compiled = copy.deepcopy(model)
    backend = record_graphs(kvarn_backend("k4v4", group_size=G, compiler="eager"))
    compiled.forward = torch.compile(compiled.forward, backend=backend)
    cache = static_cache_for(compiled, 100) if cache_kind == "static" else T.DynamicCache(config=model.config)
    got = generate(compiled, ids, cache, 6)
    torch._dynamo.reset()
    report = backend.report
    assert len(report.rewritten) >= 4 and not report.unchanged, str(report)   # prefill + decode
    form = "scaled_dot_product_attention" if attn == "sdpa" else "matmul-softmax-matmul"
    for site in report.sites:
        assert site.attention == (f"multi-head latent attention decompressed on read ({form}), "
                                  "absorbed"), site.line()
    decode = backend.graph_log[-1][1]
    assert "kvarn.latent_attention(" in decode and "einsum('bhsn,hnc->bhsc'" in decode \
        and "einsum('bhsc,hvc->bhsv'" in decode, decode
    assert "sdpa(" not in decode and ".new_empty(" not in decode and "softmax(" not in decode
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        assert ((a - b).norm() / b.norm()).item() < 1e-4
    with torch.no_grad():
        fp = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                            return_dict_in_generate=True)
    rel = max(((a - b).norm() / b.norm()).item() for a, b in zip(got.logits, fp.logits))
    assert 1e-3 < rel < 0.1, rel          # the preset's error, not nothing


@pytest.mark.parametrize("kind, extra", [
    ("qwen2", {}),                              # q/k/v bias, GQA
    ("mistral", {"sliding_window": 24}),        # GQA + a window shorter than the sequence
    ("gpt2", {}),                               # MHA, Conv1D projections, learned positions
    ("mimo", {}),                               # values of another head dim than the keys
])
def test_other_architectures_generate_the_same_on_both_paths(kind, extra, checked_attention):
    sdpa = build(kind, **extra)
    fused = fused_copy(sdpa)
    ids = prompt(40)
    a = generate(sdpa, ids, new_cache(sdpa), 28)
    b = generate(fused, ids, new_cache(fused), 28)
    assert torch.equal(a.sequences, b.sequences)
    assert a.sequences.shape == (1, 68)
    assert len(checked_attention) == 2 * 28 and max(checked_attention) < 1e-5
