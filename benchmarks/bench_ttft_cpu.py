"""CPU: time to first token (prefill) of the default model, kvarn_backend vs plain Inductor.

    python benchmarks/bench_ttft_cpu.py [--lengths 2048 8192] [--chunk 512] [--repeats 3]

For each prompt length, in the same process and run, two copies of the default model
(SmolLM2-135M, fp32, sdpa attention) are compiled: ``kvarn``
(``model.compile(backend=kvarn_backend("k4v2", compiler="inductor"))``, packed cache) and
``inductor`` (``model.compile()``, plain Inductor over an fp32 ``StaticCache``). Each is
timed on:

* ``one_shot``: the whole prompt in one forward, through HF ``generate`` with
  ``max_new_tokens=1`` (the time to the first token);
* ``chunked``: the prompt prefilled in chunks of ``--chunk`` tokens; ``chunk_after_past_s``
  is the last chunk alone (``--chunk`` queries after a packed past of length - chunk).

Each side runs in its own fresh process (neither inherits the other's in-memory caches or
warmed-up process). ``incl_compile_s``: the first run of a fresh compiled model; with
``--cold`` each side's process gets its own empty Inductor cache folder, so it is a cold
compile for both (without it, the on-disk caches are as the machine has them, which can
favour a side whose graphs were compiled before). ``s_median``
/ ``s_min`` / ``s_max``: ``--repeats`` further runs over a fresh cache each (compile
excluded). ``ratio_*``: kvarn / inductor (< 1: kvarn is faster). The machine may be
shared: read the spread. Prints JSON (one line per length on stderr as it goes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import env  # noqa: E402


def _cache(model, max_len: int):
    from transformers import StaticCache

    c = model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cache = StaticCache(config=c, max_cache_len=max_len)
    cache.early_initialization(1, heads, dim, torch.float32, "cpu")
    return cache


def _one_shot(model, prompt: torch.Tensor, max_len: int) -> float:
    cache = _cache(model, max_len)
    t0 = time.perf_counter()
    model.generate(prompt, attention_mask=torch.ones_like(prompt), cache=cache,
                   max_new_tokens=1, do_sample=False)
    return time.perf_counter() - t0


def _chunked(model, prompt: torch.Tensor, chunk: int, max_len: int) -> tuple[float, float]:
    cache = _cache(model, max_len)
    length = prompt.shape[1]
    t0 = time.perf_counter()
    last = 0.0
    for start in range(0, length, chunk):
        ids = prompt[:, start:start + chunk]
        t1 = time.perf_counter()
        model(input_ids=ids, cache=cache, use_cache=True,
              cache_position=torch.arange(start, start + ids.shape[1]))
        last = time.perf_counter() - t1
    return time.perf_counter() - t0, last


def _spread(xs: list[float]) -> dict:
    return {"s_median": statistics.median(xs), "s_min": min(xs), "s_max": max(xs), "runs": len(xs)}


def _side(kind: str, length: int, args) -> dict:
    from kvarn_compile import kvarn_backend
    from kvarn_compile.eval.models import load_model

    max_len = length + 16
    out: dict = {}
    for mode in args.modes:
        torch._dynamo.reset()
        model, _ = load_model()
        prompt = torch.randint(2, model.config.vocab_size, (1, length),
                               generator=torch.Generator().manual_seed(length))
        if kind == "kvarn":
            model.compile(backend=kvarn_backend(args.preset, max_cache_len=max_len, compiler="inductor"))
        else:
            model.compile()
        if mode == "one_shot":
            first = _one_shot(model, prompt, max_len)
            runs = [_one_shot(model, prompt, max_len) for _ in range(args.repeats)]
            out["one_shot"] = {"incl_compile_s": first, **_spread(runs)}
        else:
            first, _ = _chunked(model, prompt, args.chunk, max_len)
            runs = [_chunked(model, prompt, args.chunk, max_len) for _ in range(args.repeats)]
            out["chunked"] = {"incl_compile_s": first, **_spread([r[0] for r in runs]),
                              "chunk_after_past_s": _spread([r[1] for r in runs])}
        del model
    return out


def _side_in_process(kind: str, length: int, argv: list[str], cold: bool) -> dict:
    """:func:`_side` in a fresh Python process (an empty Inductor cache folder when cold)."""
    env_vars = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="kvarn-ttft-") as tmp:
        if cold:
            env_vars["TORCHINDUCTOR_CACHE_DIR"] = tmp
        cmd = [sys.executable, __file__, *argv, "--lengths", str(length), "--side", kind]
        done = subprocess.run(cmd, env=env_vars, stdout=subprocess.PIPE, check=True, text=True)
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=["chunked", "one_shot"], choices=["chunked", "one_shot"])
    p.add_argument("--preset", default="k4v2")
    p.add_argument("--cold", action="store_true",
                   help="an empty Inductor cache folder for each side (a cold compile for both)")
    p.add_argument("--side", choices=["kvarn", "inductor"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.side:       # one side, in this process (what the parent runs per side)
        print(json.dumps(_side(args.side, args.lengths[0], args)))
        return 0

    passed = ["--chunk", str(args.chunk), "--repeats", str(args.repeats), "--modes", *args.modes,
              "--preset", args.preset]
    rows = []
    for length in args.lengths:
        row: dict = {"tokens": length, "chunk": args.chunk, "cold_compile": args.cold}
        for kind in ("kvarn", "inductor"):
            row[kind] = _side_in_process(kind, length, passed, args.cold)
        for mode in args.modes:
            k, i = row["kvarn"][mode], row["inductor"][mode]
            row[f"ratio_{mode}"] = k["s_median"] / i["s_median"]
            row[f"ratio_{mode}_incl_compile"] = k["incl_compile_s"] / i["incl_compile_s"]
            if mode == "chunked":
                row["ratio_chunk_after_past"] = (k["chunk_after_past_s"]["s_median"]
                                                 / i["chunk_after_past_s"]["s_median"])
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "ttft_cpu", "env": env(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
