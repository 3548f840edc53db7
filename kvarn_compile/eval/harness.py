"""Static and pseudo-decode runners: how a quantized KV cache changes a model's predictions.

Two ways to put quantization error into a model's cache, following the KVarN paper:

* **static** (:func:`static_block_logits`): one full-precision forward over the window; the
  K/V of the first ``L - b`` tokens are quantized *once* (sink and incomplete tail exact,
  :func:`~kvarn_compile.quant.quantize_cache`), then the last block of ``b`` tokens is
  run again against that cache. The quantized K/V were computed from clean hidden states.
* **pseudo-decode** (:func:`run_blocks` over a :class:`PseudoQuantCache`): the window is run
  in blocks of ``b`` tokens. A block attends to the exact sink, the quantized tiles of all
  earlier tokens, the exact incomplete tail and itself; after the block its K/V (computed
  from hidden states that already saw quantized K/V) are quantized and appended, so later
  blocks see accumulated error. This is what real decoding does.

The pseudo-decode cache follows one of two freezing rules (:data:`RULES`):

* ``"after_block"`` (the paper's pseudo-decode, the default): a block attends to its own
  exact K/V; complete tiles are quantized once the block has run.
* ``"on_append"`` (the packed runtime cache, :class:`~kvarn_compile.hf.KVarNCache`): a
  block's K/V are appended first and every tile that is complete is frozen *before* the
  block attends, so with ``b = G`` each block already reads its own tile quantized.

Method ``"none"`` keeps every token exact: it must reproduce the plain model (KL ~ 0), which
the harness checks as its faithfulness test.

Everything here works on any transformers causal LM whose layers all use full attention.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from kvarn_compile.config import KVarNConfig, get_config
from kvarn_compile.quant import fake_quantize, quantize_cache, split_lengths

__all__ = [
    "ALL_METHODS", "DEFAULT_METHODS", "OUTLIER_METHODS", "RULES", "QuantBackend", "PseudoQuantCache", "PseudoQuantLayer",
    "method_config", "same_quantizer", "forward", "n_layers", "kl_top1", "fp_reference", "quantize_prefix",
    "block_logits", "static_block_logits", "run_blocks", "pseudo_decode_metrics",
    "packed_backend", "compiled_backend", "simulated_backend",
]

#: Methods the harness compares. "none" is the unquantized model run through the same code.
#: A name may carry variant suffixes after the base method (see ``VARIANTS``), e.g.
#: "kvarn+krot" is kvarn with ``key_frame="rotated"`` (the reference rule: every K tile
#: rotated); plain "kvarn" and "hadamard" take the config default, ``key_frame="auto"``.
BASE_METHODS: tuple[str, ...] = ("none", "kivi", "hadamard", "kvarn")
#: Config overrides a method-name suffix stands for.
VARIANTS: dict[str, dict[str, object]] = {
    "krot": {"key_frame": "rotated"},
    "kauto": {"key_frame": "auto"},
    "clip": {"clip": "mse"},
}
ALL_METHODS: tuple[str, ...] = BASE_METHODS + ("hadamard+krot", "kvarn+krot", "kvarn+clip")
#: What ``kvarn-compile eval`` compares unless told otherwise: the paper's methods and the
#: clipped variant (``k2v2_clip``). The rotated-only variants (the reference key frame) only
#: differ from their base method on models with bias-like key outliers; they join the
#: default with ``key_outliers``.
DEFAULT_METHODS: tuple[str, ...] = BASE_METHODS + ("kvarn+clip",)
OUTLIER_METHODS: tuple[str, ...] = DEFAULT_METHODS + ("hadamard+krot", "kvarn+krot")
#: When the pseudo-decode cache freezes complete tiles (see the module docstring).
RULES: tuple[str, ...] = ("after_block", "on_append")


def method_config(method: str, preset: str | KVarNConfig) -> KVarNConfig | None:
    """The quantizer config of ``method`` at ``preset``; ``None`` for method "none"."""
    base, *suffixes = method.split("+")
    if base not in BASE_METHODS or any(x not in VARIANTS for x in suffixes) or \
            (base == "none" and suffixes):
        raise ValueError(f"Expected a method in {ALL_METHODS} (or base+variant with variants "
                         f"{tuple(VARIANTS)}), but got {method!r}.")
    if base == "none":
        return None
    overrides: dict[str, object] = {"method": base}
    for x in suffixes:
        overrides.update(VARIANTS[x])
    return get_config(preset, **overrides)


def same_quantizer(config: KVarNConfig | None) -> KVarNConfig | None:
    """A config that quantizes exactly like ``config``, with options that cannot apply to it
    reset: the clip search only touches keys of <= ``CLIP_MAX_BITS`` bits. Configs with equal
    results here produce bit-identical caches, so an evaluation runs them once."""
    from kvarn_compile.quant.quantize import CLIP_MAX_BITS

    if config is not None and config.clip != "none" and config.key_bits > CLIP_MAX_BITS:
        return dataclasses.replace(config, clip="none")
    return config


def n_layers(model) -> int:
    """Number of decoder layers of a transformers causal LM."""
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return text.num_hidden_layers


@torch.no_grad()
def forward(model, ids: torch.Tensor, cache: Cache, *, logits_to_keep: int = 0) -> torch.Tensor:
    """Logits [1, T, V] (fp32) of ``ids`` [1, T] run on top of ``cache`` (which it extends)."""
    from kvarn_compile.hf import cache_kwarg

    device = next(model.parameters()).device
    out = model(input_ids=ids.to(device), use_cache=True, logits_to_keep=logits_to_keep,
                **{cache_kwarg(model): cache})
    return out.logits.float()


def kl_top1(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position KL(ref ‖ test) in nats and top-1 agreement, for logits [..., V].

    Computed in float64; a KL that rounds below zero is clipped to 0.
    """
    lp = torch.log_softmax(ref_logits.double(), -1)
    lq = torch.log_softmax(logits.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)
    agree = (ref_logits.argmax(-1) == logits.argmax(-1)).double()
    return kl, agree


# ------------------------------------------------------------------------------ fp reference
@torch.no_grad()
def fp_reference(model, ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One full-precision forward over ``ids`` [1, T]: (logits [T, V], per-layer (K, V)).

    K/V are post-RoPE, [1, kv_heads, T, head_dim], exactly what a ``DynamicCache`` stores.
    By causality the logits and K/V of any prefix are those of the prefix's own forward.
    """
    cache = DynamicCache(config=model.config)
    logits = forward(model, ids, cache)[0]
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    if len(kv) != n_layers(model):
        raise RuntimeError(f"Expected {n_layers(model)} cache layers, but got {len(kv)}.")
    return logits, kv


# ------------------------------------------------------------------------------ static
def quantize_prefix(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], config: KVarNConfig | None,
                    prefix: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``prefix`` tokens of every layer's K/V as the cache would hold them.

    Sink and incomplete tail stay exact; complete tiles in between are quantized and
    dequantized (``quantize_cache(...).dequantize()``). ``config=None`` returns them as is.
    """
    out = []
    for k, v in kv:
        k, v = k[..., :prefix, :], v[..., :prefix, :]
        if config is not None:
            k, v = quantize_cache(k, v, config).dequantize()
        out.append((k, v))
    return out


def _static_prefix(kv, q_full, config: KVarNConfig | None, prefix: int):
    """Static cache of the first ``prefix`` tokens from the whole window's quantized K/V.

    Tiles are quantized independently, so the complete tiles of a prefix are exactly the
    first tiles of the whole window's quantization; the prefix's own incomplete tail is exact.
    """
    if config is None:
        return [(k[..., :prefix, :], v[..., :prefix, :]) for k, v in kv]
    sink, n_q, _ = split_lengths(prefix, config)
    end = sink + n_q
    return [(torch.cat([kh[..., :end, :], k[..., end:prefix, :]], -2),
             torch.cat([vh[..., :end, :], v[..., end:prefix, :]], -2))
            for (k, v), (kh, vh) in zip(kv, q_full)]


def _cache_from_kv(model, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


@torch.no_grad()
def block_logits(model, ids_block: torch.Tensor, prefix_kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
                 ) -> torch.Tensor:
    """Logits [b, V] of ``ids_block`` [1, b] attending to ``prefix_kv`` and to itself (exact)."""
    return forward(model, ids_block, _cache_from_kv(model, prefix_kv))[0]


def static_block_logits(model, ids: torch.Tensor, fp_kv, config: KVarNConfig | None, *,
                        length: int, block: int) -> torch.Tensor:
    """Static setting: logits [b, V] of tokens [L - b, L) over the once-quantized prefix."""
    if not 0 < block < length <= ids.shape[-1]:
        raise ValueError(f"Expected 0 < block ({block}) < length ({length}) <= window "
                         f"({ids.shape[-1]}).")
    prefix = length - block
    return block_logits(model, ids[:, prefix:length], quantize_prefix(fp_kv, config, prefix))


# ------------------------------------------------------------------------------ pseudo-decode cache
class PseudoQuantLayer(DynamicLayer):
    """A ``DynamicLayer`` that replaces complete tiles beyond the sink by their fake-quantized
    version (quantize + dequantize), so attention reads exactly what a quantized cache holds.

    ``frozen`` is the end of the final region (sink + quantized tiles); tokens after it are
    exact. With ``config=None`` nothing is ever quantized (method "none").
    """

    def __init__(self, config: KVarNConfig | None, *, rule: str = "after_block",
                 quantizer: Callable[..., torch.Tensor] | None = None,
                 round_to: torch.dtype | None = None, index: int = 0,
                 log: list | None = None):
        super().__init__()
        if rule not in RULES:
            raise ValueError(f"Expected rule in {RULES}, but got {rule!r}.")
        self.config = config
        self.rule = rule
        self.quantizer = quantizer
        self.round_to = round_to
        self.index = index
        self.log = log
        self.frozen = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.round_to is not None:  # mirror a cache whose exact region is e.g. fp16
            key_states = key_states.to(self.round_to).to(key_states.dtype)
            value_states = value_states.to(self.round_to).to(value_states.dtype)
        super().update(key_states, value_states, *args, **kwargs)
        if self.rule == "on_append":
            self.freeze()
        return self.keys, self.values

    def _quantize(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        c = self.config
        fn = self.quantizer if self.quantizer is not None else fake_quantize
        extra = {"key_frame": c.key_frame} if c.key_frame != "rotated" else {}
        if c.clip != "none":
            extra["clip"] = c.clip
        return fn(x, kind=kind, method=c.method, bits=c.key_bits if kind == "k" else c.value_bits,
                  group=c.group_size, iters=c.sinkhorn_iters, scale_dtype=c.scale_dtype, **extra)

    def freeze(self) -> int:
        """Quantize every complete tile past the sink (and the recent window) not yet frozen.

        Returns the number of tokens newly quantized.
        """
        if self.config is None or not self.is_initialized:
            return 0
        c = self.config
        total = self.get_seq_length()
        start = max(self.frozen, min(c.sink, total))
        n = max(total - c.recent_window - start, 0) // c.group_size * c.group_size
        if n == 0:
            return 0
        stop = start + n
        parts = []
        for kind, x in (("k", self.keys), ("v", self.values)):
            q = self._quantize(x[..., start:stop, :], kind).to(x.dtype)
            parts.append(torch.cat([x[..., :start, :], q, x[..., stop:, :]], -2))
        self.keys, self.values = parts
        self.frozen = stop
        if self.log is not None:
            self.log.append((self.index, start, stop))
        return n

    def snapshot(self) -> tuple[Any, ...]:
        """Cheap copy of the state (tensors are replaced, never written in place)."""
        return (self.keys, self.values, self.frozen, self.is_initialized)

    def restore(self, snap: tuple[Any, ...]) -> None:
        self.keys, self.values, self.frozen, self.is_initialized = snap


class PseudoQuantCache(Cache):
    """A transformers ``Cache`` of :class:`PseudoQuantLayer`: the pseudo-decode simulator.

    Args:
        model_or_layers: the model (for its layer count) or the number of layers.
        config: the quantizer config (``None``: exact, method "none").
        rule: ``"after_block"`` (call :meth:`end_block` after each block; the block saw
            itself exact) or ``"on_append"`` (tiles freeze inside ``update``, before the
            block attends, like the packed runtime cache).
        quantizer: replaces :func:`~kvarn_compile.quant.fake_quantize` (same signature).
        round_to: round new K/V to this dtype first (``torch.float16`` mirrors the packed
            cache of an fp32 model, whose exact sink/tail and quantizer input are fp16).

    ``freeze_log`` lists ``(layer, start, stop)`` of every quantized token range.
    """

    def __init__(self, model_or_layers, config: KVarNConfig | None = None, *,
                 rule: str = "after_block", quantizer: Callable[..., torch.Tensor] | None = None,
                 round_to: torch.dtype | None = None):
        count = model_or_layers if isinstance(model_or_layers, int) else n_layers(model_or_layers)
        self.freeze_log: list[tuple[int, int, int]] = []
        self.config = config
        self.rule = rule
        layers = [PseudoQuantLayer(config, rule=rule, quantizer=quantizer, round_to=round_to,
                                   index=i, log=self.freeze_log) for i in range(count)]
        super().__init__(layers=layers)

    def end_block(self) -> int:
        """Called after every block by :func:`run_blocks`: freezes under ``"after_block"``."""
        if self.rule != "after_block":
            return 0
        return sum(layer.freeze() for layer in self.layers)

    def snapshot(self) -> list[tuple[Any, ...]]:
        return [layer.snapshot() for layer in self.layers]

    def restore(self, snap: list[tuple[Any, ...]]) -> None:
        for layer, s in zip(self.layers, snap):
            layer.restore(s)


# ------------------------------------------------------------------------------ block runner
def run_blocks(model, ids: torch.Tensor, cache: Cache, block: int, *, start: int = 0,
               logits_to_keep: int = 0) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Feed ``ids`` [1, T] from ``start`` in blocks of ``block`` tokens; yield (s, e, logits [n, V]).

    After each block the cache's ``end_block()`` is called when it has one (the pseudo-decode
    simulator freezes tiles there); any other ``Cache`` (e.g. ``KVarNCache``) is just fed
    block after block, so each block is one prefill chunk of it.
    """
    if block < 1:
        raise ValueError(f"Expected block >= 1, but got {block}.")
    total = ids.shape[-1]
    for s in range(start, total, block):
        e = min(s + block, total)
        logits = forward(model, ids[:, s:e], cache, logits_to_keep=logits_to_keep)[0]
        end_block = getattr(cache, "end_block", None)
        if end_block is not None:
            end_block()
        yield s, e, logits


def pseudo_decode_metrics(model, ids: torch.Tensor, ref_logits: torch.Tensor, cache: Cache,
                          block: int, *, progress: Callable[[int], None] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pseudo-decode ``ids`` [1, T] through ``cache``; per position KL and top-1 vs ``ref_logits`` [T, V].

    Returns two float64 tensors [T] (every position; callers pick the evaluated ones).
    """
    kls, agrees = [], []
    for s, e, logits in run_blocks(model, ids, cache, block):
        kl, agree = kl_top1(ref_logits[s:e], logits)
        kls.append(kl)
        agrees.append(agree)
        if progress is not None:
            progress(e - s)
    return torch.cat(kls), torch.cat(agrees)


# ------------------------------------------------------------------------------ backends
@dataclasses.dataclass
class QuantBackend:
    """How to build the quantized model and cache for a product-path run.

    ``activate(model, config)`` is a context manager yielding the callable model to run for
    ``config`` (the model itself, or a compiled copy); ``make_cache(runner, config, max_len)``
    builds a fresh cache for one sequence; ``supports(method)`` says which methods it can run.
    The default is the packed runtime cache (:func:`packed_backend`); :func:`compiled_backend`
    is the one-line product, ``kvarn_backend`` under ``torch.compile``.
    """

    name: str
    make_cache: Callable[[Any, KVarNConfig, int], Cache]
    activate: Callable[[Any, KVarNConfig], contextlib.AbstractContextManager] = \
        lambda model, config: contextlib.nullcontext(model)
    supports: Callable[[str], bool] = lambda method: True


def packed_backend(**overrides: Any) -> QuantBackend:
    """The real packed cache: ``use_kvarn_attention(model)`` + ``KVarNCache`` (kvarn/hadamard)."""

    @contextlib.contextmanager
    def activate(model, config: KVarNConfig):
        from kvarn_compile.hf import use_kvarn_attention
        previous = getattr(model.config, "_attn_implementation", None) or "sdpa"
        use_kvarn_attention(model)
        try:
            yield model
        finally:
            model.set_attn_implementation(previous)

    def make_cache(model, config: KVarNConfig, max_len: int) -> Cache:
        from kvarn_compile.hf import KVarNCache
        return KVarNCache(model.config, max_cache_len=max_len, preset=config, **overrides)

    return QuantBackend(name="packed-kvarncache", make_cache=make_cache, activate=activate,
                        supports=lambda method: method in ("kvarn", "hadamard"))


def compiled_backend(compiler: str = "inductor") -> QuantBackend:
    """What a user runs: a copy of the model compiled with ``kvarn_backend(config)`` and a
    transformers ``StaticCache`` (:func:`~kvarn_compile.hf.static_cache_for`), which the pass
    takes over into packed states (its buffers are released).

    The runner carries the backend's report as ``runner.kvarn_report``; a run in which the
    pass rewrote no attention raises instead of reporting full-precision numbers as KVarN.
    Dynamo is reset around each config, so every config compiles afresh.
    """

    @contextlib.contextmanager
    def activate(model, config: KVarNConfig):
        import copy

        from kvarn_compile.backend import kvarn_backend

        backend = kvarn_backend(config, compiler=compiler)
        runner = copy.deepcopy(model)
        runner.compile(backend=backend)
        runner.kvarn_report = backend.report
        torch._dynamo.reset()
        try:
            yield runner
            if not backend.report.rewritten:
                raise RuntimeError(f"kvarn_backend rewrote no attention of this model, so the run was "
                                   f"not KVarN; report:\n{backend.report}")
        finally:
            torch._dynamo.reset()

    def make_cache(model, config: KVarNConfig, max_len: int) -> Cache:
        from kvarn_compile.hf import static_cache_for
        return static_cache_for(model, max_len)

    return QuantBackend(name=f"kvarn_backend-{compiler}", make_cache=make_cache, activate=activate,
                        supports=lambda method: method in ("kvarn", "hadamard"))


def simulated_backend(rule: str = "on_append", round_to: torch.dtype | None = None) -> QuantBackend:
    """The fake-quantize simulator as a backend (any method, including kivi)."""

    def make_cache(model, config: KVarNConfig, max_len: int) -> Cache:
        return PseudoQuantCache(model, config, rule=rule, round_to=round_to)

    return QuantBackend(name=f"simulated-{rule}", make_cache=make_cache)
