"""``kvarn-compile kv-report``: the quantizer's round-trip error and bits per element on real K/V.

:func:`kv_report` captures the model's keys and values on real text (:mod:`.capture`,
:mod:`.corpora`), quantizes them with every preset and method and measures each round trip;
:func:`print_kv_report` prints the table (``kvarn-compile run --kv-report`` prints it too).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["kv_report", "print_kv_report", "add_kv_report_command", "add_kv_report_arguments",
           "kv_report_command"]

KV_REPORT_HELP = "quantizer error and bits per element on captured K/V"
KV_REPORT_DESCRIPTION = ("Capture the model's keys and values on real text, quantize them with every "
                         "preset and method and report the relative round-trip error and the bits per "
                         "element.")


def kv_report(model_name: str | None = None, *, tokens: int = 1024, windows: int = 2,
              corpus: str = "lee", progress: bool = True) -> dict[str, Any]:
    """Capture K/V of the real model on real text; quantize with every preset and method.

    Reports, per (preset, method): the mean relative round-trip error ||x̂ - x|| / ||x||
    of K and of V over all layers and windows (quantized region only), and the bits per
    element of the quantized region and of the whole cache, counted from the packed tensors.
    """
    import torch
    from tqdm import tqdm

    from kvarn_compile.config import METHODS, PRESETS, get_config
    from kvarn_compile.eval.capture import capture_kv
    from kvarn_compile.eval.corpora import text_windows
    from kvarn_compile.eval.models import DEFAULT_MODEL, load_model
    from kvarn_compile.quant import quantize_cache

    model, tok = load_model(model_name)
    ids = text_windows(tok, windows, tokens, corpus)
    kv = [capture_kv(model, ids[i:i + 1]) for i in range(windows)]
    rows = []
    combos = [(p, m) for p in PRESETS for m in METHODS]
    for preset, method in tqdm(combos, desc="quantizing", disable=not progress, file=sys.stderr):
        cfg = get_config(preset, method=method)
        k_err, v_err, bytes_all, bytes_q, elems, elems_q = [], [], 0, 0, 0, 0
        for layers in kv:
            for k, v in layers:
                cache = quantize_cache(k, v, cfg, exact_dtype=torch.float16)  # as the runtime cache
                k_hat, v_hat = cache.dequantize()
                s = cache.sink_k.shape[-2]
                n = s + (cache.k_tiles.shape[-3] * cfg.group_size if cache.k_tiles is not None else 0)
                k_err.append(_rel(k_hat[..., s:n, :], k[..., s:n, :]))
                v_err.append(_rel(v_hat[..., s:n, :], v[..., s:n, :]))
                bytes_all += cache.nbytes
                elems += cache.elements
                bytes_q += cache.quantized_bytes()
                elems_q += 2 * (n - s) * k.shape[-1] * k.shape[0] * k.shape[1]
        rows.append({"preset": preset, "method": method,
                     "k_rel_err": sum(k_err) / len(k_err), "v_rel_err": sum(v_err) / len(v_err),
                     "bpe_quantized": 8 * bytes_q / elems_q, "bpe_overall": 8 * bytes_all / elems})
    return {"model": model_name or DEFAULT_MODEL, "corpus": corpus, "tokens": tokens,
            "windows": windows, "head_dim": kv[0][0][0].shape[-1], "rows": rows}


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def print_kv_report(rep: dict[str, Any]) -> None:
    from kvarn_compile.eval.corpora import CORPORA

    print(f"\nK/V round trip on {rep['model']} ({rep['windows']} x {rep['tokens']} tokens of "
          f"{CORPORA[rep['corpus']].description}, head_dim {rep['head_dim']}, quantized region only)")
    print(f"{'preset':10} {'method':9} {'K rel err':>10} {'V rel err':>10} {'bpe (tiles)':>12} {'bpe (all)':>10}")
    for r in rep["rows"]:
        print(f"{r['preset']:10} {r['method']:9} {r['k_rel_err']:10.4f} {r['v_rel_err']:10.4f} "
              f"{r['bpe_quantized']:12.3f} {r['bpe_overall']:10.3f}")


# ------------------------------------------------------------------------------ CLI
def add_kv_report_command(sub) -> argparse.ArgumentParser:
    """The ``kv-report`` subcommand and its arguments, on the subparsers ``sub``."""
    from .args import add_command

    return add_command(sub, "kv-report", help=KV_REPORT_HELP, description=KV_REPORT_DESCRIPTION,
                       arguments=add_kv_report_arguments)


def add_kv_report_arguments(p: argparse.ArgumentParser) -> None:
    from .args import int_at_least

    p.add_argument("--tokens", type=int_at_least(2), default=1024,
                   help="tokens per text window (default 1024)")
    p.add_argument("--windows", type=int_at_least(1), default=2,
                   help="text windows averaged (default 2)")


def kv_report_command(args: argparse.Namespace) -> int:
    """Run ``kvarn-compile kv-report`` with checked ``args``: the table, and the JSON file."""
    import torch

    from .args import write_json

    torch.set_grad_enabled(False)
    rep = kv_report(args.model, tokens=args.tokens, windows=args.windows, corpus=args.corpus,
                    progress=not args.no_progress)
    print_kv_report(rep)
    if args.json:
        write_json(args.json, {"kv_report": rep})
    return 0
