"""How far a real model's attention stays from fp16's range in the GPU's code matmuls.

    python benchmarks/fp16_operand_range.py [--tokens 1024] [--preset k4v2]

On a GPU the attention kernels multiply the packed codes with fp16 operands
(``kernels.CUDA_PRECISION``): per K tile, ``q * rs_k`` (each query channel times the tile's
row scale of that channel, in the tile's frame: rotated, or un-rotated for a key frame), and
per V tile ``p * rs_v`` (a softmax weight <= 1 times a token's row scale). Beyond 65504 they
overflow. This runs the default model (SmolLM2-135M) over ``--tokens`` tokens of real text,
captures every layer's post-RoPE queries and keys, quantizes the keys and values as the cache
does (G = 128 tiles, per-tile key frames) and prints, as JSON, per layer and in all, the
largest ``|q * rs_k|`` and ``|rs_v|``, and their margin to 65504.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import env  # noqa: E402

FP16_MAX = 65504.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--preset", default="k4v2")
    args = p.parse_args(argv)
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvarn_compile.config import get_config
    from kvarn_compile.eval.corpora import text_windows
    from kvarn_compile.eval.models import load_model
    from kvarn_compile.quant.quantize import quantize_kv, rotate

    torch.set_grad_enabled(False)
    cfg = get_config(args.preset)
    caught = []

    def capture(module, query, key, value, attention_mask, **kw):
        caught.append((query.float(), key.float(), value.float()))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("kvarn_range_capture", capture)
    model, tok = load_model(attn_implementation="kvarn_range_capture")
    tokens = args.tokens - args.tokens % cfg.group_size
    model(text_windows(tok, 1, tokens))
    rows = []
    for layer, (q, k, v) in enumerate(caught):
        group = q.shape[1] // k.shape[1]
        qk = quantize_kv(k, "k", bits=cfg.key_bits, group=cfg.group_size, key_frame="auto")
        qv = quantize_kv(v, "v", bits=cfg.value_bits, group=cfg.group_size)
        rs = qk.row_scale.float()                                    # [B, H, n, D]
        plain = qk.plain.bool() if qk.plain is not None else torch.zeros(rs.shape[:3], dtype=torch.bool)
        # per (kv head, tile): the largest query channel of its heads times the row scale
        q_rot = rotate(q).abs().unflatten(1, (k.shape[1], group)).amax(dim=(2, 3))   # [B, H, D]
        q_plain = q.abs().unflatten(1, (k.shape[1], group)).amax(dim=(2, 3))
        frame = torch.where(plain[..., None], q_plain[:, :, None], q_rot[:, :, None])
        qk_max = float((frame * rs.abs()).max())
        rows.append({"layer": layer, "q_times_rs_k": qk_max, "rs_v": float(qv.row_scale.abs().max()),
                     "key_frames": int(plain.sum()), "q_abs_max": float(q.abs().max())})
    top_k = max(r["q_times_rs_k"] for r in rows)
    top_v = max(r["rs_v"] for r in rows)
    print(json.dumps({"benchmark": "fp16_operand_range", "env": env(), "tokens": tokens,
                      "preset": args.preset, "max_q_times_rs_k": top_k, "max_rs_v": top_v,
                      "margin_k": FP16_MAX / top_k, "margin_v": FP16_MAX / top_v,
                      "layers": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
