"""CPU time of one decode step of kvarn::attention vs SDPA over an uncompressed cache,
and the cost of quantizing one completed tile as a share of the G decode steps that
filled it.

    python benchmarks/bench_decode_attention_cpu.py [--lengths 1024 4096 8192 16384 32768]

The KVarN side is the op as dispatched on this device (the eager pure-torch reference on
CPU); the baseline is torch's scaled_dot_product_attention (enable_gqa) over fp32 and
bf16 caches of the same length. Prints JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from _common import bench, env
from kvarn_compile.config import get_config
from kvarn_compile.ops import library as ops
from kvarn_compile.ops.reference import append_
from kvarn_compile.state import allocate_layer


def run(length: int, kv_heads: int, q_heads: int, head_dim: int, preset: str) -> dict:
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
    row["kvarn_attention"] = bench(lambda: ops.attention(q, st.buffers, None, scale, True, 0))
    for name, dt in (("sdpa_fp32", torch.float32), ("sdpa_bf16", torch.bfloat16)):
        kk, vv, qq = k.to(dt), v.to(dt), q.to(dt)
        row[name] = bench(lambda: F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True))
    row["speedup_vs_sdpa_fp32"] = row["sdpa_fp32"]["ms_median"] / row["kvarn_attention"]["ms_median"]
    row["speedup_vs_sdpa_bf16"] = row["sdpa_bf16"]["ms_median"] / row["kvarn_attention"]["ms_median"]
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
    row["tile_quantize_share_of_G_attention_steps"] = t_freeze / (g * row["kvarn_attention"]["ms_median"])
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 32768])
    p.add_argument("--preset", default="k4v2")
    args = p.parse_args()
    torch.manual_seed(0)
    shapes = [(3, 9, 64), (8, 32, 128)]   # SmolLM2-135M layer; a Llama-8B-like layer (GQA 4:1)
    rows = [run(n, h, hq, d, args.preset) for (h, hq, d) in shapes for n in args.lengths]
    print(json.dumps({"benchmark": "decode_attention_cpu", "env": env(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
