"""CPU: one compiled decode step of the default model, kvarn_backend vs plain Inductor.

    python benchmarks/bench_e2e_decode_cpu.py [--lengths 2048 8192] [--steps 12] [--chunk 512]

For each context length, in the same process and run, two copies of the default model
(SmolLM2-135M, fp32, sdpa attention) are compiled:

* ``kvarn``: ``model.compile(backend=kvarn_backend("k4v2", compiler="inductor"))`` - the
  attention and cache writes rewritten to the kvarn ops, lowered by kvarn's Inductor
  lowering (extern reference vs Inductor-generated C++, autotuned), packed KVarN cache;
* ``inductor``: ``model.compile()`` (plain Inductor) over an fp32 ``StaticCache``.

Both get the same prompt prefilled in chunks of ``--chunk`` tokens through the compiled
model (a transformers ``StaticCache`` with ``early_initialization``), then ``--steps``
single-token decode steps, the two models taking turns step by step (which goes first
alternates), so that load from other processes hits both alike. Per step wall time; the
first two steps (compiling) are dropped; medians and p20/p80 are reported, with the ratio
inductor / kvarn of the medians and the median of the per-step ratios (> 1: kvarn is
faster). The machine may be shared: read the spread, not just the median. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import env  # noqa: E402


def _quantiles(times_ms: list[float]) -> dict:
    t = sorted(times_ms)
    q = lambda p: t[min(int(p * len(t)), len(t) - 1)]  # noqa: E731
    return {"ms_median": statistics.median(t), "ms_p20": q(0.2), "ms_p80": q(0.8), "steps": len(t)}


def _prefill(model, length: int, steps: int, chunk: int, seed: int):
    """(cache, decode tokens, seconds): the prompt prefilled in chunks through the model."""
    from transformers import StaticCache

    c = model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cache = StaticCache(config=c, max_cache_len=length + steps)
    cache.early_initialization(1, heads, dim, torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, c.vocab_size, (1, length), generator=g)
    t0 = time.perf_counter()
    for start in range(0, length, chunk):
        ids = prompt[:, start:start + chunk]
        model(input_ids=ids, cache=cache, use_cache=True,
              cache_position=torch.arange(start, start + ids.shape[1]))
    tokens = torch.randint(2, c.vocab_size, (steps, 1, 1), generator=g)
    return cache, tokens, time.perf_counter() - t0


def _step(model, cache, token: torch.Tensor, position: int) -> float:
    t0 = time.perf_counter()
    model(input_ids=token, cache=cache, use_cache=True,
          cache_position=torch.tensor([position]))
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--preset", default="k4v2")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)

    from kvarn_compile import kvarn_backend, lowering
    from kvarn_compile.eval.models import load_model

    rows = []
    for length in args.lengths:
        row: dict = {"tokens": length, "chunk": args.chunk}
        torch._dynamo.reset()
        kvarn_model, _ = load_model()
        backend = kvarn_backend(args.preset, max_cache_len=length + args.steps, compiler="inductor")
        kvarn_model.compile(backend=backend)
        plain_model, _ = load_model()
        plain_model.compile()
        first = len(lowering.DECISIONS)
        sides = {"kvarn": kvarn_model, "inductor": plain_model}
        state = {name: _prefill(m, length, args.steps, args.chunk, seed=length)
                 for name, m in sides.items()}
        times: dict[str, list[float]] = {name: [] for name in sides}
        for i in range(args.steps):     # interleaved, the first side alternating
            for name in (("kvarn", "inductor") if i % 2 == 0 else ("inductor", "kvarn")):
                cache, tokens, _ = state[name]
                times[name].append(_step(sides[name], cache, tokens[i], length + i))
        for name in sides:
            row[name] = {"prefill_s_incl_compile": state[name][2], "first_steps_ms": times[name][:2],
                         **_quantiles(times[name][2:])}
        row["kvarn"]["sites_rewritten"] = len(backend.report.rewritten)
        row["kvarn"]["state_bytes"] = backend.nbytes
        winners: dict[str, int] = {}
        for d in lowering.DECISIONS[first:]:
            label = f"{d.op}:{d.key.split('query=')[-1].split('|')[0]}:{d.winner}" + (
                " (replayed)" if d.replayed else "")
            winners[label] = winners.get(label, 0) + 1
        row["kvarn"]["lowering_winners"] = winners
        del kvarn_model, plain_model, backend, sides, state
        row["inductor_over_kvarn"] = row["inductor"]["ms_median"] / row["kvarn"]["ms_median"]
        row["per_step_ratio_median"] = statistics.median(
            i / k for i, k in zip(times["inductor"][2:], times["kvarn"][2:]))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "e2e_decode_cpu", "env": env(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
