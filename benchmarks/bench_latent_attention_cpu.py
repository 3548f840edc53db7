"""CPU time of one decode step of kvarn::latent_attention (multi-head latent attention in its
absorbed form over a latent state) vs its pure-torch reference and vs dense fp32 attention
over the dequantized latent.

    python benchmarks/bench_latent_attention_cpu.py [--lengths 1024 4096 16384] [--threads 2]
        [--seconds 3] [--preset k4v2] [--heads 16] [--rank 512] [--rope 64]

DeepSeek-V2/V3's geometry by default: one latent state (one kv head; the normed latent,
``--rank`` 512 channels, as its keys at the preset's key bits, the shared RoPE key, ``--rope``
64, as its values at ``LATENT_ROPE_BITS``), bf16 model (sink and tail), filled with
``--lengths`` tokens; one query token of ``--heads`` 16 heads, fp32 queries. Three sides:

* ``kvarn_kernel``: ``torch.ops.kvarn.latent_attention`` as dispatched on CPU (the C++ kernel
  of ``kernels/cpu/attention.py``: ``latent_attention_state``; ``kernel_applies`` says whether
  it ran, else this is the reference too);
* ``reference``: ``ops.attention.latent_attention``, the pure-torch reference;
* ``dense_fp32``: matmul / softmax / matmul over the dequantized cache in fp32, keys
  [1, 1, T, rank + rope], values the latent [1, 1, T, rank], the query heads the rows of one
  product (what an uncompressed fp32 cache of the same tokens costs; ``packed_bytes_per_token``
  and ``bf16_bytes_per_token`` say what the two caches hold).

The three are timed interleaved (one call of each per round, rounds until ``--seconds``
have passed, at least 7) so that load from other processes hits them alike; the ratios of
the medians are the result. Prints JSON.
"""

from __future__ import annotations

import argparse
import json

import torch

from _common import env
from bench_decode_attention_cpu import _interleaved
from kvarn_compile.config import LATENT_ROPE_BITS, get_config
from kvarn_compile.kernels.cpu import attention as cpu_attention
from kvarn_compile.ops import attention as attention_ref, library as ops
from kvarn_compile.ops.append import append_, materialize
from kvarn_compile.state import allocate_layer


def _latent_state(cfg, tokens: int, rank: int, rope: int, dtype: torch.dtype):
    st = allocate_layer(cfg, batch=1, kv_heads=1, head_dim=rank, value_head_dim=rope, max_len=tokens,
                        dtype=dtype)
    g = torch.Generator().manual_seed(0)
    for start in range(0, tokens, 4096):
        n = min(4096, tokens - start)
        latent = torch.randn(1, 1, n, rank, generator=g) * (0.5 + torch.rand(rank, generator=g))
        pe = torch.randn(1, 1, n, rope, generator=g)
        append_(st.buffers, latent.to(dtype), pe.to(dtype), torch.tensor([start]),
                method=cfg.op_method, iters=cfg.sinkhorn_iters)
    return st


def run(tokens: int, heads: int, rank: int, rope: int, preset: str, dtype: torch.dtype,
        seconds: float) -> dict:
    cfg = get_config(preset, value_bits=LATENT_ROPE_BITS)
    st = _latent_state(cfg, tokens, rank, rope, dtype)
    q, q_pe = torch.randn(1, heads, 1, rank), torch.randn(1, heads, 1, rope)
    scale = (rank + rope) ** -0.5
    lat, pe = materialize(st.buffers, dtype=torch.float32)          # [1, 1, T, rank | rope]
    keys, values = torch.cat([lat, pe], -1), lat
    rows = torch.cat([q, q_pe], -1).reshape(1, 1, heads, rank + rope)   # the heads: rows of one GEMM

    def dense():
        p = torch.softmax((rows @ keys.transpose(-1, -2)) * scale, -1)
        return (p @ values).reshape(1, heads, 1, rank)

    applies = cpu_attention.available() and cpu_attention.latent_attention_state(
        q, q_pe, st.buffers, None, scale=scale, causal=True, window=0) is not None
    kernel = lambda: ops.latent_attention(q, q_pe, st.buffers, None, scale, True, 0)  # noqa: E731
    diff = (kernel() - dense()).abs().max().item()
    row = {"tokens": tokens, "q_heads": heads, "rank": rank, "rope": rope, "preset": preset,
           "group": cfg.group_size, "model_dtype": str(dtype).removeprefix("torch."),
           "kernel_applies": bool(applies), "max_abs_diff_kernel_vs_dense": diff,
           "packed_bytes_per_token": st.nbytes / tokens, "bf16_bytes_per_token": 2 * (rank + rope)}
    row.update(_interleaved({
        "kvarn_kernel": kernel,
        "reference": lambda: attention_ref.latent_attention(q, q_pe, st.buffers, None, scale, True, 0),
        "dense_fp32": dense,
    }, seconds))
    kv_ms = row["kvarn_kernel"]["ms_median"]
    row["ratio_kernel_vs_reference"] = kv_ms / row["reference"]["ms_median"]     # < 1: kernel faster
    row["ratio_kernel_vs_dense_fp32"] = kv_ms / row["dense_fp32"]["ms_median"]
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--preset", default="k4v2")
    p.add_argument("--heads", type=int, default=16, help="query heads (one kv head)")
    p.add_argument("--rank", type=int, default=512, help="kv_lora_rank: the latent's channels")
    p.add_argument("--rope", type=int, default=64, help="qk_rope_head_dim: the RoPE key's channels")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="the model dtype (sink and tail)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=3.0, help="timing budget per row")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    rows = [run(n, args.heads, args.rank, args.rope, args.preset, dtype, args.seconds)
            for n in args.lengths]
    print(json.dumps({"benchmark": "latent_attention_cpu", "env": env(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
