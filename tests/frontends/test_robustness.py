"""Robustness: models and inputs nobody tuned for. Each case either works, is refused with a
clear error, or is reported and left unchanged; none may give silently wrong results.

Every case of the robustness issue, where it is tested, and the outcome (the README's
"Limits" section states the same behaviour for users). ``module::test`` names a test of
another file: test_append, test_attention and test_dispatch in tests/ops/, test_quantize in
tests/quant/, test_fuzz in tests/passes/, test_hf_cache and test_backend_models next to this
file:

    case                                        outcome                          test
    ------------------------------------------  -------------------------------  ------------------------------------------
    NaN/+-inf: one channel, one token, a tile   poisons only queries that see    test_non_finite_* (here), test_append::
      (K or V; sink, packed tile, tail)         the token; cache: that token     test_nan_token_reads_back_*, test_quantize::
                                                only; other rows/heads clean     test_a_non_finite_token_*, *_whole_non_finite_tile
      ... a whole bad packed K tile, decode     works (C++ kernel: NaN output    test_non_finite_output_*[*-k-whole-tile-*-tq1]
                                                like the reference)
    check_finite=True                           NonFiniteError naming layer,     test_check_finite_* (here: compiled model and
                                                row, head, position; unchanged   KVarNCache), test_append::test_check_finite_*
    beyond fp16 range, bf16 model (<= 1e8)      works                            test_bf16_values_beyond_fp16_range
      bf16, |x| ~ 1e12, fp16 scales             rejected: ValueError naming      test_huge_bf16_values_with_fp16_scales
                                                scale_dtype; cache unchanged
      bf16 / fp32 + scale_dtype float32 etc.    works                            test_values_beyond_fp16_range_with_wider_*,
                                                                                 test_fp32_values_*_with_fp32_exact_storage
      fp32 model, |x| > 65504, default          rejected: ValueError naming      test_fp32_values_beyond_fp16_range_default
                                                exact_dtype; cache unchanged
    all-zero, constant, denormal tiles          works (zero/const exact,         test_zero_constant_and_denormal_tiles,
                                                denormals flush toward 0)        test_quantize::test_constant_tiles_*
    heavy-tailed channels (1000x)               works, error bounded             test_heavy_tailed_channels
    head dims 64..256 x MHA/GQA/MQA             works (eager ops and compiled)   test_head_dims_and_kv_groups,
                                                                                 test_compiled_head_dims_and_kv_groups
      CUDA, tiles the GPU quantizer does not    the reference quantizes them,    test_dispatch::test_tiles_the_quantizer_does_
      fit (256-token K tiles, Dv > 256)         logged once; launcher: error     not_fit_go_to_the_reference
    batch 1 and 32                              works                            test_compiled_lengths_and_batch
    lengths 1, G-1, G, G+1, capacity            works                            test_compiled_lengths_and_batch
    appends crossing several tiles              works (== one-by-one appends)    test_chunked_appends_cross_several_tiles,
                                                                                 test_append::test_single_token_appends_*
    prompt longer than capacity                 ValueError "would hold N tokens, test_prompt_longer_than_capacity,
                                                but ... allocated for M";        test_hf_cache::test_generation_past_capacity
                                                state unchanged
    beam search, KVarNCache                     works                            test_hf_cache::test_beam_search_*
    beam search, kvarn_backend                  works (rows reordered)           test_beam_search_compiled
    left-padded batches                         works                            test_hf_cache::test_left_padded_*,
                                                                                 test_backend_models::test_llama_left_padded_*
    sampling                                    works                            test_backend_models::test_hf_family (llama,gpt2)
    max_new_tokens reaching capacity            works; one more: ValueError      test_generate_up_to_capacity
    speculative rollback                        works; tiles hold accepted       test_assisted_decoding_compiled,
                                                tokens only                      test_append::test_rollback_never_freezes_*,
                                                                                 test_hf_cache::test_prompt_lookup_*
      ... without spec_tokens                   ValueError "... are committed"   test_rollback_without_spec_tokens_is_refused
    second generate, new prompt                 works, no state leaks            test_second_generate_new_prompt_lengths,
                                                                                 test_backend_models::test_hf_family (same len)
    sliding-window layers                       reported, left unchanged         test_backend_models (qwen2-swa),
                                                (KVarNCache refuses)             test_hf_cache::test_unsupported_configs_raise
    encoder-decoder cross-attention             cross-attn reported, unchanged   test_encoder_decoder_compiled
    logit soft-capping (Gemma2, eager)          unchanged, correct;              test_softcap_left_unchanged_and_correct,
                                                reported "not recognized"        test_fuzz::test_unrecognized_*
      KVarNCache fused attention                NotImplementedError              test_softcap_kvarn_cache_fused_path_refuses
    ALiBi as an sdpa mask (Falcon)              works (kvarn_backend);           test_alibi_falcon_compiled,
                                                KVarNCache: NotImplementedError  test_alibi_falcon_kvarn_cache_refuses
    ALiBi via baddbmm (Bloom, eager)            unchanged, correct;              test_alibi_bloom_left_unchanged_and_correct
                                                reported "not recognized"
    hybrid, short-conv layers (LFM2)            works                            test_hybrid_lfm2_compiled
    hybrid, Mamba layers (Jamba, vmap masks)    works                            test_hybrid_jamba_compiled (slow),
                                                                                 test_rewrite_keeps_vmap_nesting_calls
    graph break inside attention                reported, left unchanged         test_graph_break_inside_attention
    attention in a nested_compile_region        reported, left unchanged         test_nested_compile_region_is_reported
    per-layer (regional) compilation            works; past recompile_limit:     test_backend_models::test_each_decoder_*,
                                                RuntimeError, never uncompiled   test_backend_models::test_a_rewritten_*
    dynamic shapes (dynamic=True)               reported, left unchanged         test_dynamic_true_is_reported
    fullgraph=True                              works                            test_fullgraph_generate
    mode="reduce-overhead" on CPU               works, noted in the report       test_reduce_overhead_inductor (slow),
                                                                                 test_backend_models::test_mode_kwarg_*
    disk caches cold and warm                   works, identical                 test_inductor_disk_cache_cold_and_warm (slow)
    long generate loop                          3 graphs, no recompiles          test_long_generate_does_not_recompile
    two models, two threads, two backends       works                            test_two_models_in_two_threads
    state registry (inductor_pass), threads     works: one state per site and    test_state_registry_is_thread_safe,
                                                store; two passes in 2 threads   test_two_models_inductor_pass_in_two_threads
    two models, one backend                     works, one state per model       test_one_backend_two_models_interleaved
    fuzzing                                     see tests/passes/test_fuzz.py (two miscompiles found,
                                                fixed; pinned there by minimal programs)

Small shapes throughout (G=32 tiles, tiny random-weight transformers configs, no hub),
``compiler="eager"`` (the rewritten graph run as is) except the Inductor tests marked slow.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import os
import re
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import kvarn_compile.ops  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile import get_config, kvarn_backend
from kvarn_compile.hf import output_cache
from kvarn_compile.ops import append as append_ref
from kvarn_compile.quant import NonFiniteError
from kvarn_compile.state import BUF, allocate_layer
from kvarn_compile.testing import (
    FLIP_RTOL, INDUCTOR_RTOL, build_tiny, cache_arg, cpu_inductor_compiles_dynamic_llama,
    oracle_attention, random_kv, reference_attention,
    tiny_config_kwargs, tiny_model, tiny_prompt,
)
from kvarn_compile.testing import TINY_VOCAB as VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")

G = 32
CAP = 160


# ------------------------------------------------------------------------------ helpers
def new_state(cfg=None, *, batch=2, heads=2, head_dim=64, max_len=CAP, dtype=torch.float32,
              spec_tokens=0):
    cfg = cfg or get_config("k4v2", group_size=G)
    return allocate_layer(cfg, batch=batch, kv_heads=heads, head_dim=head_dim, max_len=max_len,
                          dtype=dtype, spec_tokens=spec_tokens)


def append(state, k, v, start=None):
    start = state.lengths.clone() if start is None else start
    c = state.config
    append_ref.append_(state.buffers, k, v, start, method=c.method, iters=c.sinkhorn_iters,
              recent=c.recent_window)


def fused(q, state, mask=None, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.kvarn.attention(q, state.buffers, mask, scale, True, 0)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


# random K/V [batch, heads, tokens, d] (uneven channels, offset keys) from seed 0 unless given
kv = functools.partial(random_kv, seed=0)


# ==============================================================================================
# A. Values
# ==============================================================================================
T_NF = 76            # tokens: sink [0, 32), one packed tile [32, 64), tail [64, 76)
REGIONS = {"sink": 5, "tile": 40, "tail": 70}
BAD = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}


def _nf_cases():
    for bad, which, region, extent, tq in itertools.product(
            BAD, ("k", "v"), (*REGIONS, "whole-tile"), ("channel", "token"), (1, 20)):
        if region == "whole-tile" and extent == "token":
            continue
        marks = []
        yield pytest.param(bad, which, region, extent, tq, marks=marks,
                           id=f"{bad}-{which}-{region}-{extent}-tq{tq}")


@pytest.mark.parametrize("bad, which, region, extent, tq", list(_nf_cases()))
def test_non_finite_output_stays_within_what_full_precision_poisons(bad, which, region, extent, tq):
    """A NaN/inf in K or V of one token (one channel or all), or of a whole packed tile.

    Decided behaviour, per query row: poisoned (non-finite) only if full-precision eager
    attention poisons it or it can see the bad token; never finite where full precision is
    poisoned and the token is visible. Other batch rows and KV heads are never touched; in
    the cache only the bad tokens read back non-finite. The sink and tail keep the values
    as they are, so there the result is exactly full precision's (an inf in one key channel
    gives a +inf or -inf score depending on the query's sign). A packed token holding any
    NaN/inf is stored as NaN as a whole: every query that sees it reads NaN, and value tiles
    live in the rotated frame, so one bad value channel poisons every output channel (full
    precision: that channel; after the output projection both are NaN).
    """
    b, h, hq, d = 2, 2, 4, 64
    k, v = kv(b, h, T_NF, d)
    x = k if which == "k" else v
    if region == "whole-tile":
        bad_pos = list(range(G, 2 * G))
        x[1, 0, G:2 * G, :] = BAD[bad]
    else:
        bad_pos = [REGIONS[region]]
        if extent == "token":
            x[1, 0, bad_pos[0], :] = BAD[bad]
        else:
            x[1, 0, bad_pos[0], 3] = BAD[bad]
    st = new_state()
    append(st, k[:, :, :T_NF - tq], v[:, :, :T_NF - tq])
    append(st, k[:, :, T_NF - tq:], v[:, :, T_NF - tq:])
    assert st.n_tiles.tolist() == [1, 1]

    # the cache: exactly the bad tokens read back non-finite
    k_hat, v_hat = append_ref.materialize(st.buffers, dtype=torch.float32)
    for hat in (k_hat, v_hat):
        bad_tok = ~torch.isfinite(hat[:, :, :T_NF]).all(-1)          # [B, H, T]
        want = torch.zeros_like(bad_tok)
        if hat is (k_hat if which == "k" else v_hat):
            want[1, 0, bad_pos] = True
        assert torch.equal(bad_tok, want)

    q = torch.randn(b, hq, tq, d, generator=torch.Generator().manual_seed(1))
    out = fused(q, st)
    got_rows = ~torch.isfinite(out).all(-1)                            # [B, Hq, Tq]
    fp_rows = ~torch.isfinite(reference_attention(q, k, v)).all(-1)
    q_pos = torch.arange(T_NF - tq, T_NF)
    sees = torch.zeros_like(got_rows)
    sees[1, :hq // h] = (q_pos[:, None] >= torch.tensor(bad_pos)[None, :]).any(-1)
    assert not got_rows[0].any() and not got_rows[1, hq // h:].any(), "another row/head was poisoned"
    assert not (got_rows & ~(sees | fp_rows)).any(), "a query that cannot see the token was poisoned"
    assert (got_rows | ~(sees & fp_rows)).all(), "a query that sees the bad token got a finite output"
    # everything else matches the oracle over the dequantized cache
    clean = ~got_rows
    ref = oracle_attention(q, st.buffers).float()
    torch.testing.assert_close(out[clean], ref[clean], rtol=1e-4, atol=1e-4)


def test_non_finite_token_does_not_spread_through_later_tiles():
    """A bad token in the tail is frozen into its tile later; the tile's other tokens and the
    following tiles are quantized from finite statistics (same codes as without it)."""
    k, v = kv(1, 2, 140, 64)
    st, clean = new_state(batch=1), new_state(batch=1)
    k_bad = k.clone()
    k_bad[0, 1, 70, :] = float("nan")
    for i in range(0, 140, 7):                      # decode-like appends freeze tiles on the way
        append(st, k_bad[:, :, i:i + 7], v[:, :, i:i + 7])
        append(clean, k[:, :, i:i + 7], v[:, :, i:i + 7])
    assert st.n_tiles.tolist() == [3]                 # tiles [32, 64), [64, 96), [96, 128)
    k_hat, _ = append_ref.materialize(st.buffers, dtype=torch.float32)
    k_ref, _ = append_ref.materialize(clean.buffers, dtype=torch.float32)
    bad = ~torch.isfinite(k_hat[0, :, :140]).all(-1)
    assert bad.nonzero().tolist() == [[1, 70]]
    assert torch.equal(k_hat[0, 0], k_ref[0, 0])                      # other head: identical
    assert torch.equal(k_hat[0, 1, :64], k_ref[0, 1, :64])            # earlier tokens: identical
    assert torch.equal(k_hat[0, 1, 96:140], k_ref[0, 1, 96:140])      # later tiles, tail: identical
    others = torch.arange(32) != 6
    assert rel(k_hat[0, 1, 64:96][others], k[0, 1, 64:96][others]) < 1.2 * rel(
        k_ref[0, 1, 64:96][others], k[0, 1, 64:96][others])


def test_check_finite_in_compiled_model_names_layer_and_position():
    """kvarn_backend(check_finite=True): a NaN reaching the cache raises NonFiniteError naming
    the attention site, batch row, head and position, before anything is written."""
    import transformers as tf

    model = tiny_model("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[77] = float("nan")
    ids = tiny_prompt(1, length=40)
    ids[0, 25] = 77
    backend = kvarn_backend(**PRESET, compiler="eager", max_cache_len=128, check_finite=True)
    model.compile(backend=backend)
    with pytest.raises(NonFiniteError, match=r"model\.layers\.0\.self_attn: NaN/inf in the new keys/values "
                                             r"at batch row 0, kv head \d, token position 25"):
        with torch.no_grad():
            model(ids, **cache_arg(model, tf.DynamicCache(config=model.config)))
    for (name, _), state in backend.states.items():
        assert state.lengths.tolist() == [0], name                   # nothing written
    # without the check: NaN logits exactly where the full-precision model has them
    fp = tiny_model("llama")
    with torch.no_grad():
        fp.model.embed_tokens.weight[77] = float("nan")
        want = fp(ids).logits
    torch._dynamo.reset()
    model = copy.deepcopy(fp)
    backend = kvarn_backend(**PRESET, compiler="eager", max_cache_len=128)
    model.compile(backend=backend)
    with torch.no_grad():
        got = model(ids, **cache_arg(model, tf.DynamicCache(config=model.config))).logits
    # (full precision poisons the earlier queries of the prompt too: 0 * NaN in weights @ V)
    assert torch.isnan(want[0, 25:]).all()
    assert torch.equal(torch.isnan(got), torch.isnan(want))


def test_check_finite_in_kvarn_cache():
    from kvarn_compile.hf import KVarNCache

    model = tiny_model("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[77] = float("inf")
    ids = tiny_prompt(1, length=40)
    ids[0, 31] = 77
    cache = KVarNCache(model.config, max_cache_len=128, **PRESET, check_finite=True)
    with pytest.raises(NonFiniteError, match=r"layers\.0: NaN/inf .* token position 31"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            model(ids, **cache_arg(model, cache))
    assert cache.layers[0].state.lengths.tolist() == [0]


# ---------------------------------------------------------------- beyond the fp16 range
def _roundtrip_errors(dtype, magnitude, **overrides):
    """(K error, V error, attention error) of a cache holding 96 tokens of |x| ~ magnitude,
    relative to full precision; NaN when anything stored reads back non-finite."""
    cfg = get_config("k4v2", group_size=G, **overrides)
    st = new_state(cfg, batch=1, heads=1, dtype=dtype)
    k, v = kv(1, 1, 100, 64, scale=magnitude, dtype=dtype)
    append(st, k, v)
    k_hat, v_hat = append_ref.materialize(st.buffers, dtype=torch.float64)
    q = torch.randn(1, 8, 1, 64, generator=torch.Generator().manual_seed(3))
    q = (q * 0.3 / magnitude).to(dtype)                 # the same O(1) logits at every magnitude
    out = fused(q, st)
    if not all(bool(torch.isfinite(t).all()) for t in (k_hat, v_hat, out)):
        return float("nan"), float("nan"), float("nan")
    want = reference_attention(q, k, v)
    return rel(k_hat[..., :100, :], k), rel(v_hat[..., :100, :], v), rel(out, want)


def _close_to_unit_scale(errs, dtype, **overrides):
    base = _roundtrip_errors(dtype, 1.0, **overrides)
    assert all(math.isfinite(e) for e in errs), f"non-finite cache or output: {errs}"
    for e, b in zip(errs, base):
        assert e <= 1.5 * b + 1e-3, (errs, base)


@pytest.mark.parametrize("magnitude", [1e5, 1e8])
def test_bf16_values_beyond_fp16_range(magnitude):
    """bf16 models keep bf16 sink/tail; the normalization scales (up to e^10 per axis) absorb
    magnitudes far beyond 65504 before the fp16 scales are stored."""
    _close_to_unit_scale(_roundtrip_errors(torch.bfloat16, magnitude), torch.bfloat16)


@pytest.mark.parametrize("dtype, overrides", [
    (torch.bfloat16, dict(scale_dtype="float32")),
    (torch.bfloat16, dict(scale_dtype="bfloat16")),
    (torch.float32, dict(exact_dtype="float32", scale_dtype="float32")),
])
def test_values_beyond_fp16_range_with_wider_storage(dtype, overrides):
    _close_to_unit_scale(_roundtrip_errors(dtype, 1e12, **overrides), dtype, **overrides)


def test_fp32_values_beyond_fp16_range_with_fp32_exact_storage():
    _close_to_unit_scale(_roundtrip_errors(torch.float32, 1e5, exact_dtype="float32"),
                         torch.float32, exact_dtype="float32")


def _works_or_refuses(dtype, magnitude, match, **overrides):
    try:
        errs = _roundtrip_errors(dtype, magnitude, **overrides)
    except ValueError as err:                        # refusing clearly is acceptable
        assert match in str(err)
        return
    _close_to_unit_scale(errs, dtype, **overrides)


def test_huge_bf16_values_with_fp16_scales():
    """Tile scales in fp16 cannot hold |x| ~ 1e12: the append is refused, naming scale_dtype."""
    _works_or_refuses(torch.bfloat16, 1e12, "scale_dtype")


def test_fp32_values_beyond_fp16_range_default():
    """fp32 models keep sink/tail in fp16 by default: |x| > 65504 is refused, naming exact_dtype."""
    _works_or_refuses(torch.float32, 1e5, "exact_dtype")


@pytest.mark.parametrize("dtype, magnitude", [(torch.float32, 1e5), (torch.bfloat16, 1e12)])
def test_out_of_range_append_leaves_the_cache_unchanged(dtype, magnitude):
    cfg = get_config("k4v2", group_size=G)
    st = new_state(cfg, batch=1, heads=1, dtype=dtype)
    k, v = kv(1, 1, 40, 64, dtype=dtype)
    append(st, k, v)
    before = [t.clone() for t in st.buffers]
    k2, v2 = kv(1, 1, 60, 64, dtype=dtype)
    k2[0, 0, 37, 5] = magnitude
    match = "position 77 holds" if dtype == torch.float32 else r"positions 32\.\.\.95\): the K scales overflow"
    with pytest.raises(ValueError, match=match):
        append(st, k2, v2)
    assert all(torch.equal(a, b) for a, b in zip(st.buffers, before))


# ---------------------------------------------------------------- degenerate tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_zero_constant_and_denormal_tiles(dtype):
    """All-zero tiles reconstruct exactly, constant tiles up to the fp16 scale rounding (which
    the rotation spreads over the D channels, as in tests/quant/test_quantize.py); denormal
    tiles stay finite and at worst flush toward zero (error below their own magnitude); no 0/0."""
    tiny = {torch.float32: 1e-40, torch.float16: 1e-6, torch.bfloat16: 1e-39}[dtype]
    st = new_state(batch=3, heads=1, dtype=dtype)
    k = torch.zeros(3, 1, 100, 64)
    v = torch.zeros(3, 1, 100, 64)
    k[1], v[1] = 3.25, -0.5                                        # constant
    k[2] = torch.randn(1, 100, 64) * tiny                          # denormal
    v[2] = torch.randn(1, 100, 64) * tiny
    k, v = k.to(dtype), v.to(dtype)
    append(st, k, v)
    k_hat, v_hat = append_ref.materialize(st.buffers, dtype=torch.float32)
    assert torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all()
    assert (k_hat[0] == 0).all() and (v_hat[0] == 0).all()
    spread = 64 * 2 ** -10
    torch.testing.assert_close(k_hat[1, :, :100], k[1].float(), rtol=0, atol=3.25 * spread)
    torch.testing.assert_close(v_hat[1, :, :100], v[1].float(), rtol=0, atol=0.5 * spread)
    for hat, x in ((k_hat, k), (v_hat, v)):
        assert ((hat[2, :, :100] - x[2].float()).abs() <= x[2].float().abs().max() * 1.01).all()
    q = torch.randn(3, 2, 1, 64, dtype=dtype)
    out = fused(q, st)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all()
    torch.testing.assert_close(out[1].float(), torch.full_like(out[1].float(), -0.5), rtol=0,
                               atol=0.5 * spread)


@pytest.mark.parametrize("which", ["k", "v"])
def test_heavy_tailed_channels(which):
    """A few channels 1000x the rest: the attention stays finite and within a fixed multiple
    of the error on well-behaved data (K: per-channel rows absorb the outliers; V: the
    rotation spreads them before the per-token rows)."""
    d = 128
    k, v = kv(2, 2, 150, d)
    x = k if which == "k" else v
    heavy = x.clone()
    heavy[..., [3, 50, 97]] *= 1000.0
    errs = []
    for kk, vv in ((k, v), (heavy, v) if which == "k" else (k, heavy)):
        st = new_state(batch=2, heads=2, head_dim=d, max_len=160)
        append(st, kk, vv)
        q = torch.randn(2, 4, 1, d) / (30.0 if which == "k" else 1.0)
        out = fused(q, st)
        assert torch.isfinite(out).all()
        errs.append(rel(out, reference_attention(q, kk, vv)))
    assert errs[1] < max(3 * errs[0], 0.05), errs


# ==============================================================================================
# B. Shapes
# ==============================================================================================
HEAD_DIMS = [64, 80, 96, 112, 128, 256]
KV_GROUPS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}       # (query heads, kv heads)


@pytest.mark.parametrize("layout", list(KV_GROUPS))
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_head_dims_and_kv_groups(d, layout):
    """Eager ops: prefill chunk and decode steps (C++ kernel where it applies) == float64
    attention over the dequantized cache, for every common head dim and head layout."""
    hq, h = KV_GROUPS[layout]
    st = new_state(batch=2, heads=h, head_dim=d, max_len=128)
    k, v = kv(2, h, 100, d, seed=d)
    append(st, k[:, :, :97], v[:, :, :97])
    q = torch.randn(2, hq, 97, d)
    torch.testing.assert_close(fused(q, st).double(), oracle_attention(q, st.buffers), rtol=1e-4, atol=1e-4)
    for t in range(97, 100):
        append(st, k[:, :, t:t + 1], v[:, :, t:t + 1])
        q = torch.randn(2, hq, 1, d)
        torch.testing.assert_close(fused(q, st).double(), oracle_attention(q, st.buffers), rtol=1e-4, atol=1e-4)
    assert st.n_tiles.tolist() == [2, 2]
    # and the packed cache is close to the input (a broken rotation would not be)
    k_hat, _ = append_ref.materialize(st.buffers, dtype=torch.float32)
    assert rel(k_hat[:, :, G:3 * G], k[:, :, G:3 * G]) < 0.15


# A gpt-fast style step over a static cache: the spelling the fuzz tests vary.
def _static_step(q, k, v, pos, kc, vc, mask):
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)


def _run_static(fn, *, batch, hq, h, d, steps, cap, compiled=True, cfg_kw=None, seed=0):
    """Prefill + decode through ``fn`` compiled with kvarn_backend; returns the outputs and
    the eager reference: the same K/V appended to a fresh state with the kvarn ops."""
    cfg_kw = dict(PRESET, **(cfg_kw or {}))
    backend = kvarn_backend(**cfg_kw, compiler="eager")
    run = torch.compile(fn, backend=backend, fullgraph=True) if compiled else fn
    kc, vc = torch.zeros(batch, h, cap, d), torch.zeros(batch, h, cap, d)
    causal = torch.ones(cap, cap, dtype=torch.bool).tril()
    ref_state = new_state(get_config(**cfg_kw), batch=batch, heads=h, head_dim=d, max_len=cap)
    g = torch.Generator().manual_seed(seed)
    pos0, outs, refs = 0, [], []
    for t in steps:
        q = torch.randn(batch, hq, t, d, generator=g)
        k, v = kv(batch, h, t, d, seed=int(torch.randint(1 << 30, (1,), generator=g)))
        pos = torch.arange(pos0, pos0 + t)
        mask = causal[None, None, pos0:pos0 + t]
        outs.append(run(q, k, v, pos, kc, vc, mask))
        append(ref_state, k, v)
        refs.append(torch.ops.kvarn.attention(q, ref_state.buffers, mask, d ** -0.5, True, 0))
        pos0 += t
    return outs, refs, backend, ref_state


@pytest.mark.parametrize("d, layout", [(d, "GQA") for d in HEAD_DIMS] + [(128, "MHA"), (128, "MQA")])
def test_compiled_head_dims_and_kv_groups(d, layout):
    hq, h = KV_GROUPS[layout]
    torch._dynamo.reset()
    outs, refs, backend, ref_state = _run_static(_static_step, batch=1, hq=hq, h=h, d=d,
                                                 steps=[70, 1, 1], cap=96)
    assert not backend.report.unchanged and backend.report.rewritten, str(backend.report)
    for got, want in zip(outs, refs):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    (state,) = backend.states.values()
    assert all(torch.equal(a, b) for a, b in zip(state.buffers, ref_state.buffers))


def test_a_graph_with_symbolic_input_shapes_is_compiled_for_itself():
    """The backend serves a graph Dynamo traced again (a cache tensor's type changed) with the
    one it compiled before for the same code and input shapes, but not when the inputs have
    symbolic shapes: the guards that compile added (the pass reads a static cache's length as
    an int) are not the new graph's, which then served caches of other lengths with the old
    site geometry (transformers 5.17: a static-cache generate after a dynamic one stopped with
    "writes at position 64, but it holds 0 tokens")."""
    from kvarn_compile.backend import _graph_key

    seen = []

    def capture(gm, example_inputs):
        seen.append(_graph_key(gm, example_inputs, None, ""))
        return gm.forward

    for dynamic in (True, False):
        torch._dynamo.reset()
        torch.compile(lambda x: x * 2, backend=capture, dynamic=dynamic)(torch.randn(3, 4, 5))
    torch._dynamo.reset()
    assert seen[0] is None and seen[1] is not None, seen


def test_describing_a_packed_buffer_reads_no_tokens():
    """Dynamo describes every graph input before a (re)compile, for its fake copy: is_conj(),
    _is_view(), is_mkldnn, ... (torch 2.11 asks outside ``is_compiling()``, so a model buffer
    whose tokens are packed saw those queries as an eager access, got its tokens dequantized
    and packed again: other codes, 0.3 off after one decode step). No such query reads data:
    the buffer stays packed, the next step matches the eager ops, and nothing is noted."""
    from torch._subclasses.meta_utils import MetaTensorDescriber

    from kvarn_compile.cache_book import PackedBuffer

    torch._dynamo.reset()
    backend = kvarn_backend(**PRESET, compiler="eager")
    run = torch.compile(_static_step, backend=backend, fullgraph=True)
    b, hq, h, d, cap = 1, 4, 2, 64, 96
    kc, vc = torch.zeros(b, h, cap, d), torch.zeros(b, h, cap, d)
    causal = torch.ones(cap, cap, dtype=torch.bool).tril()
    ref_state = new_state(get_config(**PRESET), batch=b, heads=h, head_dim=d, max_len=cap)
    pos0 = 0
    for t in (70, 1):
        assert all(isinstance(buf, PackedBuffer) for buf in (kc, vc)) == (pos0 > 0)
        if pos0:
            for buf in (kc, vc):
                MetaTensorDescriber().describe_tensor(buf)
                buf.is_conj(), buf.is_neg(), buf._is_view(), buf.is_mkldnn, buf.is_inference()
                assert isinstance(buf, PackedBuffer)
        q = torch.randn(b, hq, t, d)
        k, v = kv(b, h, t, d, seed=t)
        pos = torch.arange(pos0, pos0 + t)
        out = run(q, k, v, pos, kc, vc, causal[None, None, pos0:pos0 + t])
        append(ref_state, k, v)
        want = torch.ops.kvarn.attention(q, ref_state.buffers, causal[None, None, pos0:pos0 + t],
                                         d ** -0.5, True, 0)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        pos0 += t
    assert not any("touched" in note for note in backend.report.notes), backend.report.notes


@pytest.mark.parametrize("batch, steps, cap", [
    (1, [1, 1, 1], 64),                       # length 1, then single tokens
    (1, [G - 1, 1, 1], 64),                   # G-1: the sink completes on the next step
    (1, [G, 1], 64),                          # exactly G
    (1, [G + 1, 1], 96),                      # G+1
    (1, [2 * G - 1, 1, 1], 96),               # the first tile freezes on a decode step
    (1, [90, 1, 1, 1, 1, 1, 1], 96),          # exactly the capacity
    (32, [70, 1, 1], 96),                     # batch 32
    (2, [10, 150, 1], 192),                   # one append crossing four tiles at once
])
def test_compiled_lengths_and_batch(batch, steps, cap):
    torch._dynamo.reset()
    outs, refs, backend, ref_state = _run_static(_static_step, batch=batch, hq=4, h=2, d=64,
                                                 steps=steps, cap=cap)
    assert not backend.report.unchanged, str(backend.report)
    for got, want in zip(outs, refs):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    n = sum(steps)
    assert ref_state.lengths.tolist() == [n] * batch
    q = torch.randn(batch, 4, 1, 64)
    torch.testing.assert_close(fused(q, ref_state).double(), oracle_attention(q, ref_state.buffers), rtol=1e-4, atol=1e-4)


def test_chunked_appends_cross_several_tiles():
    """One append of 150 tokens at position 10 (completes the sink, freezes four tiles at
    once) == 160 single-token appends, bit for bit."""
    k, v = kv(2, 2, 160, 64)
    chunked, single = new_state(max_len=192), new_state(max_len=192)
    append(chunked, k[:, :, :10], v[:, :, :10])
    append(chunked, k[:, :, 10:], v[:, :, 10:])
    for t in range(160):
        append(single, k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert chunked.n_tiles.tolist() == [4, 4]
    for name, i in BUF.items():          # the tail ring's free slots hold stale tokens: skip
        if i < len(chunked.buffers) and name not in ("tail_k", "tail_v"):
            assert torch.equal(chunked.buffers[i], single.buffers[i]), name
    for a, b in zip(append_ref.materialize(chunked.buffers), append_ref.materialize(single.buffers)):
        assert torch.equal(a, b)


def _cat_step(q, k, v, past_k, past_v, mask):
    # transformers DynamicCache: torch.cat along the sequence, sdpa with a causal mask
    keys = torch.cat([past_k, k], dim=-2)
    values = torch.cat([past_v, v], dim=-2)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True), keys, values


def test_prompt_longer_than_capacity():
    """Compiled model: a clear error naming the site, the lengths and the fix; state untouched."""
    torch._dynamo.reset()
    backend = kvarn_backend(**PRESET, compiler="eager", max_cache_len=64)
    run = torch.compile(_cat_step, backend=backend)
    empty = torch.zeros(1, 2, 0, 64)
    k, v = kv(1, 2, 40, 64)
    mask = torch.ones(1, 1, 40, 40, dtype=torch.bool).tril()
    _, past_k, past_v = run(torch.randn(1, 4, 40, 64), k, v, empty, empty, mask)
    (state,) = backend.states.values()
    assert state.lengths.tolist() == [40]
    before = [t.clone() for t in state.buffers]
    k, v = kv(1, 2, 30, 64)
    mask = torch.ones(1, 1, 30, 70, dtype=torch.bool).tril(40)
    with pytest.raises(ValueError, match=r"batch row 0 would hold 70 tokens, but the cache was "
                                         r"allocated for 64\. Allocate it with a larger max_len"):
        run(torch.randn(1, 4, 30, 64), k, v, past_k, past_v, mask)
    # unchanged: a cat cache's state may have grown toward max_len before the call (its
    # capacity says so), but it holds the same tokens (what was there is in place, the new
    # slots are empty)
    at = state.fields.layout.index("capacity")
    assert 40 <= int(state.capacity[0]) <= 64
    for i, (a, b) in enumerate(zip(state.buffers, before)):
        if i == at:
            continue
        if a.shape != b.shape:
            assert a.shape[:2] == b.shape[:2] and a.shape[3:] == b.shape[3:] and a.shape[2] > b.shape[2]
            assert not a[:, :, b.shape[2]:].any()
            a = a[:, :, :b.shape[2]]
        assert torch.equal(a, b)
    # a new prompt that fits starts a new cache (position 0), in a state of its own while
    # the first cache's handles live
    k, v = kv(1, 2, 64, 64)
    mask = torch.ones(1, 1, 64, 64, dtype=torch.bool).tril()
    run(torch.randn(1, 4, 64, 64), k, v, empty, empty, mask)
    (latest,) = backend.states.values()
    assert latest is not state and latest.lengths.tolist() == [64]
    assert state.lengths.tolist() == [40]


# ==============================================================================================
# C-E. Generation, models and the compiler, on tiny transformers models
# ==============================================================================================
PRESET = dict(preset="k4v2", group_size=G)
def _generate(model, ids, new, **kw):
    kw.setdefault("do_sample", False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, max_new_tokens=new, output_logits=True,
                              return_dict_in_generate=True, **kw)


def _kvarn_eager(model, ids, new, *, max_len=256, spec_tokens=0, **kw):
    """The eager model on a KVarNCache with the fused kvarn attention (the reference)."""
    from kvarn_compile.hf import KVarNCache, use_kvarn_attention

    other = copy.deepcopy(model)
    use_kvarn_attention(other)
    cache = KVarNCache(other.config, max_cache_len=max_len, spec_tokens=spec_tokens, **PRESET)
    return _generate(other, ids, new, **cache_arg(other, cache), **kw)


def _same(got, want, rtol=1e-4):
    assert got.sequences.tolist() == want.sequences.tolist()
    for a, b in zip(got.logits, want.logits):
        assert (a - b).abs().max().item() <= rtol * b.abs().max().item()


def _compiled(model, **kw):
    backend = kvarn_backend(**PRESET, compiler="eager", max_cache_len=kw.pop("max_cache_len", 256), **kw)
    model.compile(backend=backend)
    return backend


# ---------------------------------------------------------------- C. generation
def test_beam_search_compiled(fresh_dynamo):
    model = tiny_model("llama")
    ids = tiny_prompt(1)
    want = _kvarn_eager(model, ids, 8, num_beams=3)
    _compiled(model)
    got = _generate(model, ids, 8, num_beams=3)
    assert got.sequences.tolist() == want.sequences.tolist()


def test_generate_up_to_capacity(fresh_dynamo):
    """60 + 11 new tokens write exactly max_cache_len=70 positions; one more is refused with
    a clear error, after which a new prompt runs cleanly."""
    model = tiny_model("llama")
    backend = _compiled(model, max_cache_len=70)
    ids = tiny_prompt(1)
    got = _generate(model, ids, 11)
    _same(got, _kvarn_eager(model, ids, 11, max_len=70))
    assert {s.lengths.item() for s in backend.states.values()} == {70}
    with pytest.raises(ValueError, match=r"would hold 71 tokens, but the cache was allocated for 70"):
        _generate(model, ids, 12)
    ids2 = tiny_prompt(2)
    _same(_generate(model, ids2, 5), _kvarn_eager(model, ids2, 5, max_len=70))


def test_assisted_decoding_compiled(fresh_dynamo, monkeypatch):
    """Prompt-lookup (speculative) decoding with kvarn_backend(spec_tokens=8): drafts are
    written, rejected ones cropped and overwritten; tokens equal the eager KVarNCache run,
    and every token in a packed tile is an accepted token (its dequantized key is close to
    the full-precision key of the final sequence; a rejected token's would not be)."""
    from transformers.cache_utils import DynamicLayer

    model = tiny_model("llama")
    fp = copy.deepcopy(model)
    ids = torch.cat([tiny_prompt(1, length=25)] * 2, 1)         # repeated n-grams: drafts get proposed
    want = _kvarn_eager(model, ids, 30, spec_tokens=8, prompt_lookup_num_tokens=4)
    crops = []
    original = DynamicLayer.crop
    monkeypatch.setattr(DynamicLayer, "crop", lambda self, n: (crops.append(n), original(self, n))[1])
    backend = _compiled(model, spec_tokens=8)
    got = _generate(model, ids, 30, prompt_lookup_num_tokens=4)
    assert any(n < got.sequences.shape[1] - 1 for n in crops), "no draft was rejected"
    _same(got, want)
    seq = got.sequences
    with torch.no_grad():
        out = fp(seq[:, :-1], use_cache=True)
    for i, layer in enumerate(output_cache(out).layers):
        state = backend.states[(f"model.layers.{i}.self_attn", 1)]
        n_tiles = int(state.n_tiles)
        assert n_tiles >= 1 and int(state.lengths) == seq.shape[1] - 1
        k_hat, _ = append_ref.materialize(state.buffers, dtype=torch.float32)
        lo, hi = G, G + n_tiles * G
        err = (k_hat[0, :, lo:hi] - layer.keys[0, :, lo:hi]).norm(dim=-1) / layer.keys[0, :, lo:hi].norm(dim=-1)
        assert err.max() < 0.5, f"layer {i}: a packed token does not match the accepted sequence"


def test_rollback_without_spec_tokens_crops_the_packed_state(fresh_dynamo):
    """Without spec_tokens every written token is committed at once. A rejected draft
    (prompt-lookup decoding crops the DynamicCache) rolls the packed state back with the
    cache (the handle's storage carries its state, cache_book), so assisted decoding gives
    plain greedy decoding's tokens; only a rollback into a tile already quantized is refused,
    with the crop's one-line error."""
    model = tiny_model("llama")
    _compiled(model)
    ids = torch.cat([tiny_prompt(1, length=25)] * 2, 1)
    plain = _generate(model, ids, 30)
    try:
        assisted = _generate(model, ids, 30, prompt_lookup_num_tokens=4)
    except ValueError as err:
        assert str(err).startswith("KVarN crop: batch row 0 would go back to"), err
    else:
        assert assisted.sequences.tolist() == plain.sequences.tolist()


def test_second_generate_new_prompt_lengths(fresh_dynamo):
    """One compiled model, prompts of 60, 45 and 75 tokens in turn (the later ones after a
    dynamic recompile): each equals a fresh eager KVarN run; no state leaks."""
    model = tiny_model("llama")
    backend = _compiled(model)
    for seed, length in ((1, 60), (2, 45), (3, 75)):
        ids = tiny_prompt(seed, length=length)
        _same(_generate(model, ids, 6), _kvarn_eager(model, ids, 6))
    assert not backend.report.unchanged
    assert backend.report.graphs <= 5, str(backend.report)


# ---------------------------------------------------------------- D. model families
def _t5():
    import transformers as tf

    cfg = tf.T5Config(vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                      initializer_factor=3.0)
    return build_tiny(tf.T5ForConditionalGeneration, cfg, "sdpa")


def test_encoder_decoder_compiled(fresh_dynamo):
    model = _t5()
    ids = tiny_prompt(1, length=20)
    fp = _generate(copy.deepcopy(model), ids, 6)
    backend = kvarn_backend(**PRESET, key_bits=8, value_bits=8, compiler="eager", max_cache_len=256)
    model.compile(backend=backend)
    got = _generate(model, ids, 6)
    assert got.sequences.tolist() == fp.sequences.tolist()
    cross = [s for s in backend.report.sites if "EncDecAttention" in s.name]
    assert cross and not any(s.rewritten for s in cross)
    assert any(s.rewritten for s in backend.report.sites if "SelfAttention" in s.name)


def _gemma2_softcap():
    import transformers as tf

    kw = tiny_config_kwargs()
    cfg = tf.Gemma2Config(**kw, layer_types=["full_attention"] * 2, attn_logit_softcapping=5.0,
                          final_logit_softcapping=None, query_pre_attn_scalar=32)
    return build_tiny(tf.Gemma2ForCausalLM, cfg, "eager", seed=3)


def test_softcap_left_unchanged_and_correct(fresh_dynamo):
    """Soft-capped logits (tanh) are not a recognized attention: nothing is rewritten, every
    layer's attention is reported, and the compiled model computes exactly the
    full-precision tokens."""
    model = _gemma2_softcap()
    ids = tiny_prompt(1)
    fp = _generate(copy.deepcopy(model), ids, 6)
    backend = _compiled(model)
    got = _generate(model, ids, 6)
    assert not backend.report.rewritten and not backend.states
    assert len(backend.report.unchanged) >= model.config.num_hidden_layers, str(backend.report)
    _same(got, fp, rtol=1e-5)


def test_softcap_kvarn_cache_fused_path_refuses():
    from kvarn_compile.hf import KVarNCache, use_kvarn_attention

    model = _gemma2_softcap()
    use_kvarn_attention(model)
    cache = KVarNCache(model.config, max_cache_len=128, **PRESET)
    with pytest.raises(NotImplementedError, match="soft-capping"), torch.no_grad():
        model(tiny_prompt(1), **cache_arg(model, cache))


def _bloom():
    import transformers as tf

    cfg = tf.BloomConfig(vocab_size=VOCAB, hidden_size=128, n_layer=2, n_head=4, initializer_range=0.15,
                         bos_token_id=1, eos_token_id=1, pad_token_id=0)
    return build_tiny(tf.BloomForCausalLM, cfg, "eager")


def test_alibi_bloom_left_unchanged_and_correct(fresh_dynamo):
    model = _bloom()
    ids = tiny_prompt(1)
    fp = _generate(copy.deepcopy(model), ids, 6)
    backend = _compiled(model)
    got = _generate(model, ids, 6)
    assert not backend.report.rewritten and not backend.states
    assert len(backend.report.unchanged) >= model.config.num_hidden_layers, str(backend.report)
    _same(got, fp, rtol=1e-5)


def test_alibi_falcon_compiled(fresh_dynamo):
    """Falcon with ALiBi passes the bias as an additive sdpa mask: rewritten; at 8 bits the
    tokens and logits equal full precision (a dropped or misaligned bias would not)."""
    import transformers as tf

    cfg = tf.FalconConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                          alibi=True, new_decoder_architecture=False, multi_query=True,
                          initializer_range=0.15, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    model = build_tiny(tf.FalconForCausalLM, cfg, "sdpa")
    ids = tiny_prompt(1)
    fp = _generate(copy.deepcopy(model), ids, 6)
    backend = kvarn_backend(**PRESET, key_bits=8, value_bits=8, compiler="eager", max_cache_len=256)
    model.compile(backend=backend)
    got = _generate(model, ids, 6)
    assert len(backend.report.rewritten) == 6 and not backend.report.unchanged, str(backend.report)
    _same(got, fp, rtol=2e-2)


def test_alibi_falcon_kvarn_cache_refuses():
    """KVarNCache is static-shaped; Falcon's ALiBi is built for the current key length only
    (transformers' StaticCache fails the same way, with a shape error): a clear refusal."""
    import transformers as tf
    from kvarn_compile.hf import KVarNCache

    cfg = tf.FalconConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                          alibi=True)
    with pytest.raises(NotImplementedError, match="FalconConfig with alibi=True .* kvarn_backend"):
        KVarNCache(cfg, max_cache_len=64, **PRESET)


def test_hybrid_lfm2_compiled(fresh_dynamo):
    """LFM2: short-convolution layers between attention layers. The attention layers are
    rewritten, the conv layers (and their conv-state cache) untouched; at 8 bits tokens and
    logits equal full precision."""
    import transformers as tf

    cfg = tf.Lfm2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2,
                        layer_types=["conv", "full_attention", "conv", "full_attention"],
                        initializer_range=0.15, bos_token_id=1, eos_token_id=1, pad_token_id=0,
                        max_position_embeddings=512)
    ids = tiny_prompt(1)
    model = build_tiny(tf.Lfm2ForCausalLM, cfg, "sdpa")
    fp = _generate(copy.deepcopy(model), ids, 6)
    backend = kvarn_backend(**PRESET, key_bits=8, value_bits=8, compiler="eager", max_cache_len=256)
    model.compile(backend=backend)
    got = _generate(model, ids, 6)
    names = {s.name for s in backend.report.sites}
    assert names == {"model.layers.1.self_attn", "model.layers.3.self_attn"}, str(backend.report)
    assert not backend.report.unchanged
    _same(got, fp, rtol=5e-3)


@pytest.mark.slow
def test_hybrid_jamba_compiled(fresh_dynamo):
    import transformers as tf

    cfg = tf.JambaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                         attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                         num_experts=2, mamba_d_state=8, mamba_expand=2, initializer_range=0.15,
                         bos_token_id=1, eos_token_id=1, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny(tf.JambaForCausalLM, cfg, "sdpa")
    ids = tiny_prompt(1)
    fp = _generate(copy.deepcopy(model), ids, 4)
    backend = kvarn_backend(**PRESET, key_bits=8, value_bits=8, compiler="eager", max_cache_len=256)
    model.compile(backend=backend)
    got = _generate(model, ids, 4)
    assert backend.report.rewritten
    _same(got, fp, rtol=5e-3)


def _vmap_step(q, k, v, pos, kc, vc, mask):
    keep = torch.vmap(lambda m: m & m)(mask)           # transformers' mask functions use vmap
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=keep, enable_gqa=True)


def test_rewrite_keeps_vmap_nesting_calls(fresh_dynamo):
    outs, refs, backend, _ = _run_static(_vmap_step, batch=1, hq=4, h=2, d=64, steps=[40, 1], cap=64)
    assert backend.report.rewritten
    for got, want in zip(outs, refs):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---------------------------------------------------------------- E. the compiler
def _write_then_break(q, k, v, pos, kc, vc, mask):
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    torch._dynamo.graph_break()
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)


def test_graph_break_inside_attention(fresh_dynamo):
    """Cache write and attention in different graphs: the attention is reported unchanged
    (its K/V are a graph input), the write left alone; the result is plain eager's."""
    backend = kvarn_backend(**PRESET, compiler="eager")
    run = torch.compile(_write_then_break, backend=backend)
    caches = [torch.zeros(1, 2, 64, 64) for _ in range(4)]
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    for p0, t in ((0, 40), (40, 1), (41, 1)):
        q = torch.randn(1, 4, t, 64)
        k, v = kv(1, 2, t, 64, seed=p0)
        pos, mask = torch.arange(p0, p0 + t), causal[None, None, p0:p0 + t]
        got = run(q, k, v, pos, caches[0], caches[1], mask)
        want = _write_then_break(q, k, v, pos, caches[2], caches[3], mask)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not backend.report.rewritten and backend.report.unchanged and not backend.states
    assert all("do not come from a recognized KV-cache update" in s.reason for s in backend.report.unchanged)
    assert torch.equal(caches[0], caches[2])                 # the model's cache still written


@pytest.mark.slow
def test_graph_break_inside_hf_attention(fresh_dynamo):
    """The same with a transformers model whose attention function breaks the graph."""
    import transformers.integrations.sdpa_attention as sdpa_mod
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def breaking(module, q, k, v, mask, **kw):
        torch._dynamo.graph_break()
        return sdpa_mod.sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("kvarn_test_breaking", breaking)
    ALL_MASK_ATTENTION_FUNCTIONS.register("kvarn_test_breaking", sdpa_mask)
    model = tiny_model("llama")
    model.set_attn_implementation("kvarn_test_breaking")
    ids = tiny_prompt(1)
    fp = _generate(copy.deepcopy(model), ids, 4)
    backend = _compiled(model)
    got = _generate(model, ids, 4)
    assert not backend.report.rewritten and backend.report.unchanged and not backend.states
    _same(got, fp, rtol=1e-5)


def test_dynamic_true_is_reported(fresh_dynamo):
    """torch.compile(dynamic=True): Dynamo turns the attention scale (and batch) symbolic;
    every site is reported unchanged with the reason and the model runs in full precision."""
    model = tiny_model("llama")
    ids = tiny_prompt(1)
    fp = _generate(copy.deepcopy(model), ids, 6)
    backend = kvarn_backend(**PRESET, compiler="eager", max_cache_len=256)
    model.compile(backend=backend, dynamic=True)
    got = _generate(model, ids, 6)
    assert not backend.report.rewritten and not backend.states
    assert len(backend.report.unchanged) >= 2
    assert all(s.reason for s in backend.report.unchanged), str(backend.report)
    _same(got, fp, rtol=1e-5)


def test_fullgraph_generate(fresh_dynamo):
    model = tiny_model("llama")
    ids = tiny_prompt(1)
    want = _kvarn_eager(model, ids, 6)
    backend = kvarn_backend(**PRESET, compiler="eager", max_cache_len=256)
    model.compile(backend=backend, fullgraph=True)
    _same(_generate(model, ids, 6), want)
    assert len(backend.report.rewritten) == 6 and not backend.report.unchanged


def test_long_generate_does_not_recompile(fresh_dynamo):
    """200 decode steps crossing five tile boundaries: prefill, first decode and one dynamic
    decode graph, nothing per step; tokens equal the eager KVarN run."""
    model = tiny_model("llama")
    ids = tiny_prompt(1, length=20)
    want = _kvarn_eager(model, ids, 200)
    backend = _compiled(model)
    torch._dynamo.utils.counters.clear()
    got = _generate(model, ids, 200)
    assert backend.report.graphs == 3, str(backend.report)
    assert all(int(s.n_tiles) == 5 for s in backend.states.values())
    assert got.sequences.tolist() == want.sequences.tolist()


def _in_threads(work, n: int) -> None:
    """Run ``work(i)`` for i in range(n) in n threads at once; re-raise the first error."""
    errors: list[BaseException] = []

    def guarded(i):
        try:
            work(i)
        except BaseException as err:      # surfaced below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_two_models_in_two_threads(fresh_dynamo):
    """Two models, each with its own backend, compiled and generating concurrently in two
    threads: each equals its own eager KVarN run."""
    models = [tiny_model("llama", seed=0), tiny_model("llama", seed=1)]
    prompts = [tiny_prompt(1), tiny_prompt(2)]
    wants = [_kvarn_eager(m, p, 8) for m, p in zip(models, prompts)]
    backends = [_compiled(m) for m in models]
    results = [None, None]

    def work(i):
        for _ in range(2):
            results[i] = _generate(models[i], prompts[i], 8)

    _in_threads(work, 2)
    for got, want, backend in zip(results, wants, backends):
        _same(got, want)
        assert not backend.report.unchanged


def test_state_registry_is_thread_safe():
    """The keyed registry of the Inductor pre-grad pass: threads racing to allocate the same
    site get one state; two stores (two models) never share a state; a closed store's key
    fails with a clear error."""
    from kvarn_compile.ops.keyed import StateStore, resolve

    cfg = get_config(**PRESET)
    stores = [StateStore(cfg), StateStore(cfg)]
    barrier = threading.Barrier(8)
    got: list = []

    def work(i):
        barrier.wait()
        store = stores[i % 2]
        got.append((i % 2, store.for_append("model.layers.0.self_attn", torch.zeros(2, 2, 1, 64), 128)))

    _in_threads(work, 8)
    for s_index, store in enumerate(stores):
        states = {id(state) for i, state in got if i == s_index}
        assert len(states) == 1 and len(store.states) == 1
    assert stores[0].states[("model.layers.0.self_attn", 2)] is not stores[1].states[("model.layers.0.self_attn", 2)]
    key = stores[1].key("model.layers.0.self_attn")
    assert resolve(key) == (stores[1], "model.layers.0.self_attn")
    stores[1].close()
    with pytest.raises(RuntimeError, match="no packed-state store .* was closed"):
        resolve(key)
    stores[0].close()


def _inductor_code_flips(kv_pass, eager_cache) -> int:
    """Packed code bytes where an Inductor-compiled run froze its tiles differently from the
    eager run on ``eager_cache`` (a KVarNCache); asserts that nothing else differs beyond
    float noise. Inductor reorders fp32 sums, so its K/V differ from eager by rounding: a
    value on a rounding boundary can land on the neighbouring code (a legitimate one-step
    difference that moves later logits by up to a few percent of the logit scale), and a
    scale or zero can round to the neighbouring fp16 value. Asserted: the same tiles
    frozen, every scale and zero within two fp16 steps of the eager one, and at most a
    handful (8) of differing code bytes over all layers."""
    from kvarn_compile.state import unpack

    assert kv_pass.states, "the pass holds no packed state"
    flips = 0
    for (name, _batch), st in kv_pass.states.items():
        layer = eager_cache.layers[int(re.search(r"layers\.(\d+)\.", name).group(1))]
        got, want = unpack(st.buffers), unpack(layer.state.buffers)
        assert torch.equal(got.n_tiles, want.n_tiles), f"{name}: different tiles frozen"
        n = int(got.n_tiles.max())
        for kind in "kv":
            codes, *scales = got.tiles(kind).core
            want_codes, *want_scales = want.tiles(kind).core
            flips += int((codes[:, :, :n] != want_codes[:, :, :n]).sum())
            for a, b in zip(scales, want_scales):           # row scale, row zero, col scale
                a, b = a[:, :, :n].float(), b[:, :, :n].float()
                torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3 * b.abs().max().item(),
                                           msg=lambda m: f"{name} {kind} scales: {m}")
    assert flips <= 8, f"{flips} packed code bytes differ from the eager KVarN cache"
    return flips


@pytest.mark.slow
@pytest.mark.skipif(not cpu_inductor_compiles_dynamic_llama(),
                    reason="this torch's C++ Inductor cannot compile the model's dynamic-shape "
                    "graphs itself")
def test_two_models_inductor_pass_in_two_threads(fresh_dynamo):
    """kvarn_compile.inductor_pass: two models, a pass object each, compiled by Inductor and
    generating in two threads at once; each equals its eager KVarN run: the same tokens, and
    logits within Inductor's float noise (1e-3 of the logit scale), or within FLIP_RTOL where
    that pass's packed codes differ from its eager cache's in a handful of bytes (see
    :func:`_inductor_code_flips`)."""
    import kvarn_compile

    models = [tiny_model("llama", seed=0), tiny_model("llama", seed=1)]
    prompts = [tiny_prompt(1), tiny_prompt(2)]
    wants = [_kvarn_eager(m, p, 6) for m, p in zip(models, prompts)]
    passes = [kvarn_compile.inductor_pass(**PRESET, max_cache_len=256) for _ in models]
    for m, kv_pass in zip(models, passes):
        m.compile(options={"pre_grad_custom_pass": kv_pass})
    results = [None, None]

    def work(i):
        results[i] = _generate(models[i], prompts[i], 6)

    _in_threads(work, 2)
    for got, want, kv_pass in zip(results, wants, passes):
        flips = _inductor_code_flips(kv_pass, output_cache(want))   # _kvarn_eager's cache
        _same(got, want, rtol=FLIP_RTOL if flips else INDUCTOR_RTOL)
        assert kv_pass.report.rewritten and not kv_pass.report.unchanged
        kv_pass.close()


def test_one_backend_two_models_interleaved(fresh_dynamo):
    import transformers as tf

    models = [tiny_model("llama", seed=0), tiny_model("llama", seed=1)]
    prompts = [tiny_prompt(1), tiny_prompt(2)]
    wants = [_kvarn_eager(m, p, 6).sequences[0, 60:].tolist() for m, p in zip(models, prompts)]
    backend = kvarn_backend(**PRESET, compiler="eager", max_cache_len=256)
    for m in models:
        m.compile(backend=backend)
    caches = [tf.DynamicCache(config=m.config) for m in models]
    with torch.no_grad():
        logits = [m(p, **cache_arg(m, c)).logits[:, -1:]
                  for m, p, c in zip(models, prompts, caches)]
        tokens = [[], []]
        for _ in range(6):
            for i, m in enumerate(models):
                nxt = logits[i].argmax(-1)
                tokens[i].append(nxt.item())
                logits[i] = m(nxt, **cache_arg(m, caches[i])).logits[:, -1:]
    assert tokens == wants


_INDUCTOR_SCRIPT = textwrap.dedent('''
    import json, sys, torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters
    from kvarn_compile import get_config, kvarn_backend
    from kvarn_compile.ops import append as append_ref
    from kvarn_compile.state import allocate_layer

    torch.set_num_threads(1)

    def step(q, k, v, pos, kc, vc, mask):
        kc.index_copy_(2, pos, k)
        vc.index_copy_(2, pos, v)
        return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)

    cfg = get_config("k4v2", group_size=32)
    backend = kvarn_backend(cfg, compiler="inductor")
    run = torch.compile(step, backend=backend, mode=sys.argv[2] if len(sys.argv) > 2 else None)
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.zeros(1, 2, 96, 64), torch.zeros(1, 2, 96, 64)
    ref = allocate_layer(cfg, batch=1, kv_heads=2, head_dim=64, max_len=96, dtype=torch.float32)
    causal = torch.ones(96, 96, dtype=torch.bool).tril()
    p0, outs, diffs = 0, [], []
    for t in (70, 1, 1):
        q = torch.randn(1, 4, t, 64, generator=g)
        k, v = torch.randn(1, 2, t, 64, generator=g), torch.randn(1, 2, t, 64, generator=g)
        mask = causal[None, None, p0:p0 + t]
        out = run(q, k, v, torch.arange(p0, p0 + t), kc, vc, mask)
        append_ref.append_(ref.buffers, k, v, torch.full((1,), p0))
        want = torch.ops.kvarn.attention(q, ref.buffers, mask, 64 ** -0.5, True, 0)
        diffs.append((out - want).abs().max().item())
        outs.append(out)
        p0 += t
    torch.save(outs, sys.argv[1])
    print(json.dumps({"diffs": diffs, "rewritten": len(backend.report.rewritten),
                      "unchanged": len(backend.report.unchanged), "notes": backend.report.notes,
                      "hits": counters["inductor"]["fxgraph_cache_hit"],
                      "misses": counters["inductor"]["fxgraph_cache_miss"]}))
''')


def _inductor_run(tmp_path, name, cache_dir, *extra):
    import json

    script = tmp_path / "inductor_step.py"
    script.write_text(_INDUCTOR_SCRIPT)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_CACHE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / f"{name}.pt"), *extra],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["rewritten"] == 2 and result["unchanged"] == 0, result
    assert max(result["diffs"]) < 1e-4, result
    return result, torch.load(tmp_path / f"{name}.pt")


@pytest.mark.slow
def test_inductor_disk_cache_cold_and_warm(tmp_path):
    """Inductor's FX-graph and AOT caches on disk: a cold process compiles (misses) and a warm
    one loads the rewritten graphs (hits); both equal the eager kvarn ops, bit-identical."""
    cold, outs_cold = _inductor_run(tmp_path, "cold", tmp_path / "cache")
    warm, outs_warm = _inductor_run(tmp_path, "warm", tmp_path / "cache")
    assert cold["misses"] >= 2 and cold["hits"] == 0, cold
    assert warm["hits"] >= 2, warm
    assert all(torch.equal(a, b) for a, b in zip(outs_cold, outs_warm))


@pytest.mark.slow
def test_reduce_overhead_inductor(tmp_path):
    """mode="reduce-overhead" on CPU: the CUDA-graph option is dropped (noted in the report)
    and the rewritten graphs compile and run with Inductor, equal to the eager kvarn ops."""
    result, _ = _inductor_run(tmp_path, "ro", tmp_path / "cache", "reduce-overhead")
    assert any("reduce-overhead" in n and "ignored on CPU" in n for n in result["notes"]), result


def test_nested_compile_region_is_reported():
    """Attention inside a ``torch.compiler.nested_compile_region`` body (an ``invoke_subgraph``
    call) is not rewritten: each call is reported as left unchanged with that reason, and the
    model computes what it computes uncompiled (its cache stays in full precision)."""
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(64, n) for n in (64, 32, 32))

        @torch.compiler.nested_compile_region
        def forward(self, x, past_k, past_v):
            b, t, _ = x.shape
            q = self.q(x).view(b, t, 4, 16).transpose(1, 2)
            k = torch.cat([past_k, self.k(x).view(b, t, 2, 16).transpose(1, 2)], dim=2)
            v = torch.cat([past_v, self.v(x).view(b, t, 2, 16).transpose(1, 2)], dim=2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return y.transpose(1, 2).reshape(b, t, 64), k, v

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Attn(), Attn()])

        def forward(self, x, past):
            kv = []
            for layer, (pk, pv) in zip(self.layers, past):
                x, k, v = layer(x, pk, pv)
                kv.append((k, v))
            return x, kv

    torch.manual_seed(0)
    model = Model().eval()
    x = torch.randn(1, 40, 64)
    past = [(torch.zeros(1, 2, 0, 16), torch.zeros(1, 2, 0, 16)) for _ in range(2)]
    backend = kvarn_backend("k4v2", group_size=32, compiler="eager", max_cache_len=128)
    torch._dynamo.reset()
    with torch.no_grad():
        want, _ = model(x, past)
        got, _ = torch.compile(model, backend=backend)(x, past)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want)
    sites = backend.report.sites
    assert not backend.report.rewritten and len(sites) == 2, backend.report
    assert all("nested_compile_region" in s.reason and "full precision" in s.reason for s in sites)
    assert {s.name.split(" ")[0] for s in sites} == {"layers.0", "layers.1"}, sites


def _handle_flow():
    """A tiny Llama compiled with kvarn_backend over transformers' DynamicCache (cat caches:
    the compiled model hands back row-tagged handles), and its uncompiled twin."""
    import transformers as tf

    model = tiny_model("llama")
    twin = copy.deepcopy(model)
    backend = kvarn_backend("k4v2", group_size=32, compiler="eager")
    model.forward = torch.compile(model.forward, backend=backend)
    return tf, model, twin, backend


def test_batch_select_indices_on_handles_continues_the_selected_packed_rows(fresh_dynamo):
    """DynamicCache.batch_select_indices on the handles of a batch-2 sequence: the next step
    continues the selected row's packed state, exactly as a batch-1 run of that row. (The
    selected handle holds the tag 1 in a batch of 1; it was once taken for real keys and
    values and packed, with logits off by more than their own size and no error.)"""
    tf, model, twin, _ = _handle_flow()
    ids = tiny_prompt(45, batch=2, length=66)
    one = tiny_prompt(47, length=1)
    cache = tf.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **cache_arg(model, cache))
        cache.batch_select_indices(torch.tensor([1]))
        got = model(one, **cache_arg(model, cache)).logits[0, -1]
    torch._dynamo.reset()
    tf, direct, _, backend = _handle_flow()
    direct.load_state_dict(twin.state_dict())
    cache = tf.DynamicCache(config=direct.config)
    with torch.no_grad():
        direct(ids[1:], **cache_arg(direct, cache))
        want = direct(one, **cache_arg(direct, cache)).logits[0, -1]
    assert torch.equal(got, want)


def test_batch_repeat_interleave_on_handles_continues_the_repeated_packed_rows(fresh_dynamo):
    """batch_repeat_interleave, then a batch-2 call: Dynamo traces it again (the batch size
    changed) with a size it made symbolic and then fixed; the pass takes it as the number it
    is, so every layer continues the repeated packed rows: each row equals a batch-1 run.
    (That layer was once kept in full precision and the call refused.)"""
    tf, model, twin, backend = _handle_flow()
    ids = tiny_prompt(45, length=66)
    two = tiny_prompt(46, batch=2, length=1)
    cache = tf.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **cache_arg(model, cache))
        cache.batch_repeat_interleave(2)
        got = model(two, **cache_arg(model, cache)).logits[:, -1]
    assert not backend.report.unchanged, str(backend.report)
    torch._dynamo.reset()
    tf, direct, _, _ = _handle_flow()
    direct.load_state_dict(twin.state_dict())
    for row in range(2):
        cache = tf.DynamicCache(config=direct.config)
        with torch.no_grad():
            direct(ids, **cache_arg(direct, cache))
            want = direct(two[row:row + 1], **cache_arg(direct, cache)).logits[0, -1]
        torch.testing.assert_close(got[row], want, rtol=1e-4, atol=1e-4)


def _cat_step_capped(q, k, v, past_k, past_v, cap: bool):
    """A cat-cache attention step; ``cap``: logit soft-capping (a form the pass leaves
    unchanged, so that graph reads the past in full precision)."""
    keys, values = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
    if not cap:
        return F.scaled_dot_product_attention(q, keys, values), keys, values
    s = torch.tanh(q @ keys.transpose(2, 3) / 5.0) * 5.0
    return F.softmax(s, dim=-1) @ values, keys, values


def test_a_handle_read_in_full_precision_gets_its_rows_or_is_refused(fresh_dynamo):
    """A handle, and one reordered in plain torch (it names rows of the chain it came from),
    read by a graph the pass leaves unchanged: each is passed dequantized, the reordered one
    as the rows it names. Once a compiled call reordered that chain's state, the old reordered
    handle no longer describes it: reading it stops with a one-line error (it would read the
    tags, or the wrong rows, as keys and values)."""
    backend = kvarn_backend("k4v2", group_size=32, compiler="eager")
    step = torch.compile(_cat_step_capped, backend=backend)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 40, 32, generator=g) for _ in range(3))
    empty = torch.zeros(2, 2, 0, 32)
    _, hk, hv = step(q, k, v, empty, empty, False)
    one = [torch.randn(2, 2, 1, 32, generator=g) for _ in range(3)]
    out = step(*one, hk, hv, True)[0]                   # the handle: passed dequantized
    assert out.isfinite().all() and any("passed dequantized" in n for n in backend.report.notes)
    swap = torch.tensor([1, 0])
    flipped = [h.index_select(0, swap) for h in (hk, hv)]
    swapped = step(*[x.index_select(0, swap) for x in one], *flipped, True)[0]
    torch.testing.assert_close(swapped, out.index_select(0, swap), rtol=0, atol=0)
    step(*one, *flipped, False)                         # compiled: the state's rows reordered
    with pytest.raises(RuntimeError, match=r"^kvarn_backend: graph \d+ reads in full precision "
                                           r".*holds the batch-row tags of a packed cache"):
        step(*one, *flipped, True)
