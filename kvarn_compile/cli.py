"""``kvarn-compile``: the command line.

    kvarn-compile run          # the main job: real model, real text, KVarN cache vs fp
    kvarn-compile kv-report    # quantizer report on the real model's captured K/V

``run`` loads the default model (SmolLM2-135M-Instruct), prefills a window of real news
text, then decodes greedily through the packed KVarN cache and through an uncompressed
cache, and prints KV bytes (fp16 vs KVarN, from live tensors), bits per element, tokens/s
and agreement with the uncompressed model (teacher-forced top-1 agreement and KL on the
generated positions, plus the first divergence of free-running greedy decoding).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import torch

from kvarn_compile.config import METHODS, PRESETS, get_config

__all__ = ["main", "kv_report", "run_main_job"]


# ------------------------------------------------------------------------------ kv-report
def kv_report(model_name: str | None = None, *, tokens: int = 1024, windows: int = 2,
              corpus: str = "lee", progress: bool = True) -> dict[str, Any]:
    """Capture K/V of the real model on real text; quantize with every preset and method.

    Reports, per (preset, method): the mean relative round-trip error ||x̂ - x|| / ||x||
    of K and of V over all layers and windows (quantized region only), and the bits per
    element of the quantized region and of the whole cache, counted from the packed tensors.
    """
    from tqdm import tqdm

    from kvarn_compile.models import capture_kv, load_model, text_windows
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
                cache = quantize_cache(k, v, cfg)
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


# ------------------------------------------------------------------------------ main job
@torch.no_grad()
def run_main_job(model_name: str | None = None, *, preset: str = "k4v2", prompt_tokens: int = 1536,
                 new_tokens: int = 128, corpus: str = "lee", progress: bool = True) -> dict[str, Any]:
    """Decode real text through the KVarN cache and through an fp cache; compare."""
    from tqdm import tqdm
    from transformers import DynamicCache

    from kvarn_compile.hf import KVarNCache, use_kvarn_attention
    from kvarn_compile.models import load_model, text_windows
    from kvarn_compile.state import fp16_cache_bytes

    model, tok = load_model(model_name)
    cfg = get_config(preset)
    ids = text_windows(tok, 1, prompt_tokens, corpus)
    text_cfg = model.config.get_text_config(decoder=True)
    max_len = prompt_tokens + new_tokens

    def decode(cache, forced: torch.Tensor | None, desc: str):
        """Greedy decode (or teacher-forced when ``forced`` is given): logits per new token."""
        t0 = time.perf_counter()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        prefill_s = time.perf_counter() - t0
        logits, tokens = [out.logits[:, -1].float()], []
        t0 = time.perf_counter()
        for i in tqdm(range(new_tokens), desc=desc, disable=not progress, file=sys.stderr):
            nxt = logits[-1].argmax(-1, keepdim=True) if forced is None else forced[:, i:i + 1]
            tokens.append(nxt)
            if i + 1 < new_tokens:
                out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                logits.append(out.logits[:, -1].float())
        decode_s = time.perf_counter() - t0
        return torch.stack(logits, 1), torch.cat(tokens, 1), prefill_s, decode_s

    fp_logits, fp_tokens, fp_prefill, fp_decode = decode(DynamicCache(config=model.config), None,
                                                         "uncompressed")
    use_kvarn_attention(model)
    free_cache = KVarNCache(model.config, max_cache_len=max_len, preset=cfg)
    _, kv_tokens, kv_prefill, kv_decode = decode(free_cache, None, f"kvarn {preset}")
    forced_cache = KVarNCache(model.config, max_cache_len=max_len, preset=cfg)
    kv_logits, _, _, _ = decode(forced_cache, fp_tokens, f"kvarn {preset} (teacher-forced)")
    model.set_attn_implementation("sdpa")

    logp_fp = torch.log_softmax(fp_logits, -1)
    logp_kv = torch.log_softmax(kv_logits, -1)
    kl = (logp_fp.exp() * (logp_fp - logp_kv)).sum(-1)                  # [1, new_tokens]
    agree = (fp_logits.argmax(-1) == kv_logits.argmax(-1)).float()
    same = (kv_tokens == fp_tokens)[0]
    first_div = int((~same).nonzero()[0]) if bool((~same).any()) else new_tokens

    tokens_held = max_len - 1
    fp16_bytes = fp16_cache_bytes(batch=1, kv_heads=text_cfg.num_key_value_heads,
                                  head_dim=model.config.head_dim if hasattr(model.config, "head_dim")
                                  else text_cfg.hidden_size // text_cfg.num_attention_heads,
                                  tokens=tokens_held) * text_cfg.num_hidden_layers
    used = forced_cache.used_bytes()
    elements = fp16_bytes // 2
    return {
        "model": model_name or "smollm2-135m-instruct", "preset": preset, "config": cfg.short(),
        "corpus": corpus, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "kv_bytes": {"fp16": fp16_bytes, "kvarn_allocated": forced_cache.nbytes,
                     "kvarn_used": sum(used.values()), "kvarn_by_region": used},
        "compression_vs_fp16": fp16_bytes / sum(used.values()),
        "bpe_overall": 8 * sum(used.values()) / elements,
        "bpe_tiles": _tile_bpe(forced_cache),
        "tokens_per_s": {"uncompressed": new_tokens / fp_decode, "kvarn": new_tokens / kv_decode},
        "prefill_s": {"uncompressed": fp_prefill, "kvarn": kv_prefill},
        "agreement": {"teacher_forced_top1": agree.mean().item(), "kl_mean": kl.mean().item(),
                      "kl_max": kl.max().item(), "greedy_first_divergence": first_div,
                      "greedy_token_match": same.float().mean().item()},
        "sample": {"uncompressed": tok.decode(fp_tokens[0, :48]), "kvarn": tok.decode(kv_tokens[0, :48])},
    }


def _tile_bpe(cache) -> float | None:
    state = cache.layers[0].state
    if int(state.n_tiles.max()) == 0:
        return None
    g, d = state.config.group_size, state.head_dim
    per_tile = sum(state.buffers[i][0, 0, 0].numel() * state.buffers[i].element_size()
                   for i in range(2, 10))
    return 8 * per_tile / (2 * g * d)


def _print_main(res: dict[str, Any]) -> None:
    kb, a, tps = res["kv_bytes"], res["agreement"], res["tokens_per_s"]
    mib = lambda b: f"{b / 2**20:8.2f} MiB"  # noqa: E731
    print(f"\nKVarN {res['config']} on {res['model']}: {res['prompt_tokens']}-token prompt of "
          f"'{res['corpus']}' + {res['new_tokens']} generated tokens")
    print(f"  KV cache   fp16 {mib(kb['fp16'])} | KVarN {mib(kb['kvarn_used'])} in use "
          f"({res['compression_vs_fp16']:.2f}x smaller), {mib(kb['kvarn_allocated'])} allocated")
    print(f"  bits/elem  {res['bpe_overall']:.3f} overall (sink + tiles + tail), "
          f"{res['bpe_tiles'] or float('nan'):.3f} in the packed tiles")
    print(f"  speed      {tps['uncompressed']:.1f} tok/s uncompressed | {tps['kvarn']:.1f} tok/s KVarN "
          f"(eager reference kernels on this device)")
    print(f"  quality    teacher-forced top-1 agreement {a['teacher_forced_top1']:.3f}, "
          f"KL {a['kl_mean']:.4f} nats/token (max {a['kl_max']:.3f}); greedy streams agree for the "
          f"first {a['greedy_first_divergence']} tokens ({a['greedy_token_match']:.2f} of positions)")
    print(f"  fp16 : {res['sample']['uncompressed']!r}")
    print(f"  KVarN: {res['sample']['kvarn']!r}")


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
    p_kv = sub.add_parser("kv-report", help="quantizer error and bpe on captured K/V")
    p_kv.add_argument("--model", default=None)
    p_kv.add_argument("--tokens", type=int, default=1024)
    p_kv.add_argument("--windows", type=int, default=2)
    for p in (p_run, p_kv):
        p.add_argument("--corpus", default="lee")
        p.add_argument("--json", default=None, help="also write the results to this JSON file")
        p.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)

    results: dict[str, Any] = {}
    if args.command == "kv-report" or (args.command == "run" and not args.skip_kv_report):
        rep = kv_report(args.model, tokens=getattr(args, "tokens", 1024),
                        windows=getattr(args, "windows", 1 if args.command == "run" else 2),
                        corpus=args.corpus, progress=not args.no_progress)
        _print_kv_report(rep)
        results["kv_report"] = rep
    if args.command == "run":
        res = run_main_job(args.model, preset=args.preset, prompt_tokens=args.prompt_tokens,
                           new_tokens=args.new_tokens, corpus=args.corpus,
                           progress=not args.no_progress)
        _print_main(res)
        results["main"] = res
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    return 0


if __name__ == "__main__":
    sys.exit(main())
