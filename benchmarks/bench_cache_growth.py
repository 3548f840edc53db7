"""Bytes of the packed KV states of a growing transformers DynamicCache, against fp16.

    python benchmarks/bench_cache_growth.py [--max 4096] [--chunk 64] [--first 1]
                                             [--early 320] [--decode 300]
                                             [--compiler eager|inductor]

The default model (SmolLM2-135M, fp32, sdpa) is compiled with
``kvarn_backend(preset, max_cache_len=8192)`` and fed random tokens through a
``DynamicCache`` (a ``cat`` cache: the model preallocates nothing): first ``--first`` tokens,
single-token steps up to ``--early`` tokens (every length of the short-sequence region: sink,
tail, first tiles), then chunks of ``--chunk`` tokens up to ``--max``, then ``--decode``
single-token steps.
After every call it records, for all layers together: the bytes the packed states hold
(``backend.nbytes``, every live tensor: sink, tiles, tail, counters), the bytes that hold
tokens (``used_bytes``: sink + filled tiles + tail), the fp16 K+V bytes of the same tokens,
and what a state preallocated for ``max_cache_len`` holds (the behaviour before growable
states). The summary gives the lengths where the states hold more than fp16 would, the
largest excess, the same beyond the states' fixed counters (4 int64 per layer and batch
row: ``counter_bytes``), and the lengths where the bytes that hold tokens exceed fp16's. Also: how many graphs the backend compiled (growth never recompiles) and how many
times the states reallocated their tiles. ``--compiler eager`` (default) runs the rewritten
graphs as they are; ``inductor`` compiles them (same bytes, minutes of compile on 2 cores).
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import env  # noqa: E402


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max", type=_positive, default=4096, help="tokens fed in chunks (default 4096)")
    p.add_argument("--chunk", type=_positive, default=64)
    p.add_argument("--first", type=_positive, default=1, help="tokens of the first call")
    p.add_argument("--early", type=int, default=320,
                   help="single-token steps after the first call up to this many tokens")
    p.add_argument("--decode", type=int, default=300, help="single-token steps after the chunks")
    p.add_argument("--preset", default="k4v2")
    p.add_argument("--max-cache-len", type=_positive, default=8192)
    p.add_argument("--compiler", choices=("eager", "inductor"), default="eager")
    args = p.parse_args(argv)
    if args.first > args.max or args.early > args.max or args.max + max(args.decode, 0) > args.max_cache_len:
        p.error("expected --first <= --max, --early <= --max and --max + --decode <= --max-cache-len")
    torch.set_grad_enabled(False)

    import transformers as tf

    from kvarn_compile import kvarn_backend
    from kvarn_compile.eval.models import load_model
    from kvarn_compile.hf import kv_geometry
    from kvarn_compile.state import allocate_layer, fp16_cache_bytes

    model, _ = load_model()
    heads, dim = kv_geometry(model)
    layers = model.config.num_hidden_layers
    backend = kvarn_backend(args.preset, max_cache_len=args.max_cache_len, compiler=args.compiler)
    model.compile(backend=backend)
    prealloc = layers * allocate_layer(backend.config, batch=1, kv_heads=heads, head_dim=dim,
                                       max_len=args.max_cache_len, dtype=torch.float32,
                                       device="meta").nbytes
    cache = tf.DynamicCache(config=model.config)
    ids = torch.randint(2, model.config.vocab_size, (1, args.max + max(args.decode, 0)),
                        generator=torch.Generator().manual_seed(0))
    early = max(args.first, args.early)
    cuts = [0] + list(range(args.first, early + 1))
    cuts += list(range(early + args.chunk, args.max, args.chunk)) + [args.max] * (args.max > early)
    cuts += list(range(args.max + 1, args.max + max(args.decode, 0) + 1))
    rows = []
    t0 = time.perf_counter()
    for a, b in zip(cuts, cuts[1:]):
        model(input_ids=ids[:, a:b], cache=cache, use_cache=True)
        states = list(backend.states.values())
        used = sum(sum(s.used_bytes().values()) for s in states)
        fp16 = layers * fp16_cache_bytes(batch=1, kv_heads=heads, head_dim=dim, tokens=b)
        rows.append({"tokens": b, "kvarn_bytes": backend.nbytes, "kvarn_used_bytes": used,
                     "fp16_bytes": fp16, "fp16_over_kvarn": fp16 / backend.nbytes,
                     "preallocated_bytes": prealloc,
                     "reallocations": sum(s.version for s in states)})
    elapsed = time.perf_counter() - t0
    above = [r["tokens"] for r in rows if r["kvarn_bytes"] > r["fp16_bytes"]]
    counters = layers * 4 * 8           # lengths, committed, n_tiles, capacity: int64 [batch=1]
    summary = {
        "graphs_compiled": backend.report.graphs,
        "sites_rewritten": len(backend.report.rewritten),
        "calls": len(rows),
        "reallocations": rows[-1]["reallocations"],
        "lengths_above_fp16": [min(above), max(above)] if above else [],
        "max_bytes_above_fp16": max(0, *(r["kvarn_bytes"] - r["fp16_bytes"] for r in rows)),
        "counter_bytes": counters,
        "lengths_above_fp16_beyond_counters": [r["tokens"] for r in rows
                                               if r["kvarn_bytes"] > r["fp16_bytes"] + counters],
        "lengths_token_bytes_above_fp16": [r["tokens"] for r in rows
                                           if r["kvarn_used_bytes"] > r["fp16_bytes"]],
        "first_length_at_or_below_fp16_for_good": next(
            (r["tokens"] for i, r in enumerate(rows)
             if all(x["kvarn_bytes"] <= x["fp16_bytes"] for x in rows[i:])), None),
        "at_max": rows[-1],
        "seconds": elapsed,
    }
    print(json.dumps({"benchmark": "cache_growth", "env": env(), "preset": args.preset,
                      "compiler": args.compiler, "max_cache_len": args.max_cache_len,
                      "summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
