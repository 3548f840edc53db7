"""GPU prompt attention: KVarN over its packed cache vs fp16 SDPA (FlashAttention), per prompt.

    python benchmarks/bench_prefill_attention_gpu.py [--lengths 4096 16384] [--preset k4v2]
        [--out FILE] [--no-cudagraph]

A prompt of T tokens at batch 1, head_dim 128 and GQA 4:1 (32 query / 8 KV heads), causal,
its K/V already in the cache (what a prefill attends over after its append). Printed as JSON,
per T, the median time (``do_bench_cudagraph``) and achieved TFLOP/s (2 * Hq * T^2 * D, the
causal attention's useful multiply-adds, twice) of:

* ``sdpa_fp16``: ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` over an
  fp16 K/V of T tokens: the uncompressed baseline;
* ``kvarn_one_launch``: the eager op ``torch.ops.kvarn.attention`` over a packed cache of the
  same T tokens (random valid codes and positive scales: speed, not quality): its CUDA kernel,
  one fused program per query block (tiles, the exact region, the output);
* ``kvarn``: the same op compiled by Inductor with the kvarn lowering (autotuned: the
  ``kvarn_decode`` template in its prompt configs against the one-launch kernel; the decision
  is reported);
* ``template_configs``: the ``kvarn_decode`` template rendered standalone at ``TQ = T`` in the
  prompt configs below (the packed tiles only, no exact region), fastest first: the default
  (16 rows, 2 warps), 16 rows at 4 warps (no spills on sm_90), the 64-row block;
* ``quantize_prompt``: quantizing the prompt's T / G tiles, K and V, with the Triton kernel
  (``kernels.quantize_tiles_into``), which a prefill adds to its attention.

``kvarn_over_sdpa`` (> 1: KVarN slower) compares the one-launch op plus the quantization with
SDPA. Without a CUDA device it prints ``{"skipped": "no CUDA device"}`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode_attention_gpu as decode_bench  # noqa: E402  (shapes, timer, packed state)

GQA_Q_HEADS, KV_HEADS, HEAD_DIM = (decode_bench.GQA_Q_HEADS, decode_bench.KV_HEADS,
                                   decode_bench.HEAD_DIM)

#: The prompt configs of the template timed standalone: (BLOCK_M, BLOCK_N, num_warps), the
#: lowering's default first (``heuristics.prefill_configs``).
PROMPT_CONFIGS = [(16, 128, 2), (16, 128, 4), (64, 64, 4), (32, 128, 4)]


def _template_configs(st, q16: torch.Tensor, scale: float, timer) -> list[dict]:
    """The ``kvarn_decode`` template at TQ = T in each PROMPT_CONFIGS config, fastest first;
    each row's output against the first config's (the same math)."""
    from kvarn_compile.kernels.triton.attention import phased_decode
    from kvarn_compile.lowering.tile_templates import launch_standalone, render_standalone
    from kvarn_compile.ops.attention import tile_inputs
    from kvarn_compile.quant.rotation import rotation_matrix

    b, tq = q16.shape[0], q16.shape[2]
    ins = tile_inputs(q16, st.buffers, None, True, 0, rotation_matrix(HEAD_DIM, q16.device))
    q_rot, q_plain, kc, krs, krz, kcs, vc, vrs, vrz, vcs, k_plain, nt, lo, hi, _ = ins
    g = kcs.shape[-1]
    kb, vb = 8 * kc.shape[-1] // g, 8 * vc.shape[-1] // HEAD_DIM
    tensors = {"Q": q_rot, **({"QP": q_plain} if k_plain is not None else {}),
               "KC": kc, "KRS": krs, "KRZ": krz, "KCS": kcs, "VC": vc, "VRS": vrs, "VRZ": vrz,
               "VCS": vcs, **({"KP": k_plain} if k_plain is not None else {}),
               "NT": nt, "KVLO": lo, "KVHI": hi,
               "LSE": torch.full((b, GQA_Q_HEADS, tq, 1), float("-inf"), device=q16.device)}
    tmp = tempfile.mkdtemp(prefix="kvarn_bench_")
    kernel = None
    rows, first = [], None
    for block_m, block_n, warps in PROMPT_CONFIGS:
        ce = dict(GROUP_Q=GQA_Q_HEADS // KV_HEADS, D=HEAD_DIM, BLOCK_D=HEAD_DIM, DV=HEAD_DIM,
                  BLOCK_DV=HEAD_DIM, G=g, BLOCK_N=min(block_n, g), K_BITS=kb, V_BITS=vb,
                  SPLIT=1, SPLIT_MAX=1, BLOCK_M=block_m, PREFETCH=0, HAS_BIAS=False,
                  HAS_K_PLAIN=k_plain is not None, INPUT_PRECISION="fp16", SM_SCALE=scale,
                  KVARN_SRC=0)
        ce["PHASED"] = phased_decode("fp16", ce["BLOCK_N"], kb, HEAD_DIM, vb)
        cfg = {"BLOCK_M": block_m, "BLOCK_N": ce["BLOCK_N"], "num_warps": warps,
               "PHASED": ce["PHASED"]}
        try:
            if kernel is None:
                kernel = render_standalone("kvarn_decode.py.jinja", tensors, ce, tmp)
            out = torch.empty(b, GQA_Q_HEADS, tq, 1, HEAD_DIM, device=q16.device)
            grid = (b * KV_HEADS, 1, triton_cdiv(GQA_Q_HEADS // KV_HEADS * tq, block_m))
            row = timer(lambda: launch_standalone(kernel, tensors, out, grid,
                                                  dict(ce, num_warps=warps)))
            first = out.clone() if first is None else first
            row["max_rel_diff_vs_first"] = float((out - first).nan_to_num().abs().max()
                                                 / first.nan_to_num().abs().max().clamp_min(1e-30))
            rows.append(dict(cfg, **row))
        except Exception as err:  # noqa: BLE001 - a config that fails is a result
            rows.append(dict(cfg, error=f"{type(err).__name__}: {err}"[:300]))
    return sorted(rows, key=lambda r: r.get("ms_median", float("inf")))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _quantize_prompt(cfg, tokens: int, device: str, timer) -> dict:
    """Quantizing the prompt's tiles (T // G per kv head), K and V, with the Triton kernel."""
    n = max(1, tokens // cfg.group_size)
    return dict(decode_bench._tile_quantize(cfg, 1, device, tiles=n, timer=timer), tiles=n)


def _sdpa(q16: torch.Tensor, scale: float, timer) -> dict:
    """fp16 SDPA, causal, over a fresh fp16 K/V as long as the prompt."""
    import torch.nn.functional as F

    k16 = torch.randn(1, KV_HEADS, q16.shape[2], HEAD_DIM, device=q16.device, dtype=torch.float16)
    v16 = torch.randn_like(k16)
    return timer(lambda: F.scaled_dot_product_attention(q16, k16, v16, is_causal=True,
                                                        enable_gqa=True, scale=scale))


def _kvarn(cfg, q16: torch.Tensor, scale: float, timer) -> dict:
    """The op over a packed cache of the prompt's length: one launch, compiled, and the
    template's prompt configs."""
    from kvarn_compile import lowering

    st, n_tiles, _, _ = decode_bench._random_packed_state(cfg, 1, q16.shape[2], str(q16.device))
    out = {"packed_tiles": n_tiles,
           "kvarn_one_launch": timer(lambda: torch.ops.kvarn.attention(q16, st.buffers, None,
                                                                       scale, True, 0))}
    first = len(lowering.DECISIONS)
    fn = decode_bench._kvarn_compiled(st, scale)
    fn(q16, *st.buffers)
    out["kvarn"] = timer(lambda: fn(q16, *st.buffers))
    out["kvarn"]["lowering"] = [d.line() for d in lowering.DECISIONS[first:]]
    out["template_configs"] = _template_configs(st, q16, scale, timer)
    return out


def run_case(cfg, tokens: int, device: str = "cuda", timer=None) -> dict:
    """One prompt length; ``timer(fn) -> {"ms_median", ...}`` (default: the decode
    benchmark's CUDA-graph timer). Each part that fails is reported and the rest goes on."""
    timer = timer or decode_bench._bench_ms
    torch.manual_seed(0)
    scale = HEAD_DIM ** -0.5
    flops = 2.0 * GQA_Q_HEADS * tokens * tokens * HEAD_DIM
    row = {"tokens": tokens, "head_dim": HEAD_DIM, "q_heads": GQA_Q_HEADS, "kv_heads": KV_HEADS,
           "preset": cfg.short(), "causal_flops": flops}
    q16 = torch.randn(1, GQA_Q_HEADS, tokens, HEAD_DIM, device=device, dtype=torch.float16)
    for name, part in (("sdpa_fp16", lambda: {"sdpa_fp16": _sdpa(q16, scale, timer)}),
                       ("kvarn", lambda: _kvarn(cfg, q16, scale, timer)),
                       ("quantize_prompt", lambda: {"quantize_prompt": _quantize_prompt(
                           cfg, tokens, device, timer)})):
        try:
            row.update(part())
        except Exception as err:  # noqa: BLE001 - (e.g. out of memory) report, go on
            row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:500]
        if device == "cuda":
            torch.cuda.empty_cache()
    for name in ("sdpa_fp16", "kvarn_one_launch", "kvarn"):
        if name in row:
            row[name]["tflop_per_s"] = flops / (row[name]["ms_median"] * 1e-3) / 1e12
    if all(k in row for k in ("sdpa_fp16", "kvarn_one_launch", "quantize_prompt")):
        row["kvarn_over_sdpa"] = (row["kvarn_one_launch"]["ms_median"]
                                  + row["quantize_prompt"]["ms_median"]) \
            / row["sdpa_fp16"]["ms_median"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--preset", default="k4v2")
    p.add_argument("--out", default=None, help="also write the JSON here after every case")
    p.add_argument("--no-cudagraph", action="store_true", help="time with do_bench, not graphs")
    args = p.parse_args(argv)
    decode_bench.USE_CUDAGRAPH = not args.no_cudagraph
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    from kvarn_compile.config import get_config

    torch.set_grad_enabled(False)
    cfg = get_config(args.preset)
    rows = []
    for n in args.lengths:
        rows.append(run_case(cfg, n))
        decode_bench.write_rows("prefill_attention_gpu", rows, args.out)
    print(decode_bench.rows_json("prefill_attention_gpu", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
