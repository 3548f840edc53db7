"""GPU: compiled decode of a Llama-shaped model, kvarn_backend vs plain torch.compile, CUDA graphs.

    python benchmarks/gpu/e2e_decode.py [--lengths 4096 32768] [--steps 24] [--preset k4v2]
        [--mode reduce-overhead] [--dtype bfloat16] [--out FILE]

One process, one model shape (Llama, hidden 2048, 16 query / 4 KV heads of dim 128, 8 layers (``--layers``),
random weights with a fixed seed: speed does not depend on the weights), for each context
length in turn:

* ``plain``: ``model.compile(mode=MODE)`` over a transformers ``StaticCache`` in ``--dtype``;
* ``kvarn``: ``model.compile(backend=kvarn_backend(PRESET, mode=MODE))``: the attention and cache
  writes rewritten to the kvarn ops, the cache packed.

Both get the same prompt (prefilled in chunks of ``--chunk`` tokens), then ``--steps``
teacher-forced single-token decode steps with the same tokens. Reported per side: prefill
seconds including compile, the first two steps (compile, graph capture), then the median,
p20 and p80 of the remaining steps (CUDA-synchronized wall time), and ``plain_over_kvarn``
(> 1: kvarn is faster), with ``--profile-steps N`` the GPU kernels of N more steps
(launches and time per step, the top 25 by time), and ``cudagraph_skips``: graphs CUDA graphs did not capture (run
with ``TORCH_LOGS=perf_hints`` for the reasons). ``logits_rel_diff`` is the largest difference between the two sides'
decode logits over the largest plain logit: with random weights it checks that the packed path
computes the same model, not quality (``kvarn-compile eval`` measures quality).

JSON goes to stdout and, rewritten after every row, to ``--out``. Without a CUDA device it
prints ``{"skipped": "no CUDA device"}`` and exits 0.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time

import torch


def _model(dtype, layers: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                      vocab_size=32000, max_position_embeddings=200_000)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def _cache_kw(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _kernels_per_step(run_step, n: int, device: str) -> list[dict]:
    """The GPU kernels of ``n`` more decode steps under torch.profiler (kernels replayed by a
    CUDA graph are traced too): name, launches and microseconds per step, most time first."""
    from torch.profiler import ProfilerActivity, profile

    if device != "cuda" or n <= 0:
        return []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            run_step(i)
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        r = rows.setdefault(e.name[:120], {"kernel": e.name[:120], "per_step": 0.0, "us_per_step": 0.0})
        r["per_step"] += 1 / n
        r["us_per_step"] += e.time_range.elapsed_us() / n
    out = sorted(rows.values(), key=lambda r: -r["us_per_step"])
    for r in out:
        r["per_step"], r["us_per_step"] = round(r["per_step"], 2), round(r["us_per_step"], 2)
    return out


def _run(model, length: int, steps: int, chunk: int, dtype, device: str,
         profile_steps: int = 0) -> dict:
    from transformers import StaticCache

    c = model.config
    cache = StaticCache(config=c, max_cache_len=length + steps + profile_steps)
    if hasattr(cache, "early_initialization"):
        cache.early_initialization(1, c.num_key_value_heads, c.head_dim, dtype, device)
    kw = _cache_kw(model)
    g = torch.Generator().manual_seed(length)
    prompt = torch.randint(2, c.vocab_size, (1, length), generator=g).to(device)
    tokens = torch.randint(2, c.vocab_size, (steps, 1, 1), generator=g).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for start in range(0, length, chunk):
        ids = prompt[:, start:start + chunk]
        model(input_ids=ids, use_cache=True, **{kw: cache},
              cache_position=torch.arange(start, start + ids.shape[1], device=device))
    sync()
    prefill_s = time.perf_counter() - t0
    times, logits = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        out = model(input_ids=tokens[i], use_cache=True, **{kw: cache},
                    cache_position=torch.tensor([length + i], device=device))
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        logits.append(out.logits[0, -1].float().clone())
    t = sorted(times[2:])
    q = lambda p: t[min(int(p * len(t)), len(t) - 1)]  # noqa: E731

    def more(i):
        model(input_ids=tokens[i % steps], use_cache=True, **{kw: cache},
              cache_position=torch.tensor([length + steps + i], device=device))

    kernels = _kernels_per_step(more, profile_steps, device)
    row = {"prefill_s_incl_compile": prefill_s, "first_steps_ms": times[:2],
           "ms_median": statistics.median(t), "ms_p20": q(0.2), "ms_p80": q(0.8),
           "steps": len(t), "_logits": torch.stack(logits)}
    if kernels:
        row["kernels_per_step"] = round(sum(k["per_step"] for k in kernels), 1)
        row["kernel_us_per_step"] = round(sum(k["us_per_step"] for k in kernels), 1)
        row["top_kernels"] = kernels[:25]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--preset", default="k4v2")
    p.add_argument("--mode", default="reduce-overhead")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    p.add_argument("--out", default=None)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="then profile this many more steps: GPU kernels per step, most time first")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype)
    from kvarn_compile import kvarn_backend

    result = {"benchmark": "e2e_decode_gpu", "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "preset": args.preset, "mode": args.mode,
              "dtype": args.dtype, "rows": []}

    def write():
        text = json.dumps(result, indent=1)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(text)
        return text

    for length in args.lengths:
        row: dict = {"tokens": length}
        result["rows"].append(row)
        for side in ("plain", "kvarn"):
            torch._dynamo.reset()
            model = _model(dtype, args.layers, args.device)
            try:
                if side == "plain":
                    model.compile(mode=args.mode)
                else:
                    backend = kvarn_backend(args.preset, mode=args.mode,
                                            max_cache_len=length + args.steps + args.profile_steps)
                    model.compile(backend=backend)
                skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
                row[side] = _run(model, length, args.steps, args.chunk, dtype, args.device,
                                 args.profile_steps)
                # graphs CUDA graphs skipped (the reasons: TORCH_LOGS=perf_hints)
                row[side]["cudagraph_skips"] = \
                    torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] - skips
                if side == "kvarn":
                    row[side]["sites_rewritten"] = len(backend.report.rewritten)
                    row[side]["state_bytes"] = backend.nbytes
                    row[side]["report"] = str(backend.report)[:3000]
            except Exception as err:  # noqa: BLE001 - reported, the next row still runs
                row[side] = {"error": f"{type(err).__name__}: {err}"[:1500]}
            del model
            if args.device == "cuda":
                torch.cuda.empty_cache()
        if "_logits" in row["plain"] and "_logits" in row["kvarn"]:
            a, b = row["plain"]["_logits"], row["kvarn"]["_logits"]
            row["logits_rel_diff"] = float((a - b).abs().max() / a.abs().max())
            row["plain_over_kvarn"] = row["plain"]["ms_median"] / row["kvarn"]["ms_median"]
        for side in ("plain", "kvarn"):
            row[side].pop("_logits", None)
        print(json.dumps(row), file=sys.stderr, flush=True)
        write()
    print(write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
