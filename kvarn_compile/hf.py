"""Hugging Face transformers integration: a ``Cache`` that holds only KVarN-packed state.

    cache = KVarNCache(model.config, max_cache_len=4096, preset="k4v2")
    out = model.generate(ids, cache=cache, max_new_tokens=256)   # before transformers 5.24: past_key_values

Each layer keeps a :class:`~kvarn_compile.state.LayerState` (sink, packed tiles, tail);
no full-precision K/V cache is ever allocated. What ``update`` hands back to the model's
attention depends on the attention implementation:

* ``attn_implementation="kvarn"`` (see :func:`use_kvarn_attention`): zero-storage
  placeholder tensors; the registered ``kvarn`` attention function runs the fused
  ``torch.ops.kvarn.attention`` over the packed state. Nothing full-precision is built.
* any other implementation (sdpa, eager): a transient dequantized K/V of this one layer,
  so that unmodified models still produce correct results. It is freed after the layer;
  a one-time warning says how to avoid it. Under ``kvarn_backend`` the compiler pass
  rewrites the attention to the fused op instead.

Keys and values may have different head dims (MiMo-V2-Flash: 192 and 128). Multi-head latent
attention as transformers' DeepSeek-V2/V3 family caches it (the normed latent as "keys", the
shared RoPE key as "values", one head) is packed as a latent cache: the latent at the preset's
key bits, the RoPE key at :data:`LATENT_ROPE_BITS`. Its model up-projects what the cache hands
back before any attention, so ``update`` always returns the latents dequantized (transient,
for this layer's step; each step dequantizes the whole cache, as the sdpa hand-off does), and
``use_kvarn_attention`` refuses such models. (``kvarn_backend`` instead rewrites their
attention into ``kvarn::latent_attention`` over the packed latent, the up-projection absorbed
into the queries and the output: no dequantized copy; :func:`static_cache_for` allocates
such a model's StaticCache with the latent shapes.)
"""

from __future__ import annotations

import logging
from typing import Any
import warnings

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvarn_compile.autotune.knobs import Decision, QuantKnobs, select_quant_knobs
from kvarn_compile.autotune.tuning import KnobTuning
from kvarn_compile.config import (
    LATENT_ROPE_BITS, KVarNConfig, KVarNOptions, checked_max_cache_len, get_config, options_from,
)
from kvarn_compile.ops import library as ops
from kvarn_compile.ops.append import check_method, crop_, materialize
from kvarn_compile.state import LayerState, allocate_layer

__all__ = ["KVarNCache", "KVarNLayer", "use_kvarn_attention", "kvarn_attention_forward",
           "static_cache_for", "kv_geometry", "TunedKVarNCache", "TunedKVarNLayer", "cache_kwarg",
           "output_cache"]

log = logging.getLogger(__name__)

_STATE_ATTR = "_kvarn_layer_state"


def _handle(like: torch.Tensor, length: int, state: LayerState) -> torch.Tensor:
    """A [B, H, length, D] tensor with one element of storage that names its layer state."""
    b, h, _, d = like.shape
    out = torch.zeros((), dtype=like.dtype, device=like.device).expand(b, h, length, d)
    setattr(out, _STATE_ATTR, state)
    return out




def _text_config(config):
    """The decoder's config of a (possibly multimodal) transformers config."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _mla_latents(model_config) -> tuple[int, int] | None:
    """(latent rank, RoPE key dim) of a model whose cache holds multi-head latent attention
    latents (transformers' DeepSeek-V2/V3 family: ``kv_lora_rank``, ``qk_rope_head_dim``)."""
    if model_config is None:
        return None
    text = _text_config(model_config)
    rank, rope = getattr(text, "kv_lora_rank", None), getattr(text, "qk_rope_head_dim", None)
    return (rank, rope) if isinstance(rank, int) and isinstance(rope, int) else None


class KVarNLayer(CacheLayerMixin):
    """One attention layer's packed KVarN cache (allocated on the first update)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, config: KVarNConfig, max_cache_len: int, *, spec_tokens: int = 0,
                 name: str = "", fused: bool | None = None, model_config=None,
                 context_parallel=None):
        super().__init__()
        #: a registered ``kvarn_compile.ops.context_parallel.ContextParallel``, or None
        self.context_parallel = context_parallel
        self.config = config
        self.max_cache_len = max_cache_len
        self.spec_tokens = spec_tokens
        self.name = name
        self._fused = fused
        self._model_config = model_config
        self.state: LayerState | None = None
        #: a multi-head latent attention cache (latent as keys, RoPE key as values at
        #: ``LATENT_ROPE_BITS``), set on the first update
        self.latent = False

    @property
    def fused(self) -> bool:
        """Whether ``update`` hands placeholders to the fused ``kvarn`` attention.

        Unless fixed at construction, this follows the model config's *current* attention
        implementation, so a cache built before :func:`use_kvarn_attention` (or a model switched
        back to sdpa afterwards) still gets what its attention function can read.
        """
        if self._fused is not None:
            return self._fused
        return getattr(self._model_config, "_attn_implementation", None) == "kvarn"

    # -------------------------------------------------------------- CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        dv = value_states.shape[-1]
        if _mla_latents(self._model_config) == (d, dv) and h == 1:
            # multi-head latent attention (transformers' DeepSeek-V2/V3 family): the "keys" are
            # the normed latent (read through the model's own up-projections as keys and
            # values), packed at the preset's key bits; the "values" are the shared RoPE key,
            # packed at LATENT_ROPE_BITS (2-bit values would wreck its positions)
            if self.context_parallel is not None:
                raise NotImplementedError("KVarNCache(context_parallel=...) does not split "
                                          "multi-head latent attention caches.")
            self.latent = True
            self.config = self.config.replace(value_bits=LATENT_ROPE_BITS)
        kw = dict(batch=b, kv_heads=h, head_dim=d, value_head_dim=dv, max_len=self.max_cache_len,
                  dtype=key_states.dtype, device=key_states.device, spec_tokens=self.spec_tokens,
                  name=self.name)
        if self.context_parallel is not None:
            from kvarn_compile.ops import context_parallel as cp

            self.state = cp.allocate(self.context_parallel, self.config, **kw)
        else:
            self.state = allocate_layer(self.config, **kw)
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        state = self.state
        start = state.lengths.clone()
        args = (state.buffers, key_states, value_states, start, self.config.op_method,
                self.config.sinkhorn_iters, self.config.recent_window, self.spec_tokens,
                self.config.check_finite, self.name)
        if self.context_parallel is not None:
            if not self.fused:
                raise RuntimeError(
                    "KVarNCache(context_parallel=...) needs the kvarn attention (this rank holds "
                    "only its share of the tiles): call kvarn_compile.hf.use_kvarn_attention(model).")
            ops.cp_append_(*args, self.context_parallel.key)
        else:
            ops.append_(*args)
        if self.latent:
            # the model projects what the cache holds before any attention: the latents
            # themselves, dequantized for this layer's step (transient)
            return materialize(state.buffers, dtype=key_states.dtype)
        if self.fused:
            return (_handle(key_states, self.max_cache_len, state),
                    _handle(value_states, self.max_cache_len, state))
        if not getattr(KVarNLayer, "_warned", False):
            KVarNLayer._warned = True
            warnings.warn(
                "KVarNCache is handing a transient dequantized K/V to a non-KVarN attention "
                "implementation (correct, but it costs a full-precision copy of one layer "
                "while it runs). Call kvarn_compile.hf.use_kvarn_attention(model) or compile "
                "with kvarn_backend to attend over the packed cache directly.", stacklevel=3)
        return materialize(state.buffers, dtype=key_states.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self) -> int:
        return int(self.state.lengths[0]) if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.is_initialized:
            for name in ("lengths", "committed", "n_tiles"):
                getattr(self.state, name).zero_()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``-tokens_to_remove`` tokens (transformers' meaning: ``crop(-n)``;
        ``crop(0)`` drops none; a positive value raises, as for transformers' own layers).
        Tokens already packed into tiles are revised (``ops.append.crop_``), so any crop
        works, which ``is_croppable`` says."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"KVarN crop: expected a negative number of tokens to remove (crop(-n)), but got "
                f"{tokens_to_remove}; transformers' caches no longer take a positive length.")
        if not self.is_initialized or tokens_to_remove == 0:
            return
        if self.context_parallel is not None:
            self._crop_context_parallel(tokens_to_remove)
            return
        crop_(self.state.buffers, torch.clamp(self.state.lengths + tokens_to_remove, min=0))

    def _crop_context_parallel(self, tokens_to_remove: int) -> None:
        # each rank holds only its share of the tiles: only the high-precision tail rolls back
        f = self.state.fields
        new = torch.clamp(f.lengths + tokens_to_remove, min=0)
        frozen_end = torch.where(f.n_tiles > 0, self.state.sink_len + f.n_tiles * self.config.group_size,
                                 torch.zeros_like(f.n_tiles))
        if bool((new < frozen_end).any()):
            raise ValueError(
                f"KVarN crop: a context-parallel cache can roll back only the tokens in its "
                f"high-precision tail, but {-tokens_to_remove} tokens reach into the packed tiles. "
                "Allocate it with spec_tokens >= the tokens a draft may reject.")
        crop_(self.state.buffers, new)

    @property
    def is_croppable(self) -> bool:
        """Every crop works on one process; a context-parallel cache rolls back only within
        its uncommitted tail (``spec_tokens``)."""
        return self.context_parallel is None or self.spec_tokens > 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row b takes the state of row beam_idx[b] (in place, static addresses)."""
        if self.is_initialized:
            idx = beam_idx.to(self.device)
            for t in self.state.buffers:
                t.copy_(t.index_select(0, idx))

    def _select_rows(self, idx: torch.Tensor) -> None:
        state = self.state
        state.buffers = [t.index_select(0, idx.to(t.device)).contiguous() for t in state.buffers]
        state.version += 1       # new tensors: whoever holds the old list must take the new one

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            b = self.state.batch
            self._select_rows(torch.arange(b).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select_rows(torch.as_tensor(indices))


class KVarNCache(Cache):
    """A transformers ``Cache`` whose every layer stores KVarN-packed K/V.

    Args:
        config: the model's ``PretrainedConfig`` (for the layer count and attention kind).
        max_cache_len: tokens per sequence the cache is allocated for (prompt + generation).
        preset: a KVarN preset name or a :class:`KVarNConfig`; ``**overrides`` change fields.
        spec_tokens: how many of the newest tokens of each write stay uncommitted (never
            quantized) until the next write, so that speculative decoding can crop them.
        options: ``max_cache_len`` and ``spec_tokens`` as one :class:`kvarn_compile.KVarNOptions`
            (the object ``kvarn_backend`` and ``inductor_pass`` take), instead of the keywords.
        context_parallel: a ProcessGroup (or ``True``: the default group): this rank keeps
            1/ranks of each layer's tiles (:mod:`kvarn_compile.ops.context_parallel`); needs the
            ``kvarn`` attention (:func:`use_kvarn_attention`).
    """

    def __init__(self, config, max_cache_len: int | None = None, preset: str | KVarNConfig = "k4v2", *,
                 spec_tokens: int | None = None, options: KVarNOptions | None = None,
                 context_parallel=None, **overrides):
        self.options = options_from(options, max_cache_len=max_cache_len, spec_tokens=spec_tokens)
        max_cache_len, spec_tokens = self.options.max_cache_len, self.options.spec_tokens
        cp = None
        if context_parallel is not None:
            from kvarn_compile.ops import context_parallel as cp_module

            cp = cp_module.register(context_parallel)
        self.kvarn_config = get_config(preset, **overrides)
        text = _text_config(config)
        n_layers = text.num_hidden_layers
        if getattr(text, "layer_types", None) and any(t != "full_attention" for t in text.layer_types):
            kinds = sorted(set(text.layer_types))
            raise NotImplementedError(
                f"KVarNCache supports models whose layers are all full attention, but this model "
                f"has layer types {kinds}. Use kvarn_backend, which reports and skips the others.")
        if getattr(text, "alibi", False) is True:
            raise NotImplementedError(
                f"KVarNCache has static shapes (like transformers' StaticCache), which "
                f"{type(text).__name__} with alibi=True cannot use: it builds its ALiBi bias for "
                "the current key length only. Compile the model with kvarn_backend and its default "
                "dynamic cache instead.")
        check_method(self.kvarn_config.op_method)
        layers = [KVarNLayer(self.kvarn_config, max_cache_len, spec_tokens=spec_tokens,
                             name=f"layers.{i}", model_config=config, context_parallel=cp)
                  for i in range(n_layers)]
        super().__init__(layers=layers)
        self.max_cache_len = max_cache_len

    # transformers < 5.18 declares a read-only (deprecated) ``Cache.max_cache_len`` property
    @property
    def max_cache_len(self) -> int:
        """Tokens per sequence the cache is allocated for."""
        return self._max_cache_len

    @max_cache_len.setter
    def max_cache_len(self, value: int) -> None:
        self._max_cache_len = value

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's packed state (live tensors)."""
        return sum(layer.state.nbytes for layer in self.layers if layer.is_initialized)

    def used_bytes(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for layer in self.layers:
            if layer.is_initialized:
                for k, v in layer.state.used_bytes().items():
                    total[k] = total.get(k, 0) + v
        return total


# ------------------------------------------------------------------------------ attention
def kvarn_attention_forward(module, query, key, value, attention_mask, scaling=None,
                            dropout: float = 0.0, **kwargs):
    """transformers attention function over a KVarN cache (registered as ``"kvarn"``)."""
    state = getattr(key, _STATE_ATTR, None)
    if state is None:
        # full-precision keys and values: no cache, or one KVarN does not manage (transformers'
        # own, e.g. the cache generate() makes for a model used as its own assistant); attend
        # over them exactly, as sdpa would
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if not getattr(kvarn_attention_forward, "_warned", False) and key.shape[2] > query.shape[2]:
            kvarn_attention_forward._warned = True
            warnings.warn(
                "kvarn attention was given a full-precision cache (not a KVarNCache): it attends "
                "over it exactly, uncompressed. Pass cache=KVarNCache(model.config, "
                "max_cache_len=...) to keep that cache packed.", stacklevel=3)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("KVarN attention does not support attention logit soft-capping.")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("KVarN attention does not support attention sinks (s_aux).")
    if dropout and module.training:
        raise NotImplementedError("KVarN attention is inference-only (dropout must be 0).")
    window = kwargs.get("sliding_window") or 0
    mask = attention_mask
    if mask is not None and mask.dim() == 2:  # [B, L] padding masks
        mask = mask[:, None, None, :].bool()
    args = (query, state.buffers, mask, float(scaling or query.shape[-1] ** -0.5), True, int(window))
    out = ops.cp_attention(*args, state.context_parallel) if state.context_parallel \
        else ops.attention(*args)
    return out.transpose(1, 2).contiguous(), None


def use_kvarn_attention(model) -> None:
    """Register the ``kvarn`` attention implementation and switch ``model`` to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if _mla_latents(model.config) is not None:
        raise ValueError(
            f"use_kvarn_attention: {type(model).__name__} attends over keys and values it projects "
            "from a multi-head latent attention cache, not over the cache; keep its own attention "
            "and pass cache=KVarNCache(model.config, ...), which packs the latents.")
    AttentionInterface.register("kvarn", kvarn_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register("kvarn", sdpa_mask)
    model.set_attn_implementation("kvarn")


def cache_kwarg(model) -> str:
    """The name ``model``'s forward (and so ``generate``) takes its cache by: ``cache`` from
    transformers 5.24 on (``past_key_values`` deprecated there), ``past_key_values`` before
    (5.0-5.23, e.g. 5.17). ``model(ids, **{cache_kwarg(model): cache})`` runs on both."""
    import inspect

    model = getattr(model, "_orig_mod", model)      # torch.compile's wrapper takes *args, **kwargs
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(output):
    """The cache a model output or a ``generate`` result carries: its ``cache`` field from
    transformers 5.24 on, ``past_key_values`` before."""
    import dataclasses

    if not dataclasses.is_dataclass(output):
        raise TypeError(f"output_cache: expected a model output or a generate result (a "
                        f"ModelOutput: return_dict=True, or return_dict_in_generate=True for "
                        f"generate), but got {type(output).__name__}.")
    names = {f.name for f in dataclasses.fields(output)}
    return getattr(output, "cache" if "cache" in names else "past_key_values")


#: the projections whose output holds the attention keys (separate or fused); sharding one of
#: them by columns splits the KV heads among the ranks
_KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")


def _kv_heads_per_rank(tp_plan: dict[str, str] | None, heads: int, tp: int) -> int | None:
    """The KV heads one rank holds under ``tp_plan``: transformers' own answer where it has
    one (``get_kv_heads_per_rank``, in recent 5.x releases), else the same rule: heads split
    evenly when a key projection is sharded by columns (None when they do not divide), all
    of them on every rank otherwise."""
    try:
        from transformers.distributed.tensor_parallel import get_kv_heads_per_rank
    except ImportError:   # older 5.x (5.17): no helper
        sharded = any(name.rsplit(".", 1)[-1] in _KEY_PROJECTIONS and style == "colwise"
                      for name, style in (tp_plan or {}).items())
        if not sharded:
            return heads
        return heads // tp if heads % tp == 0 else None
    return get_kv_heads_per_rank(tp_plan or {}, heads, tp)


def kv_geometry(model) -> tuple[int, int]:
    """(KV heads, head dim) of a transformers model's attention layers, from its config;
    for a tensor-parallel model (``tp_plan``) the KV heads of this rank."""
    config = model.config
    text = _text_config(config)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    tp = getattr(model, "_tp_size", None) or 1
    if tp > 1:
        local = _kv_heads_per_rank(model.tp_plan, heads, tp)
        if local is None:
            raise ValueError(f"Expected the {heads} KV heads to divide by the tensor-parallel "
                             f"size, but got {tp} (see kvarn_compile.distributed).")
        heads = local
    return heads, head_dim


def static_cache_for(model, max_cache_len: int, *, batch: int = 1):
    """A transformers ``StaticCache`` for ``model``, with its buffers allocated now
    (``early_initialization``, in the model's dtype and device), for a model compiled with
    ``kvarn_backend``: the pass then sees the cache writes in the first compiled graph, takes
    the cache over into packed states and releases these buffers. (A lazily initialized
    ``StaticCache`` works too, but its prefill stays in full precision.)"""
    from transformers import StaticCache

    max_cache_len = checked_max_cache_len(max_cache_len)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"Expected batch to be a positive int, but got {batch!r}.")
    heads, head_dim = kv_geometry(model)
    param = next(model.parameters())
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    v_dim = getattr(_text_config(model.config), "v_head_dim", None)
    latents = _mla_latents(model.config)
    if latents is not None:
        # multi-head latent attention (transformers' DeepSeek-V2/V3 family) caches one head
        # of the latent ("keys") and of the RoPE key ("values") per token
        heads, head_dim, v_dim = 1, latents[0], latents[1]
    elif not isinstance(v_dim, int) or v_dim == head_dim:
        cache.early_initialization(batch, heads, head_dim, param.dtype, param.device)
        return cache
    # values of another head dim (MiMo-V2-Flash: K 192, V 128; MLA latents): StaticCache
    # .early_initialization gives every layer one head dim; its layers size K and V from what
    # they are handed
    keys = torch.zeros(batch, heads, 0, head_dim, dtype=param.dtype, device=param.device)
    values = torch.zeros(batch, heads, 0, v_dim, dtype=param.dtype, device=param.device)
    for layer in cache.layers:
        layer.lazy_initialization(keys, values)
    return cache


# ------------------------------------------------------------------------------ knob tuning
class TunedKVarNLayer(KVarNLayer):
    """A KVarNLayer that picks its (G, T) from the prefill K/V before allocating."""

    def __init__(self, *args: Any, options: KnobTuning, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.options = options
        self.decision: Decision | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.config.method == "kvarn":
            s = self.config.sink
            groups = self.options.group_sizes or (self.config.group_size,)
            cands = [QuantKnobs(g, t) for g in groups for t in self.options.iters]
            k = key_states[:, :, s:].float()
            v = value_states[:, :, s:].float()
            self.decision = select_quant_knobs(k, v, self.config, cands,
                                               self.options.tolerance, self.options.timer)
            chosen = self.decision.chosen
            overrides: dict[str, Any] = {"sinkhorn_iters": chosen.iters,
                                         "group_size": chosen.group_size}
            if self.config.sink_tokens is None:   # keep the sink where the preset has it
                overrides["sink_tokens"] = s
            self.config = self.config.replace(**overrides)
            log.info("kvarn knob tuning %s: %s", self.name, self.decision.summary())
        super().lazy_initialization(key_states, value_states)

class TunedKVarNCache(KVarNCache):
    """A :class:`KVarNCache` whose layers choose (G, T) on the prefill K/V (see :mod:`kvarn_compile.autotune`).

    The prefill must hold at least sink + G tokens for G to be measurable; otherwise the
    preset's setting stays (the decision says why). ``decisions`` lists them per layer.
    """

    def __init__(self, config: Any, max_cache_len: int | None = None, preset: Any = "k4v2", *,
                 tune: KnobTuning | None = None, spec_tokens: int | None = None,
                 options: KVarNOptions | None = None, **overrides: Any):
        super().__init__(config, max_cache_len, preset, spec_tokens=spec_tokens, options=options,
                         **overrides)
        max_cache_len, spec_tokens = self.options.max_cache_len, self.options.spec_tokens
        options = tune or KnobTuning()
        self.layers = [TunedKVarNLayer(self.kvarn_config, max_cache_len, spec_tokens=spec_tokens,
                                       name=layer.name, model_config=config, options=options)
                       for layer in self.layers]

    @property
    def decisions(self) -> dict[str, Decision]:
        return {layer.name: layer.decision for layer in self.layers
                if getattr(layer, "decision", None) is not None}
