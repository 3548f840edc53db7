"""Capture one KVarN decode step (append + attention, the CUDA kernels) in a CUDA graph, replay it
across tile boundaries and compare every step with the eager reference ops; time both.

    python benchmarks/gpu/check_cuda_graph.py [--steps 300] [--out FILE]

Prints (and writes) JSON: whether the capture succeeded, the largest output difference
from the reference per replayed step, whether the states agree (counters, sink and tail
exactly; the fraction of tile codes that differ), the device error flags read
after the replays, and the time of one step replayed vs run eagerly with host checks.
Without a CUDA device it prints ``{"skipped": "no CUDA device"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

B, HQ, H, D = 1, 32, 8, 128


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--preset", default="k4v2")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    import kvarn_compile  # noqa: F401  (registers the ops)
    from kvarn_compile.config import get_config
    from kvarn_compile.ops import append as append_ref, attention as attention_ref, dispatch
    from kvarn_compile.state import allocate_layer, unpack

    torch.set_grad_enabled(False)
    dev = "cuda"
    cfg = get_config(args.preset)
    st = allocate_layer(cfg, batch=B, kv_heads=H, head_dim=D, max_len=args.prompt + args.steps + 256,
                        dtype=torch.float16, device=dev)
    k0 = torch.randn(B, H, args.prompt, D, device=dev, dtype=torch.float16)
    v0 = torch.randn_like(k0)
    method = cfg.op_method if hasattr(cfg, "op_method") else "kvarn"
    torch.ops.kvarn.append_(st.buffers, k0, v0, torch.zeros(B, dtype=torch.int64, device=dev),
                            method, 8, 0, 0, False, "check")
    ref = [t.clone() for t in st.buffers]
    scale = D ** -0.5
    k = torch.zeros(B, H, 1, D, device=dev, dtype=torch.float16)
    v = torch.zeros_like(k)
    q = torch.zeros(B, HQ, 1, D, device=dev, dtype=torch.float16)
    result = {"preset": args.preset, "prompt": args.prompt, "steps": args.steps}

    def step():
        start = unpack(st.buffers).lengths.clone()
        torch.ops.kvarn.append_(st.buffers, k, v, start, method, 8, 0, 0, False, "check")
        return torch.ops.kvarn.attention(q, st.buffers, None, scale, True, 0)

    # warm up (compiles the kernels) on a copy of the state, outside the graph
    saved = [t.clone() for t in st.buffers]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        import os
        os.environ[dispatch.CUDA_CHECKS_ENV] = "0"
        step()
    torch.cuda.current_stream().wait_stream(side)
    for t, s in zip(st.buffers, saved):
        t.copy_(s)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = step()
        result["captured"] = True
    except Exception as err:  # noqa: BLE001 - the answer this check exists for
        result["captured"] = False
        result["capture_error"] = f"{type(err).__name__}: {err}"[:800]
        print(json.dumps(result))
        return 1
    for t, s in zip(st.buffers, saved):
        t.copy_(s)
    dispatch.raise_device_errors(dev)

    worst, state_ok, exact_ok, codes_off = 0.0, True, True, 0.0
    for i in range(args.steps):
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
        q.copy_(torch.randn_like(q))
        graph.replay()
        append_ref.append_(ref, k, v, unpack(ref).lengths.clone(), method, 8, 0, 0, False, "ref")
        want = attention_ref.attention(q, ref, None, scale, True, 0)
        worst = max(worst, float((out.float() - want.float()).abs().max()))
        f, r = unpack(st.buffers), unpack(ref)
        state_ok &= bool(torch.equal(f.lengths, r.lengths) and torch.equal(f.n_tiles, r.n_tiles))
        exact_ok &= all(bool(torch.equal(getattr(f, n), getattr(r, n)))
                        for n in ("sink_k", "sink_v", "tail_k", "tail_v"))
        codes_off = max(codes_off, max(float((f.tiles(x).codes != r.tiles(x).codes).float().mean())
                                       for x in "kv"))
    result["max_abs_diff_vs_reference"] = worst
    result["counters_match"] = state_ok
    result["sink_and_tail_match"] = exact_ok
    # the Triton tile quantizer against the reference's (float rounding: a few codes at a step)
    result["codes_mismatch_fraction"] = codes_off
    result["tiles_after"] = int(unpack(st.buffers).n_tiles[0])
    try:
        dispatch.raise_device_errors(dev)
        result["device_errors"] = None
    except Exception as err:  # noqa: BLE001
        result["device_errors"] = str(err)[:300]

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    result["ms_per_step_graph"] = (time.perf_counter() - t0) / 50 * 1e3
    os.environ[dispatch.CUDA_CHECKS_ENV] = "1"
    t0 = time.perf_counter()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    result["ms_per_step_eager_checked"] = (time.perf_counter() - t0) / 20 * 1e3
    text = json.dumps(result)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0 if result["captured"] and state_ok and exact_ok and worst < 5e-2 \
        and codes_off < 5e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
