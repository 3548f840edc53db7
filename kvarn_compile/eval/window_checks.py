"""The per-window checks :func:`~.suite.run_eval` adds to the grid, and their summaries.

* **diagnostics** (:func:`_diagnose`, :func:`_finish_diagnostics`): per-layer K/V and
  attention-output errors, the magnitude/direction split and the outlier-restore experiment
  (:mod:`.diagnostics`) on the static cache of one context length;
* **product path** (:func:`_product`, :func:`_finish_product`): the packed cache against the
  simulation (:mod:`.product`).

A config that quantizes exactly like an earlier one (``same_quantizer``) runs once and its
window is copied under the other name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from . import diagnostics as diag
from .harness import (PseudoQuantCache, _static_prefix, block_logits, kl_top1, method_config,
                      pseudo_decode_metrics, same_quantizer)
from .product import product_pseudo_decode, simulated_like_product
from .progress import _Progress
from .settings import EvalSettings, _sink


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


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
        region = diag.quantized_region(prefix, cfg)
        if region.stop <= region.start:   # nothing quantized in the static prefix: nothing to diagnose
            acc[key] = {"skipped": f"the static prefix of L - b = {prefix} tokens holds no quantized "
                                   f"tile ({cfg.sink} sink tokens stay exact, tiles of {cfg.group_size}); "
                                   f"use a longer --diag-length"}
            prog.step(f"diagnostics {key[1]} {key[0]} (skipped)")
            continue
        if twin != key:     # quantizes exactly like an earlier config: copy its window
            _copy_window(acc[twin], acc.setdefault(key, {}))
            prog.step(f"diagnostics {key[1]} {key[0]}")
            continue
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
        if "skipped" in a:
            out.setdefault("skipped", {}).setdefault(preset, {})[method] = a["skipped"]
            continue
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
