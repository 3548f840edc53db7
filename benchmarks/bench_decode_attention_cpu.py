"""CPU time of one decode step of kvarn::attention vs SDPA over an uncompressed cache,
and the cost of quantizing one completed tile as a share of the G decode steps that
filled it.

    python benchmarks/bench_decode_attention_cpu.py [--lengths 1024 4096 8192 16384 32768]
        [--threads 2] [--seconds 3] [--preset k4v2] [--shapes 3,9,64 8,32,128]

The KVarN side is the op as dispatched on this device (on CPU: the C++ decode kernel
where it applies and builds, else the pure-torch reference; ``KVARN_CPU_KERNEL=0`` forces
the reference); the baseline is torch's scaled_dot_product_attention (enable_gqa) over
fp32 and bf16 caches of the same length. The three are timed interleaved (one call of
each per round, rounds until ``--seconds`` have passed) so that load from other processes
hits them alike; the ratios of the medians are the result. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from _common import bench, env
from kvarn_compile.config import get_config
from kvarn_compile.ops import library as ops
from kvarn_compile.ops.append import append_
from kvarn_compile.state import allocate_layer


def _interleaved(fns: dict, seconds: float, min_rounds: int = 7, warmup: int = 2) -> dict:
    """Median / p20 / p80 ms of each fn, timed round-robin (one call of each per round)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    start = time.perf_counter()
    while len(times[next(iter(fns))]) < min_rounds or time.perf_counter() - start < seconds:
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    out = {}
    for name, ts in times.items():
        ts.sort()
        q = lambda p: ts[min(int(p * len(ts)), len(ts) - 1)]  # noqa: E731
        out[name] = {"ms_median": statistics.median(ts), "ms_p20": q(0.2), "ms_p80": q(0.8),
                     "reps": len(ts)}
    return out


def run(length: int, kv_heads: int, q_heads: int, head_dim: int, preset: str, seconds: float) -> dict:
    cfg = get_config(preset)
    st = allocate_layer(cfg, batch=1, kv_heads=kv_heads, head_dim=head_dim, max_len=length,
                        dtype=torch.float32)
    k = torch.randn(1, kv_heads, length, head_dim)
    v = torch.randn(1, kv_heads, length, head_dim)
    append_(st.buffers, k, v, torch.tensor([0]))
    q = torch.randn(1, q_heads, 1, head_dim)
    scale = head_dim ** -0.5
    row = {"tokens": length, "kv_heads": kv_heads, "q_heads": q_heads, "head_dim": head_dim,
           "preset": preset}
    k16, v16, q16 = k.bfloat16(), v.bfloat16(), q.bfloat16()
    row.update(_interleaved({
        "kvarn_attention": lambda: ops.attention(q, st.buffers, None, scale, True, 0),
        "sdpa_fp32": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "sdpa_bf16": lambda: F.scaled_dot_product_attention(q16, k16, v16, enable_gqa=True),
    }, seconds))
    kv_ms = row["kvarn_attention"]["ms_median"]
    row["ratio_vs_sdpa_fp32"] = kv_ms / row["sdpa_fp32"]["ms_median"]      # < 1: kvarn faster
    row["ratio_vs_sdpa_bf16"] = kv_ms / row["sdpa_bf16"]["ms_median"]
    # quantizing one completed tile (all kv heads of the layer) vs G decode steps
    g = cfg.group_size
    small = allocate_layer(cfg, batch=1, kv_heads=kv_heads, head_dim=head_dim, max_len=2 * g + 1,
                           dtype=torch.float32)
    prefix_k, prefix_v = torch.randn(1, kv_heads, 2 * g, head_dim), torch.randn(1, kv_heads, 2 * g, head_dim)
    last_k, last_v = torch.randn(1, kv_heads, 1, head_dim), torch.randn(1, kv_heads, 1, head_dim)

    def freeze_one_tile():
        append_(small.buffers, prefix_k[:, :, :2 * g - 1], prefix_v[:, :, :2 * g - 1], torch.tensor([0]))
        append_(small.buffers, last_k, last_v, torch.tensor([2 * g - 1]))   # completes tile 0

    def fill_only():
        append_(small.buffers, prefix_k[:, :, :2 * g - 1], prefix_v[:, :, :2 * g - 1], torch.tensor([0]))

    t_freeze = bench(freeze_one_tile)["ms_median"] - bench(fill_only)["ms_median"]
    row["tile_quantize_ms"] = t_freeze
    row["tile_quantize_share_of_G_attention_steps"] = t_freeze / (g * kv_ms)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 32768])
    p.add_argument("--preset", default="k4v2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=3.0, help="timing budget per row")
    # SmolLM2-135M layer; a Llama-8B-like layer (GQA 4:1)
    p.add_argument("--shapes", nargs="+", default=["3,9,64", "8,32,128"],
                   help="kv_heads,q_heads,head_dim per shape")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    rows = [run(n, h, hq, d, args.preset, args.seconds) for (h, hq, d) in shapes for n in args.lengths]
    print(json.dumps({"benchmark": "decode_attention_cpu", "env": env(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
