"""The product path: the real packed cache against the fake-quantize simulation.

* :func:`product_pseudo_decode`: the same block-wise pseudo-decode as :mod:`.harness`, but
  through a :class:`~.harness.QuantBackend` (by default ``use_kvarn_attention`` +
  ``KVarNCache``: blocks of ``b`` tokens are prefill chunks of the packed cache). Its KL is
  compared with the simulator run under the cache's own rules: tiles are frozen on append,
  *before* the block attends (so with ``b = G`` a block reads its own tile quantized), and
  the exact sink/tail and the quantizer input are rounded to the cache's exact dtype (fp16
  for an fp32 model). What remains is the fused attention's arithmetic (dequant folded into
  scores and weights, fp32 accumulation in another order).
* The packed cache built with ``spec_tokens=b`` keeps each chunk uncommitted (exact) while
  it attends and commits/freezes it at the next write: that is exactly the paper's
  pseudo-decode (``rule="after_block"``), so it is compared with the main simulation.
* :func:`generation_check`: end-to-end greedy generation through the backend vs the fp
  model: tokens until the first divergence, teacher-forced top-1 and KL on the generated
  positions.

``backend`` is the "how to build the quantized model/cache" parameter
(:class:`~.harness.QuantBackend`): the packed cache eager (:func:`~.harness.packed_backend`)
or the model compiled with ``kvarn_backend`` (:func:`~.harness.compiled_backend`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from kvarn_compile.config import KVarNConfig

from .harness import (PseudoQuantCache, QuantBackend, compiled_backend, forward, kl_top1,
                      packed_backend, pseudo_decode_metrics)

__all__ = ["exact_dtype_of", "product_pseudo_decode", "simulated_like_product", "generation_check",
           "default_generation_backends"]


def exact_dtype_of(model, config: KVarNConfig) -> torch.dtype | None:
    """The dtype the packed cache keeps exact tokens in, when it differs from the model's."""
    dtype = next(model.parameters()).dtype
    if dtype == torch.float32 and config.exact_dtype == "auto":
        return torch.float16
    return None


@torch.no_grad()
def product_pseudo_decode(model, ids: torch.Tensor, ref_logits: torch.Tensor, config: KVarNConfig,
                          block: int, backend: QuantBackend | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position KL / top-1 [T] of the backend's cache fed in blocks of ``block`` tokens."""
    backend = backend or packed_backend()
    with backend.activate(model, config) as runner:
        cache = backend.make_cache(runner, config, ids.shape[-1])
        return pseudo_decode_metrics(runner, ids, ref_logits, cache, block)


@torch.no_grad()
def simulated_like_product(model, ids: torch.Tensor, ref_logits: torch.Tensor,
                           config: KVarNConfig, block: int, *, rule: str = "on_append",
                           mirror_dtype: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The fake-quantize simulator under the packed cache's rules (freeze on append, fp16 exact).

    ``mirror_dtype=False`` keeps fp32 exact tokens: the difference to the mirrored run is a
    yardstick of how much tiny perturbations move the KL (the noise of the comparison).
    """
    round_to = exact_dtype_of(model, config) if mirror_dtype else None
    cache = PseudoQuantCache(model, config, rule=rule, round_to=round_to)
    return pseudo_decode_metrics(model, ids, ref_logits, cache, block)


@torch.no_grad()
def _greedy(model, cache, prompt: torch.Tensor, new_tokens: int, forced: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy (or teacher-forced) decode: (tokens [N], logits [N, V] that chose/scored them)."""
    logits = forward(model, prompt, cache, logits_to_keep=1)[0, -1]
    tokens, all_logits = [], []
    for i in range(new_tokens):
        all_logits.append(logits)
        token = logits.argmax() if forced is None else forced[i]
        tokens.append(int(token))
        if i + 1 < new_tokens:
            logits = forward(model, torch.tensor([[tokens[-1]]]), cache, logits_to_keep=1)[0, -1]
    return torch.tensor(tokens), torch.stack(all_logits)


def default_generation_backends(prompt_tokens: int) -> dict[str, QuantBackend]:
    """The one-line product, and the packed cache with and without an exact prefill.

    ``kvarn_backend``: the model compiled with ``kvarn_backend(config)`` (Inductor) over a
    transformers ``StaticCache`` the pass takes over. ``packed``: ``KVarNCache`` + the
    ``kvarn`` attention, eager; the whole prompt is one prefill chunk and its complete tiles
    are frozen before it attends (as in the compiled model). ``packed_deferred_prefill``:
    ``spec_tokens = prompt length`` keeps the prompt uncommitted during its own prefill (it
    attends exact K/V, as the method describes) and freezes it at the first decode step.
    """
    return {"kvarn_backend": compiled_backend(),
            "packed": packed_backend(),
            "packed_deferred_prefill": packed_backend(spec_tokens=prompt_tokens)}


@torch.no_grad()
def generation_check(model, prompt: torch.Tensor, new_tokens: int, configs: dict[str, KVarNConfig],
                     backend: QuantBackend | dict[str, QuantBackend] | None = None,
                     progress=None) -> dict:
    """Greedy generation of ``new_tokens`` through each backend and config vs the fp model.

    ``backend``: one :class:`~.harness.QuantBackend`, a dict of named ones, or None for
    :func:`default_generation_backends`. Reports per backend and config the position of
    the first divergence of free-running greedy decoding, the share of equal tokens, and the
    teacher-forced (fed the fp tokens) top-1 agreement and KL on the generated positions.
    """
    if backend is None:
        backends = default_generation_backends(int(prompt.shape[-1]))
    elif isinstance(backend, QuantBackend):
        backends = {backend.name: backend}
    else:
        backends = dict(backend)
    fp_tokens, fp_logits = _greedy(model, DynamicCache(config=model.config), prompt, new_tokens)
    out = {"prompt_tokens": int(prompt.shape[-1]), "new_tokens": new_tokens,
           "backends": {name: b.name for name, b in backends.items()}, "by_backend": {}}
    max_len = prompt.shape[-1] + new_tokens
    for bname, be in backends.items():
        res = out["by_backend"].setdefault(bname, {})
        for name, config in configs.items():
            if not be.supports(config.method):
                res[name] = {"skipped": f"backend {be.name} does not run {config.method}"}
                continue
            with be.activate(model, config) as runner:
                free, _ = _greedy(runner, be.make_cache(runner, config, max_len), prompt, new_tokens)
                _, forced_logits = _greedy(runner, be.make_cache(runner, config, max_len), prompt,
                                           new_tokens, forced=fp_tokens)
                report = getattr(runner, "kvarn_report", None)
            same = free == fp_tokens
            first = int((~same).nonzero()[0]) if bool((~same).any()) else new_tokens
            kl, agree = kl_top1(fp_logits, forced_logits)
            res[name] = {"first_divergence": first, "greedy_match": float(same.double().mean()),
                         "teacher_forced_top1": float(agree.mean()),
                         "teacher_forced_kl": float(kl.mean()), "teacher_forced_kl_max": float(kl.max())}
            if report is not None:
                res[name]["sites_rewritten"] = f"{len(report.rewritten)}/{len(report.sites)}"
            if progress is not None:
                progress(f"{bname} {name}")
    return out
