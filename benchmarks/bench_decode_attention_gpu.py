"""GPU decode attention: KVarN (compiled, autotuned templates) vs fp16 SDPA and FlexDecoding.

    python benchmarks/bench_decode_attention_gpu.py [--lengths 4096 16384 32768 131072]
        [--batches 1 8 32] [--preset k4v2] [--quick] [--out FILE] [--no-cudagraph]

For every (batch, context length) at head_dim 128 and GQA 4:1 (32 query / 8 KV heads) it
prints, as JSON, the median time of one decode step (one query token) and the achieved
bandwidth (bytes of the cache read / time) of:

* ``sdpa_fp16``: ``F.scaled_dot_product_attention(enable_gqa=True)`` over an fp16 cache;
* ``flex_decoding``: ``flex_attention`` under ``torch.compile`` over the same fp16 cache;
* ``kvarn``: ``torch.ops.kvarn.attention`` compiled by Inductor with the kvarn lowering
  (split path: the ``kvarn_decode`` template autotuned against the standalone kernel and
  the torch implementation; the chosen config is reported) over a packed cache of the
  same length (random valid codes and positive scales: speed, not quality);
* ``kvarn_one_launch``: the eager op on the same cache, i.e. its CUDA kernel
  ``kernels.kvarn_attention`` (exact region, tiles and merge in one launch, after zeroing its
  counters), captured in the CUDA graph like the others;

plus, per case, the ``kvarn_decode`` template rendered standalone in every ``SWEEP`` config
(precision, PREFETCH, BLOCK_N, warps, splits; ``template_sweep``, fastest first), the time to
quantize one tile per (batch row, kv head) with
``kernels.quantize_tiles_into`` (what a decode step that completes a tile adds) against G
decode steps, and the ``kvarn_decode`` template body with its dual column scales against a
single-scale proxy (every tile reads tile 0's column scales, so those loads stay in cache:
the memory traffic of a format without per-tile column scales).

Without a CUDA device it prints ``{"skipped": "no CUDA device"}`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile

import torch

GQA_Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


#: ``do_bench_cudagraph`` (one graph replay per timing: no launch overhead, what a CUDA-graph
#: decode loop sees) unless ``--no-cudagraph``; ``do_bench`` where a function cannot be captured.
USE_CUDAGRAPH = True
#: Context lengths at which the template configs are swept (None: every length).
SWEEP_LENGTHS = None


def _bench_ms(fn) -> dict:
    import triton

    if USE_CUDAGRAPH:
        try:
            p50, p20, p80 = triton.testing.do_bench_cudagraph(fn, rep=50, quantiles=[0.5, 0.2, 0.8])
            return {"ms_median": p50, "ms_p20": p20, "ms_p80": p80, "timer": "cudagraph"}
        except Exception as err:  # noqa: BLE001 - not capturable (a host sync): time it eagerly
            reason = f"{type(err).__name__}: {err}"[:200]
    else:
        reason = None
    p50, p20, p80 = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8], warmup=10, rep=50)
    row = {"ms_median": p50, "ms_p20": p20, "ms_p80": p80, "timer": "do_bench"}
    if reason:
        row["cudagraph_error"] = reason
    return row


def _with_gbps(row: dict, nbytes: int) -> dict:
    row["bytes"] = nbytes
    row["gb_per_s"] = nbytes / (row["ms_median"] * 1e-3) / 1e9
    return row


def _random_packed_state(cfg, batch: int, tokens: int, device: str):
    """A packed state holding ``tokens`` tokens of random valid content (no quantization run)."""
    from kvarn_compile.state import allocate_layer

    st = allocate_layer(cfg, batch=batch, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                        max_len=tokens + cfg.group_size, dtype=torch.float16, device=device)
    s, g = st.sink_len, cfg.group_size
    n = (tokens - s) // g
    tail = tokens - s - n * g
    for name in ("k_codes", "v_codes"):
        getattr(st, name).random_(0, 256)
    for name in ("k_row_scale", "v_row_scale"):
        getattr(st, name).uniform_(0.01, 0.1)
    for name in ("k_col_scale", "v_col_scale"):
        getattr(st, name).uniform_(0.75, 2.0)
    for name in ("k_row_zero", "v_row_zero", "sink_k", "sink_v", "tail_k", "tail_v"):
        getattr(st, name).normal_()
    st.lengths.fill_(tokens)
    st.committed.fill_(tokens)
    st.n_tiles.fill_(n)
    used = st.used_bytes()
    return st, n, tail, sum(used.values())


def _kvarn_compiled(st, scale: float):
    from kvarn_compile import lowering

    lowering.register()

    def attend(q, *buffers):
        return torch.ops.kvarn.attention(q, list(buffers), None, scale, True, 0)

    return torch.compile(attend, fullgraph=True, dynamic=False)


#: The template configs timed standalone per case (``template_sweep``): code-matmul precision,
#: PREFETCH, BLOCK_N, num_warps, the split count as a multiple of the lowering's, and PHASED
#: (the phased fp16 loop where ``phased_decode`` allows it; False: the byte loop). The
#: lowering's default comes first: the phased loop, 128-token steps, 2 warps, no prefetch.
SWEEP = [dict(INPUT_PRECISION="fp16", PREFETCH=0, BLOCK_N=128, num_warps=2, split_x=1,
              PHASED=True)] + [
    dict(INPUT_PRECISION="fp16", PREFETCH=pf, BLOCK_N=bn, num_warps=w, split_x=sx, PHASED=True)
    for pf, bn, w, sx in ((0, 128, 2, 2), (0, 128, 4, 1), (1, 128, 2, 1), (0, 64, 2, 1))] + [
    dict(INPUT_PRECISION=p, PREFETCH=pf, BLOCK_N=bn, num_warps=w, split_x=sx, PHASED=False)
    for p in ("tf32", "fp16") for pf in (1, 0) for bn, w in ((64, 4), (128, 4), (128, 8))
    for sx in (1, 2)]


def _template_standalone(st, scale: float):
    """The decode template rendered standalone over ``st``: (time(config, cols) -> row, default config)."""
    from kvarn_compile.kernels.triton.attention import phased_decode
    from kvarn_compile.lowering.heuristics import split_max
    from kvarn_compile.lowering.tile_templates import launch_standalone, render_standalone
    from kvarn_compile.ops.attention import tile_inputs
    from kvarn_compile.ops.regions import combine_splits
    from kvarn_compile.quant.rotation import rotation_matrix

    b = st.batch
    q = torch.randn(b, GQA_Q_HEADS, 1, HEAD_DIM, device=st.sink_k.device, dtype=torch.float16)
    ins = tile_inputs(q, st.buffers, None, True, 0, rotation_matrix(HEAD_DIM, q.device))
    q_rot, _, kc, krs, krz, kcs, vc, vrs, vrz, vcs, _, nt, lo, hi, _ = ins
    sms = (torch.cuda.get_device_properties(q.device).multi_processor_count
           if q.device.type == "cuda" else 132)          # (an H100/H200's, for a CPU dry run)
    base_split = split_max(b * KV_HEADS, kc.shape[2], sms)
    g = kcs.shape[-1]
    tmp = tempfile.mkdtemp(prefix="kvarn_bench_")
    kernels = {}
    outputs = {}

    def time_config(cfg: dict, cols=None) -> dict:
        split = max(1, min(base_split * cfg.get("split_x", 1), kc.shape[2]))
        ce = dict(GROUP_Q=GQA_Q_HEADS // KV_HEADS, D=HEAD_DIM, BLOCK_D=HEAD_DIM, G=g,
                  BLOCK_N=min(cfg["BLOCK_N"], g), K_BITS=8 * kc.shape[-1] // g,
                  V_BITS=8 * vc.shape[-1] // HEAD_DIM, SPLIT=split, SPLIT_MAX=split, BLOCK_M=16,
                  PREFETCH=cfg["PREFETCH"], HAS_BIAS=False, HAS_K_PLAIN=False,
                  INPUT_PRECISION=cfg["INPUT_PRECISION"], SM_SCALE=scale, KVARN_SRC=0)
        ce["PHASED"] = bool(cfg.get("PHASED")) and phased_decode(
            ce["INPUT_PRECISION"], ce["BLOCK_N"], ce["K_BITS"], HEAD_DIM, ce["V_BITS"])
        kcs_, vcs_ = cols if cols is not None else (kcs, vcs)
        tensors = {"Q": q_rot, "KC": kc, "KRS": krs, "KRZ": krz, "KCS": kcs_, "VC": vc,
                   "VRS": vrs, "VRZ": vrz, "VCS": vcs_, "NT": nt, "KVLO": lo, "KVHI": hi,
                   "LSE": torch.full((b, GQA_Q_HEADS, 1, split), float("-inf"), device=q.device)}
        key = "kvarn_decode.py.jinja"
        if key not in kernels:
            kernels[key] = render_standalone(key, tensors, ce, tmp)
        o = torch.empty(b, GQA_Q_HEADS, 1, split, HEAD_DIM, device=q.device)
        grid = (b * KV_HEADS, split, 1)
        w = cfg["num_warps"]
        row = _bench_ms(lambda: launch_standalone(kernels[key], tensors, o, grid,
                                                  dict(ce, num_warps=w)))
        row.update({k: v for k, v in cfg.items()}, SPLIT=split)
        # the merged output, against the first config timed (the same math in every config)
        merged, _ = combine_splits(o, tensors["LSE"])
        if cols is None:
            first = outputs.setdefault("first", merged)
            row["max_rel_diff_vs_first"] = float((merged - first).abs().max()
                                                 / first.abs().max().clamp_min(1e-30))
        return row

    return time_config, (kcs, vcs)


def _single_vs_dual(time_config, cols) -> dict:
    """The decode template's dual column scales vs a single-scale proxy (one tile's column
    scales for every tile: those loads stay in cache), in the lowering's default config."""
    kcs, vcs = cols
    cfg = dict(SWEEP[0])
    out = {"dual_scale": time_config(cfg),
           "single_scale_proxy": time_config(cfg, (kcs[:, :, :1].expand_as(kcs),
                                                   vcs[:, :, :1].expand_as(vcs)))}
    out["dual_over_single"] = out["dual_scale"]["ms_median"] / out["single_scale_proxy"]["ms_median"]
    return out


def template_sweep(time_config, nbytes: int) -> list[dict]:
    """Every SWEEP config of the decode template, fastest first (GB/s of packed bytes)."""
    rows = []
    for cfg in SWEEP:
        try:
            rows.append(_with_gbps(time_config(cfg), nbytes))
        except Exception as err:  # noqa: BLE001 - a config that fails to compile is a result
            rows.append(dict(cfg, error=f"{type(err).__name__}: {err}"[:300]))
    return sorted(rows, key=lambda r: r.get("ms_median", float("inf")))


def _tile_quantize(cfg, batch: int, device: str, tiles: int = 1, timer=None) -> dict:
    """Quantizing ``tiles`` completed tiles per (batch row, kv head), K and V, with the
    Triton kernel (one: what a decode step that completes a tile adds)."""
    from kvarn_compile.kernels import quantize_tiles_into
    from kvarn_compile.state import allocate_layer

    g = cfg.group_size
    st = allocate_layer(cfg, batch=batch, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                        max_len=(tiles + 2) * g, dtype=torch.float16, device=device)
    x = torch.randn(batch, KV_HEADS, tiles * g, HEAD_DIM, device=device, dtype=torch.float16)
    dst = torch.arange(tiles, dtype=torch.int64, device=device)[None].expand(batch, -1).contiguous()

    def run():
        for kind, bits in (("k", cfg.key_bits), ("v", cfg.value_bits)):
            quantize_tiles_into(x, getattr(st, f"{kind}_codes"), getattr(st, f"{kind}_row_scale"),
                                getattr(st, f"{kind}_row_zero"), getattr(st, f"{kind}_col_scale"),
                                kind=kind, bits=bits, rotate=True, normalize=True,
                                iters=cfg.sinkhorn_iters, dst_tile=dst)
    return (timer or _bench_ms)(run)


def _fp16_baselines(q16: torch.Tensor, tokens: int, scale: float, nbytes: int) -> dict:
    """fp16 SDPA and FlexDecoding over a fresh fp16 cache of ``tokens`` tokens."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    k16 = torch.randn(q16.shape[0], KV_HEADS, tokens, HEAD_DIM, device=q16.device,
                      dtype=torch.float16)
    v16 = torch.randn_like(k16)
    out = {"sdpa_fp16": _with_gbps(_bench_ms(lambda: F.scaled_dot_product_attention(
        q16, k16, v16, enable_gqa=True, scale=scale)), nbytes)}
    flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    out["flex_decoding"] = _with_gbps(_bench_ms(lambda: flex(q16, k16, v16, scale=scale,
                                                             enable_gqa=True)), nbytes)
    return out


def _kvarn_parts(cfg, q16: torch.Tensor, tokens: int, scale: float) -> dict:
    """The op over a packed cache of ``tokens`` tokens: compiled, in one launch, the template
    standalone (scales, sweep), and one tile's quantization."""
    from kvarn_compile import lowering

    st, _, _, packed_bytes = _random_packed_state(cfg, q16.shape[0], tokens, str(q16.device))
    first = len(lowering.DECISIONS)
    fn = _kvarn_compiled(st, scale)
    fn(q16, *st.buffers)
    out = {"kvarn": _with_gbps(_bench_ms(lambda: fn(q16, *st.buffers)), packed_bytes)}
    out["kvarn"]["lowering"] = [d.line() for d in lowering.DECISIONS[first:]]
    out["kvarn_one_launch"] = _with_gbps(_bench_ms(lambda: torch.ops.kvarn.attention(
        q16, st.buffers, None, scale, True, 0)), packed_bytes)
    time_config, cols = _template_standalone(st, scale)
    out["scales"] = _single_vs_dual(time_config, cols)
    if SWEEP_LENGTHS is None or tokens in SWEEP_LENGTHS:
        out["template_sweep"] = template_sweep(time_config, packed_bytes)
    out["tile_quantize"] = _tile_quantize(cfg, q16.shape[0], str(q16.device))
    out["tile_quantize_share_of_G_decode_steps"] = out["tile_quantize"]["ms_median"] / (
        cfg.group_size * out["kvarn"]["ms_median"])
    return out


def run_case(cfg, batch: int, tokens: int, device: str = "cuda") -> dict:
    torch.manual_seed(0)
    scale = HEAD_DIM ** -0.5
    row = {"batch": batch, "tokens": tokens, "head_dim": HEAD_DIM, "q_heads": GQA_Q_HEADS,
           "kv_heads": KV_HEADS, "preset": cfg.short()}
    q16 = torch.randn(batch, GQA_Q_HEADS, 1, HEAD_DIM, device=device, dtype=torch.float16)
    fp16_bytes = 2 * batch * KV_HEADS * tokens * HEAD_DIM * 2
    for name, part in (("fp16", lambda: _fp16_baselines(q16, tokens, scale, fp16_bytes)),
                       ("kvarn", lambda: _kvarn_parts(cfg, q16, tokens, scale))):
        try:
            row.update(part())
        except Exception as err:  # noqa: BLE001 - (e.g. out of memory at 128k x 32) report, go on
            row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:500]
        if device == "cuda":
            torch.cuda.empty_cache()
    for base, key in (("sdpa_fp16", "speedup_vs_sdpa_fp16"), ("flex_decoding", "speedup_vs_flex")):
        if base in row and "kvarn" in row:
            row["kvarn"][key] = row[base]["ms_median"] / row["kvarn"]["ms_median"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768, 131072])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--preset", default="k4v2")
    p.add_argument("--quick", action="store_true", help="only 4k, 32k and 128k at batch 1")
    p.add_argument("--out", default=None, help="also write the JSON here after every case")
    p.add_argument("--no-cudagraph", action="store_true", help="time with do_bench, not graphs")
    p.add_argument("--sweep-lengths", type=int, nargs="*", default=None,
                   help="lengths at which to time every SWEEP config of the decode template "
                        "(default: all; --quick: 32768 and 131072)")
    args = p.parse_args(argv)
    global USE_CUDAGRAPH, SWEEP_LENGTHS
    USE_CUDAGRAPH = not args.no_cudagraph
    SWEEP_LENGTHS = args.sweep_lengths
    if args.quick and SWEEP_LENGTHS is None:
        SWEEP_LENGTHS = [32768, 131072]
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    from kvarn_compile.config import get_config

    torch.set_grad_enabled(False)
    cfg = get_config(args.preset)
    lengths, batches = args.lengths, args.batches
    if args.quick:
        lengths, batches = [4096, 32768, 131072], [1]
    rows = []
    for b in batches:
        for n in lengths:
            rows.append(run_case(cfg, b, n))
            write_rows("decode_attention_gpu", rows, args.out)
    print(rows_json("decode_attention_gpu", rows))
    return 0


def gpu_env() -> dict:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__,
            "device": torch.cuda.get_device_name(),
            "capability": "sm%d%d" % torch.cuda.get_device_capability()}


def rows_json(name: str, rows: list[dict]) -> str:
    return json.dumps({"benchmark": name, "env": gpu_env(), "rows": rows}, indent=1,
                      default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))


def write_rows(name: str, rows: list[dict], path: str | None) -> None:
    """The JSON so far to ``path`` (replaced whole): a run cut short by a timeout still
    leaves every finished case."""
    if path:
        import os

        with open(path + ".tmp", "w") as fh:
            fh.write(rows_json(name, rows))
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
