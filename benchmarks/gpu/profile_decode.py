"""One decode step of the standalone KVarN decode kernel, for a profiler to attach to.

    ncu --clock-control none -k regex:_kvarn_decode_attn_kernel --launch-skip 3 -c 1 \\
        python benchmarks/gpu/profile_decode.py [--tokens 32768] [--preset k4v2] [--block-n 128]

Batch 1, 32 query / 8 KV heads, head_dim 128 (the shapes of ``bench_decode_attention_gpu``),
a packed cache of random valid content; the kernel runs four times (the first compiles), and
the script prints its median time per call (do_bench, launch overhead included) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_decode_attention_gpu import GQA_Q_HEADS, HEAD_DIM, _random_packed_state  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--preset", default="k4v2")
    p.add_argument("--block-n", type=int, default=None)
    p.add_argument("--precision", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    import triton

    from kvarn_compile.config import get_config
    from kvarn_compile.kernels.triton.attention import kvarn_decode_attention

    torch.manual_seed(0)
    cfg = get_config(args.preset)
    st, _, _, nbytes = _random_packed_state(cfg, 1, args.tokens, "cuda")
    q = torch.randn(1, GQA_Q_HEADS, 1, HEAD_DIM, device="cuda")
    f = st

    def step():
        return kvarn_decode_attention(
            q, f.k_codes, f.k_row_scale, f.k_row_zero, f.k_col_scale, f.v_codes, f.v_row_scale,
            f.v_row_zero, f.v_col_scale, f.n_tiles, scale=HEAD_DIM ** -0.5,
            block_n=args.block_n, input_precision=args.precision)

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(step, warmup=5, rep=30)
    print(json.dumps({"tokens": args.tokens, "preset": cfg.short(), "ms": ms, "bytes": nbytes,
                      "gb_per_s": nbytes / (ms * 1e-3) / 1e9}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
