"""Tiny random-weight models: transformers families, the oracle of their eager cache, and
the examples of a source checkout (gpt-fast, nanoGPT, the Llama reference)."""

from __future__ import annotations

import torch

TINY_PRESET = dict(preset="k4v2", group_size=32)
TINY_MAX_LEN = 256     # cache capacity (static caches, KVarNCache and the backend's cat caches)
TINY_PROMPT = 60
TINY_NEW = 6           # the 5th forward appends position 63: tile 32..63 is frozen
TINY_NEW_SHORT = 5     # second sequence / sampling: still crosses the freeze
TINY_WINDOW = 16       # sliding window of the "-swa" configs (shorter than the prompt)
TINY_VOCAB = 128
#: logits of a compiled run against the eager KVarN model, relative to the largest |logit| of
#: the step: eager graphs; Inductor (reorders fp32 sums, no packed element differs); and when
#: a K/V value next to a rounding boundary landed on the neighbouring code as a tile was
#: frozen (see :func:`flipped_codes`)
EAGER_RTOL = 1e-4
INDUCTOR_RTOL = 1e-3
FLIP_RTOL = 5e-2


def tiny_config_kwargs(**extra) -> dict:
    """The config keywords of the tiny Llama-like models (``extra`` adds or overrides)."""
    return dict(vocab_size=TINY_VOCAB, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=512, initializer_range=0.15, bos_token_id=1,
                eos_token_id=1, pad_token_id=0) | extra


def _tiny_families() -> dict:
    import transformers as tf

    def phi3():
        kw = tiny_config_kwargs()
        kw.pop("head_dim")                     # Phi-3 derives it: 192 / 6 = 32
        return tf.Phi3Config(**kw)

    return {
        # name: (config factory, model class)
        "llama": (lambda: tf.LlamaConfig(**tiny_config_kwargs()), tf.LlamaForCausalLM),
        "qwen2": (lambda: tf.Qwen2Config(**tiny_config_kwargs()), tf.Qwen2ForCausalLM),     # qkv bias
        "qwen3": (lambda: tf.Qwen3Config(**tiny_config_kwargs()), tf.Qwen3ForCausalLM),     # q/k norm
        "mistral": (lambda: tf.MistralConfig(**tiny_config_kwargs(sliding_window=None)),
                    tf.MistralForCausalLM),
        "gpt2": (lambda: tf.GPT2Config(vocab_size=TINY_VOCAB, n_embd=128, n_layer=2, n_head=4,  # MHA
                                       n_positions=512, initializer_range=0.15, bos_token_id=1,
                                       eos_token_id=1, pad_token_id=0), tf.GPT2LMHeadModel),
        "phi3": (phi3, tf.Phi3ForCausalLM),                                                  # fused qkv
        # keys and values of different head dims (K 48, V 32), a max-shifted eager softmax;
        # full-attention layers only (its sliding layers add attention sinks)
        "mimo": (lambda: tf.MiMoV2FlashConfig(**tiny_config_kwargs(
            head_dim=48, v_head_dim=32, layer_types=["full_attention"] * 2,
            mlp_layer_types=["dense"] * 2)), tf.MiMoV2FlashForCausalLM),
        # layer 0 full attention, layer 1 sliding window (max_window_layers=1)
        "qwen2-swa": (lambda: tf.Qwen2Config(**tiny_config_kwargs(
            use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=1)),
            tf.Qwen2ForCausalLM),
    }


#: the families :func:`tiny_model` builds
TINY_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gpt2", "phi3", "mimo", "qwen2-swa")


def family_attentions(family: str) -> tuple[str, ...]:
    """The attention implementations transformers offers for ``family`` (MiMo-V2-Flash: eager
    only, for its attention sinks)."""
    return ("eager",) if family == "mimo" else ("sdpa", "eager")


def build_tiny(cls, config, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """``cls(config)`` in eval mode with attention ``attn``, weights from ``seed``, and a
    generation config that always generates ``max_new_tokens`` (no EOS) and pads with 0."""
    import warnings

    torch.manual_seed(seed)
    config._attn_implementation = attn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def tiny_model(family: str, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """The tiny model of ``family`` (one of :data:`TINY_FAMILIES`)."""
    make_config, cls = _tiny_families()[family]
    return build_tiny(cls, make_config(), attn, seed)


def sliding_layers(model) -> set[int]:
    """The indices of a transformers model's sliding-window layers."""
    types = getattr(model.config, "layer_types", None) or []
    return {i for i, t in enumerate(types) if t == "sliding_attention"}


def tiny_static_cache(model, batch: int):
    """An early-initialized ``StaticCache`` of :data:`TINY_MAX_LEN` tokens."""
    from kvarn_compile.hf import static_cache_for

    return static_cache_for(model, TINY_MAX_LEN, batch=batch)


def tiny_prompt(seed: int, batch: int = 1, length: int = TINY_PROMPT) -> torch.Tensor:
    """Random token ids [batch, length] in [2, vocab) from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, TINY_VOCAB, (batch, length), generator=g)


def cache_arg(model, cache) -> dict:
    """``cache`` as the keyword ``model`` takes it: ``model(ids, **cache_arg(model, cache))``
    (see :func:`kvarn_compile.hf.cache_kwarg`)."""
    from kvarn_compile.hf import cache_kwarg

    return {cache_kwarg(model): cache}


def cpu_inductor_compiles_dynamic_llama() -> bool:
    """False on torch < 2.13, whose C++ Inductor cannot compile the tiny Llama's dynamic-shape
    decode graphs by itself (plain ``torch.compile``, no kvarn: "'tmp2' was not declared in
    this scope" in a generated kernel; seen with torch 2.11)."""
    from kvarn_compile._torch_compat import _torch_minor

    return _torch_minor() >= (2, 13)


def static_cache_crops() -> bool:
    """Whether this transformers' static cache can be cropped (``StaticLayer.crop``, from
    5.24 on; before it, ``StaticCache.crop`` raises AttributeError in transformers itself)."""
    from transformers.cache_utils import StaticLayer

    return hasattr(StaticLayer, "crop")


def tiny_generate(model, ids, *, cache=None, mask=None, sample_seed=None, new=TINY_NEW):
    """``model.generate`` of ``new`` tokens with per-step logits: greedy, or sampling from
    ``sample_seed`` (top_k=0, temperature 1)."""
    import warnings

    kw = dict(max_new_tokens=new, output_logits=True, return_dict_in_generate=True)
    if cache is not None:
        kw.update(cache_arg(model, cache))
    if mask is not None:
        kw["attention_mask"] = mask
    if sample_seed is None:
        kw["do_sample"] = False
    else:
        kw.update(do_sample=True, top_k=0, temperature=1.0)
        torch.manual_seed(sample_seed)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, **kw)


class EagerOracle:
    """The eager model on a KVarN cache: ``use_kvarn_attention`` + ``KVarNCache`` with
    :data:`TINY_PRESET` and :data:`TINY_MAX_LEN`.

    For models with sliding-window layers (which the backend leaves in full precision, and
    ``KVarNCache`` refuses) the cache is mixed instead: a ``KVarNLayer`` handing back a
    dequantized K/V for every full-attention layer, transformers' own sliding-window layer
    for the others, and the model keeps its attention implementation.

    Runs are memoized: with the ``kvarn`` attention the result does not depend on the
    compiled side's cache kind or attention implementation, so the compiled variants of a
    family share one eager run per prompt.
    """

    _memo: dict = {}

    def __init__(self, fp_model, family: str):
        import copy

        from kvarn_compile.hf import use_kvarn_attention

        self.model = copy.deepcopy(fp_model)
        self.sliding = sliding_layers(self.model)
        self.key = (family, self.model.config._attn_implementation if self.sliding else "kvarn")
        if not self.sliding:
            use_kvarn_attention(self.model)

    def cache(self):
        from transformers.cache_utils import Cache, StaticSlidingWindowLayer

        from kvarn_compile.config import get_config
        from kvarn_compile.hf import KVarNCache, KVarNLayer

        if not self.sliding:
            return KVarNCache(self.model.config, max_cache_len=TINY_MAX_LEN, **TINY_PRESET)
        kcfg = get_config(**TINY_PRESET)
        layers = [StaticSlidingWindowLayer(TINY_MAX_LEN, TINY_WINDOW) if i in self.sliding
                  else KVarNLayer(kcfg, TINY_MAX_LEN, name=f"layers.{i}", fused=False)
                  for i in range(self.model.config.num_hidden_layers)]
        return Cache(layers=layers)

    def __call__(self, ids, mask=None, **kw):
        key = (*self.key, ids.numpy().tobytes(), tuple(ids.shape),
               None if mask is None else mask.numpy().tobytes(), tuple(sorted(kw.items())))
        if key not in self._memo:
            cache = self.cache()
            self._memo[key] = (tiny_generate(self.model, ids, cache=cache, mask=mask, **kw), cache)
        out, self.last_cache = self._memo[key]
        return out


def flipped_codes(frontend, oracle_cache) -> int:
    """Packed-state elements (code bytes and scales) where a compiled run of ``frontend`` (a
    ``kvarn_backend`` or ``inductor_pass`` object: its ``states``) froze its tiles
    differently from the eager oracle's cache. Inductor reorders fp32 sums, and a growing state's
    sink and tail have other lengths than the oracle's (so other fp32 sums too), so a K/V
    value that sits on a rounding boundary can land on the neighbouring code: a legitimate
    difference of one code step, which moves later logits by up to a few percent of the
    logit scale. Anything but such isolated flips is a bug (asserted here)."""
    import re

    from kvarn_compile.state import unpack

    total = 0
    for (name, _batch), st in frontend.states.items():
        layer = oracle_cache.layers[int(re.search(r"(?:layers|h)\.(\d+)\.", name).group(1))]
        if not hasattr(layer, "state"):
            continue
        a, b = unpack(st.buffers), unpack(layer.state.buffers)
        assert torch.equal(a.n_tiles, b.n_tiles), f"{name}: different tiles frozen"
        n = int(a.n_tiles.max())
        for kind in "kv":
            for got, want in zip(a.tiles(kind).core, b.tiles(kind).core):
                diff = got[:, :, :n] != want[:, :, :n]
                total += int(diff.sum())
        assert total <= 8, f"{name}: {total} packed elements differ from the eager oracle"
    return total


def assert_same_generation(got, want, rtol: float, what: str) -> float:
    """Same tokens, and every step's logits within ``rtol`` of that step's logit scale;
    returns the largest relative logit difference."""
    assert got.sequences.tolist() == want.sequences.tolist(), f"{what}: tokens differ"
    worst = 0.0
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        err = (a - b).abs().max().item() / b.abs().max().item()
        assert err <= rtol, f"{what}: step {step} logits differ by {err:.2e} (relative) > {rtol}"
        worst = max(worst, err)
    return worst


def check_sites(frontend, sliding: set[int]) -> None:
    """Every attention site in ``frontend.report`` rewritten, except the sliding-window
    layers ``sliding``, which say why."""
    import re

    report = frontend.report
    assert report.sites, "the backend saw no attention"
    for site in report.sites:
        layer = int(re.search(r"(?:layers|h)\.(\d+)\.", site.name).group(1))
        if layer in sliding:
            assert not site.rewritten, f"sliding-window layer rewritten: {site.line()}"
            assert site.reason.startswith("sliding-window attention: its cache "), site.line()
            assert "keeps its full-precision cache" in site.reason
        else:
            assert site.rewritten, f"not rewritten: {site.line()}"
    text = str(report)
    assert text.count("[rewritten]") + text.count("[unchanged]") == len(report.sites)
    for site in report.sites:
        assert site.line() in text


def fp_prefill_then_kvarn(model, ids, new: int):
    """Oracle of ``generate(compile_config=...)``: transformers runs the prefill eagerly on
    its full-precision cache (never compiled), the compiled decoding steps then take the
    prompt's K/V over into the packed cache. Here: an fp prefill, its K/V appended to a
    ``KVarNCache``, then greedy eager decoding with the ``kvarn`` attention.
    Returns (token ids [B, prompt + new], per-step logits)."""
    import copy
    import warnings

    from transformers import DynamicCache

    from kvarn_compile.hf import KVarNCache, output_cache, use_kvarn_attention

    fp = copy.deepcopy(model)
    kv = copy.deepcopy(model)
    use_kvarn_attention(kv)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fp(ids, use_cache=True, **cache_arg(fp, DynamicCache(config=fp.config)))
        cache = KVarNCache(kv.config, max_cache_len=TINY_MAX_LEN, **TINY_PRESET)
        for layer, fp_layer in zip(cache.layers, output_cache(out).layers):
            layer.update(fp_layer.keys, fp_layer.values)
        logits, tokens = [out.logits[:, -1]], ids
        for _ in range(new - 1):
            tokens = torch.cat([tokens, logits[-1].argmax(-1, keepdim=True)], 1)
            pos = tokens.shape[1] - 1
            step = kv(tokens[:, -1:], cache_position=torch.tensor([pos]), **cache_arg(kv, cache))
            logits.append(step.logits[:, -1])
        tokens = torch.cat([tokens, logits[-1].argmax(-1, keepdim=True)], 1)
    return tokens, logits


# ---------------------------------------------------------------------------- examples
def examples_dir():
    """The ``examples`` folder of the source checkout this package runs from."""
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "examples"
    if not path.is_dir():
        raise FileNotFoundError(f"kvarn_compile.testing: expected the examples of a source "
                                f"checkout at {path}; run the tests from a clone of the repository.")
    return path


def load_example(name: str):
    """Import ``examples/<name>.py`` of the source checkout as a module."""
    import importlib.util
    import sys

    path = examples_dir() / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"kvarn_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def _sharpened(model):
    for p in model.parameters():          # sharper logits than the default init
        p.data.mul_(3.0)
    return model


def gpt_fast_model():
    """(the gpt-fast example module, its tiny Transformer with caches for batch 1 and
    :data:`TINY_MAX_LEN` tokens)."""
    gf = load_example("gpt_fast_model")
    torch.manual_seed(0)
    model = _sharpened(gf.Transformer(gf.ModelArgs(vocab_size=TINY_VOCAB)).eval())
    model.setup_caches(max_batch_size=1, max_seq_length=TINY_MAX_LEN)
    return gf, model


def nanogpt_model():
    """(the nanoGPT example module, its tiny GPT with a block of :data:`TINY_MAX_LEN`)."""
    ng = load_example("nanogpt_model")
    torch.manual_seed(0)
    return ng, _sharpened(ng.GPT(ng.GPTConfig(vocab_size=TINY_VOCAB, block_size=TINY_MAX_LEN)).eval())


def llama_ref_model():
    """(the Llama reference example module, its tiny Transformer of :data:`TINY_MAX_LEN`)."""
    lm = load_example("llama_ref_model")
    torch.manual_seed(0)
    return lm, _sharpened(lm.Transformer(lm.ModelArgs(vocab_size=TINY_VOCAB,
                                                      max_seq_len=TINY_MAX_LEN)).eval())


#: example name -> builder of (module, model)
EXAMPLES = {"gpt_fast": gpt_fast_model, "nanogpt": nanogpt_model, "llama_ref": llama_ref_model}


def model_cache_buffers(model) -> list[torch.Tensor]:
    """An example model's own K/V cache buffers."""
    return [b for name, b in model.named_buffers()
            if name.endswith(("k_cache", "v_cache", "cache_k", "cache_v"))]
