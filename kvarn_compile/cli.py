"""``kvarn-compile``: the command line.

    kvarn-compile run          # the main job: real model, real text, KVarN cache vs fp
    kvarn-compile kv-report    # quantizer report on the real model's captured K/V
    kvarn-compile eval         # quality evaluation: static vs pseudo-decode, diagnostics
    kvarn-compile autotune export|import PATH   # the kernel autotune database as JSON

``run`` loads the default model (SmolLM2-135M-Instruct), compiles it with
``kvarn_backend`` and generates a continuation of real news text, then prints KV bytes
(fp16 vs KVarN, from live tensors), bits per element, tokens/s and agreement with the
uncompressed model (teacher-forced top-1 agreement and KL on the generated positions, plus
the first divergence of free-running greedy decoding); see ``main_job.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import torch

from kvarn_compile.config import METHODS, PRESETS, get_config

__all__ = ["main", "kv_report"]


# ------------------------------------------------------------------------------ kv-report
def kv_report(model_name: str | None = None, *, tokens: int = 1024, windows: int = 2,
              corpus: str = "lee", progress: bool = True) -> dict[str, Any]:
    """Capture K/V of the real model on real text; quantize with every preset and method.

    Reports, per (preset, method): the mean relative round-trip error ||x̂ - x|| / ||x||
    of K and of V over all layers and windows (quantized region only), and the bits per
    element of the quantized region and of the whole cache, counted from the packed tensors.
    """
    from tqdm import tqdm

    from kvarn_compile.eval.models import capture_kv, load_model, text_windows
    from kvarn_compile.reference import quantize_cache

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
    return {"model": model_name or "smollm2-135m-instruct", "corpus": corpus, "tokens": tokens,
            "windows": windows, "head_dim": kv[0][0][0].shape[-1], "rows": rows}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _print_kv_report(rep: dict[str, Any]) -> None:
    print(f"\nK/V round trip on {rep['model']} ({rep['windows']} x {rep['tokens']} tokens of "
          f"'{rep['corpus']}', head_dim {rep['head_dim']}, quantized region only)")
    print(f"{'preset':10} {'method':9} {'K rel err':>10} {'V rel err':>10} {'bpe (tiles)':>12} {'bpe (all)':>10}")
    for r in rep["rows"]:
        print(f"{r['preset']:10} {r['method']:9} {r['k_rel_err']:10.4f} {r['v_rel_err']:10.4f} "
              f"{r['bpe_quantized']:12.3f} {r['bpe_overall']:10.3f}")


# ------------------------------------------------------------------------------ entry
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvarn-compile", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="the main job: KVarN cache vs fp on the real model")
    p_run.add_argument("--model", default=None, help="local HF model folder (default: SmolLM2-135M)")
    p_run.add_argument("--preset", default="k4v2", choices=sorted(PRESETS))
    p_run.add_argument("--prompt-tokens", type=int, default=1536)
    p_run.add_argument("--new-tokens", type=int, default=128)
    p_run.add_argument("--skip-kv-report", action="store_true")
    p_run.add_argument("--compiler", default="inductor", choices=["inductor", "eager"],
                       help="what runs the rewritten graphs (eager: no Inductor compile)")
    p_kv = sub.add_parser("kv-report", help="quantizer error and bpe on captured K/V")
    p_kv.add_argument("--model", default=None)
    p_kv.add_argument("--tokens", type=int, default=1024)
    p_kv.add_argument("--windows", type=int, default=2)
    for p in (p_run, p_kv):
        p.add_argument("--corpus", default="lee")
        p.add_argument("--json", default=None, help="also write the results to this JSON file")
        p.add_argument("--no-progress", action="store_true")
    from kvarn_compile.eval.cli import EVAL_HELP, add_eval_arguments, eval_main
    add_eval_arguments(sub.add_parser("eval", help=EVAL_HELP))
    from kvarn_compile.autotune import add_cli_arguments as add_autotune_arguments
    add_autotune_arguments(sub.add_parser("autotune", help="export/import kernel autotune results"))
    args = parser.parse_args(argv)
    if args.command == "autotune":
        from kvarn_compile.autotune import cli_main as autotune_main
        return autotune_main(args)
    torch.set_grad_enabled(False)
    if args.command == "eval":
        return eval_main(args)

    results: dict[str, Any] = {}
    if args.command == "kv-report" or (args.command == "run" and not args.skip_kv_report):
        rep = kv_report(args.model, tokens=getattr(args, "tokens", 1024),
                        windows=getattr(args, "windows", 1 if args.command == "run" else 2),
                        corpus=args.corpus, progress=not args.no_progress)
        _print_kv_report(rep)
        results["kv_report"] = rep
    if args.command == "run":
        from kvarn_compile.eval.main_job import print_main_job, run_main_job

        res = run_main_job(args.model, preset=args.preset, prompt_tokens=args.prompt_tokens,
                           new_tokens=args.new_tokens, corpus=args.corpus, compiler=args.compiler,
                           progress=not args.no_progress)
        print_main_job(res)
        results["main"] = res
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    return 0


if __name__ == "__main__":
    sys.exit(main())
