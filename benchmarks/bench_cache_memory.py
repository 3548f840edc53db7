"""Bytes of a filled KVarN layer state vs an fp16 cache, counted from live tensors.

    python benchmarks/bench_cache_memory.py [--lengths 1024 4096 16384 32768]

Prints JSON: for every preset, head dim and length, the bytes of every buffer of a state
allocated for exactly that length and filled to it, the fp16 K+V bytes of the same
tokens, the ratio, and bits per element of the packed tiles and overall.
"""

from __future__ import annotations

import argparse
import json

import torch

from _common import env
from kvarn_compile.config import PRESETS, get_config
from kvarn_compile.ops.append import append_
from kvarn_compile.state import TILE_FIELDS, allocate_layer, fp16_cache_bytes


def measure(preset: str, head_dim: int, tokens: int, kv_heads: int = 1) -> dict:
    cfg = get_config(preset)
    st = allocate_layer(cfg, batch=1, kv_heads=kv_heads, head_dim=head_dim, max_len=tokens,
                        dtype=torch.float16)
    chunk = 4096
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        kv = torch.randn(1, kv_heads, n, head_dim, dtype=torch.float16)
        append_(st.buffers, kv, kv, torch.tensor([start]))
    assert int(st.lengths[0]) == tokens
    fp16 = fp16_cache_bytes(batch=1, kv_heads=kv_heads, head_dim=head_dim, tokens=tokens)
    named = st.fields.named()
    tile_names = [f"{kind}_{n}" for kind in "kv" for n in TILE_FIELDS + ("row_factor", "col_factor")]
    tile_names += ["k_plain"]
    tile_bytes = sum(named[n].numel() * named[n].element_size() for n in tile_names if n in named)
    tile_tokens = st.max_tiles * cfg.group_size
    return {"preset": preset, "head_dim": head_dim, "tokens": tokens, "fp16_bytes": fp16,
            "kvarn_bytes": st.nbytes, "ratio_vs_fp16": fp16 / st.nbytes,
            "bpe_overall": 8 * st.nbytes / (2 * kv_heads * tokens * head_dim),
            "bpe_tiles": 8 * tile_bytes / (2 * kv_heads * tile_tokens * head_dim) if tile_tokens else None,
            "tiles": st.max_tiles, "sink_tokens": st.sink_len, "tail_slots": st.tail_len}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    args = p.parse_args()
    rows = [measure(preset, d, n) for preset in PRESETS for d in args.head_dims for n in args.lengths]
    print(json.dumps({"benchmark": "cache_memory", "env": env(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
