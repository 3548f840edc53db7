"""Which part of KVarN helps or hurts on a real model: a pseudo-decode ablation.

    python benchmarks/ablate_kvarn.py [--preset k2v2] [--length 2048] [--windows 4]
                                      [--corpora lee enwiki] [--variants ...]

Every variant is Hadamard-rotated RTN with some of KVarN's pieces switched on: the variance
normalization on keys only or values only, other iteration counts, fp32 scale storage, the
reference's -0.3 log-scale floor removed. Each runs the paper's pseudo-decode (blocks of 128,
``after_block``) on the default real model over ``--windows`` windows of every corpus and is
compared *paired per window* with plain Hadamard (mean KL difference and its standard error),
so a difference smaller than the window-to-window noise shows as such.

Also prints, per variant, how the key/value error of the full-precision cache (quantized once)
splits into magnitude and direction parts, and the mean relative token-norm error, from
``kvarn_compile.eval.diagnostics.error_terms``.

Prints JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from _common import env
from kvarn_compile.config import PRESETS, get_config
from kvarn_compile.eval.diagnostics import error_terms
from kvarn_compile.eval.harness import PseudoQuantCache, fp_reference, pseudo_decode_metrics
from kvarn_compile.eval.suite import paired_difference
from kvarn_compile.eval.models import load_model, text_windows
from kvarn_compile.quant import fake_quantize
from kvarn_compile.quant import quantize as qmod

#: name -> (key overrides, value overrides, reference-constant patches). An override dict
#: replaces fake_quantize keyword arguments for that kind; "method" is hadamard unless given.
VARIANTS: dict[str, tuple[dict, dict, dict]] = {
    "hadamard": ({}, {}, {}),
    "kvarn": ({"method": "kvarn"}, {"method": "kvarn"}, {}),
    "kvarn_keys_only": ({"method": "kvarn"}, {}, {}),
    "kvarn_values_only": ({}, {"method": "kvarn"}, {}),
    "kvarn_t1": ({"method": "kvarn", "iters": 1}, {"method": "kvarn", "iters": 1}, {}),
    "kvarn_t16": ({"method": "kvarn", "iters": 16}, {"method": "kvarn", "iters": 16}, {}),
    "kvarn_fp32_scales": ({"method": "kvarn", "scale_dtype": torch.float32},
                          {"method": "kvarn", "scale_dtype": torch.float32}, {}),
    "hadamard_fp32_scales": ({"scale_dtype": torch.float32}, {"scale_dtype": torch.float32}, {}),
    "kvarn_no_floor": ({"method": "kvarn"}, {"method": "kvarn"},
                       {"LOG_SCALE_CLIP": (-10.0, 10.0)}),
}


@contextlib.contextmanager
def patched(constants: dict):
    old = {name: getattr(qmod, name) for name in constants}
    for name, value in constants.items():
        setattr(qmod, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(qmod, name, value)


def make_quantizer(variant: str):
    k_over, v_over, constants = VARIANTS[variant]

    def quantizer(x, *, kind, **kwargs):
        kwargs = {**kwargs, "method": "hadamard", **(k_over if kind == "k" else v_over)}
        with patched(constants):
            return fake_quantize(x, kind=kind, **kwargs)

    return quantizer


def error_split(kv, quantizer, config, sink: int, length: int) -> dict:
    """Magnitude/direction split of the quantized-once error of tokens [sink, length)."""
    out = {}
    for kind, idx, bits in (("k", 0, config.key_bits), ("v", 1, config.value_bits)):
        tot = mag = rel = count = 0.0
        for layer in kv:
            x = layer[idx][..., sink:length, :].float()
            x_hat = quantizer(x, kind=kind, method=config.method, bits=bits,
                              group=config.group_size, iters=config.sinkhorn_iters,
                              scale_dtype=config.scale_dtype)
            t, m, _ = error_terms(x, x_hat)
            norms = x.double().flatten(0, -2).norm(dim=-1)
            tot += float(t.sum())
            mag += float(m.sum())
            rel += float((m.sqrt() / norms.clamp_min(1e-12)).sum())
            count += norms.numel()
        out[kind] = {"rel_sq_error": tot, "magnitude_share": mag / tot if tot else 0.0,
                     "mean_rel_norm_error": rel / count}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="k2v2", choices=sorted(PRESETS))
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--corpora", nargs="+", default=["lee", "enwiki"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    if args.windows < 1 or args.length <= args.block or args.block < 1:
        parser.error(f"expected --windows >= 1 and --length > --block >= 1, got {args.windows}, "
                     f"{args.length}, {args.block}")
    if "hadamard" not in args.variants:
        args.variants.insert(0, "hadamard")   # the paired baseline

    config = get_config(args.preset)
    sink = config.sink
    model, tokenizer = load_model()
    t0 = time.perf_counter()
    per_window: dict[str, list[float]] = {v: [] for v in args.variants}
    splits: dict[str, list[dict]] = {v: [] for v in args.variants}
    windows = []
    for corpus in args.corpora:
        ids_all = text_windows(tokenizer, args.windows, args.length, corpus)
        for w in range(args.windows):
            ids = ids_all[w:w + 1]
            ref, kv = fp_reference(model, ids)
            windows.append(f"{corpus}:{w * args.length}")
            for v in args.variants:
                quantizer = make_quantizer(v)
                cache = PseudoQuantCache(model, config, rule="after_block", quantizer=quantizer)
                kl, _ = pseudo_decode_metrics(model, ids, ref, cache, args.block)
                per_window[v].append(float(kl[sink:].mean()))
                splits[v].append(error_split(kv, quantizer, config, sink, args.length))

    n = len(windows)
    results = {}
    for v in args.variants:
        paired = paired_difference(per_window[v], per_window["hadamard"])
        split = {kind: {key: sum(s[kind][key] for s in splits[v]) / n
                        for key in ("rel_sq_error", "magnitude_share", "mean_rel_norm_error")}
                 for kind in ("k", "v")}
        results[v] = {"pseudo_kl": sum(per_window[v]) / n, "pseudo_kl_windows": per_window[v],
                      "diff_vs_hadamard": paired["mean_diff"], "diff_se": paired["se"],
                      "windows_better_than_hadamard": paired["lower_in"],
                      "error_split": split}
    print(json.dumps({"benchmark": "ablate_kvarn", "env": env(), "preset": args.preset,
                      "length": args.length, "block": args.block, "sink": sink,
                      "windows": windows, "seconds": time.perf_counter() - t0,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
