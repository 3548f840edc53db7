"""CPU: freezing one tile per KV head (K and V) of a layer, reference quantizer vs C++.

    python benchmarks/bench_quantize_cpu.py [--reps 15] [--threads 1 2] [--context 2048]
                                            [--steps 10] [--step-ms 55] [--no-model] [--compiled]

For each thread count (``--threads``, default 1 and torch's), preset (k4v2, k2v2,
k2v2_clip) and layer shape (H=3 KV heads, D=64: SmolLM2-135M; H=8, D=128: Llama-3-8B),
G=128, both sides run the op's own freeze (``ops.append._freeze``
on fp16 tail tokens [H, G, D], writing into a packed layer state): the reference quantizer
(``tile_kernel=None``) and the C++ one (``tile_kernel=dispatch.freeze_tiles_cpu``), timed in
alternation in the same process (the machine may be shared: compare the two side by side).

The share of decode time: the default model (30 layers) freezes one tile per layer (all its
KV heads, K and V) every G decode steps, so

    share = n_layers * t_freeze(layer) / (G * t_step)

(``per_layer`` is the same without the n_layers factor). ``t_step`` is measured in the same
run: eager decode steps of the default model with a ``KVarNCache`` (k4v2, ``kvarn``
attention, the C++ attention kernel) after a ``--context``-token prefill of real text, and
with ``--compiled`` decode steps of the model compiled with ``kvarn_backend``. The
share at ``--step-ms`` (default 55 ms, the low end of a compiled decode step of this model
on this CPU) is reported too: the smaller the step, the larger the share. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import env  # noqa: E402

PRESETS = ("k4v2", "k2v2", "k2v2_clip")
SHAPES = {"smollm2_135m": (3, 64, 30), "llama3_8b": (8, 128, 32)}   # (KV heads, D, layers)
G = 128


def _stats(ms: list[float]) -> dict:
    t = sorted(ms)
    q = lambda p: t[min(int(p * len(t)), len(t) - 1)]  # noqa: E731
    return {"ms_median": statistics.median(t), "ms_p20": q(0.2), "ms_p80": q(0.8), "reps": len(t)}


def _freeze_case(preset: str, heads: int, d: int, reps: int) -> dict:
    from kvarn_compile.config import get_config
    from kvarn_compile.ops import append as append_ref, dispatch
    from kvarn_compile.state import allocate_layer

    cfg = get_config(preset, group_size=G)
    st = allocate_layer(cfg, batch=1, kv_heads=heads, head_dim=d, max_len=G * 4,
                        dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    spread = torch.exp(torch.randn(d, generator=gen))
    tk = (torch.randn(heads, G, d, generator=gen) * spread).half()
    tv = torch.randn(heads, G, d, generator=gen).half()

    def run(kernel):
        return lambda: append_ref.freeze_tiles(st.buffers, 0, tk, tv, 0, cfg.op_method,
                                         cfg.sinkhorn_iters, False, "", kernel)

    ref, cpp = run(None), run(dispatch.freeze_tiles_cpu)
    assert dispatch.freeze_tiles_cpu(st.buffers, 0, tk, tv, 0, cfg.op_method, cfg.sinkhorn_iters)
    for _ in range(2):
        ref()
        cpp()
    t_ref, t_cpp = [], []
    for _ in range(reps):          # alternate: both see the same machine load
        for fn, out in ((ref, t_ref), (cpp, t_cpp)):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    r, c = _stats(t_ref), _stats(t_cpp)
    return {"reference": r, "cpp": c, "speedup": r["ms_median"] / c["ms_median"]}


def _compiled_step_ms(context: int, steps: int) -> dict:
    """Decode steps of the default model compiled with kvarn_backend (Inductor), as in
    ``bench_e2e_decode_cpu.py`` (the first two steps, compiling, dropped)."""
    from bench_e2e_decode_cpu import _prefill, _quantiles, _step

    from kvarn_compile import kvarn_backend
    from kvarn_compile.eval.models import load_model

    torch._dynamo.reset()
    model, _ = load_model()
    model.compile(backend=kvarn_backend("k4v2", max_cache_len=context + steps, compiler="inductor"))
    with torch.no_grad():
        cache, tokens, prefill_s = _prefill(model, context, steps, 512, seed=context)
        times = [_step(model, cache, tokens[i], context + i) for i in range(steps)]
    out = {"prefill_s_incl_compile": prefill_s, "first_steps_ms": times[:2], **_quantiles(times[2:])}
    out.update({"context": context, "how": "SmolLM2-135M compiled with kvarn_backend('k4v2', "
                "compiler='inductor')"})
    return out


def _decode_step_ms(context: int, steps: int) -> dict:
    import inspect

    from kvarn_compile.eval.models import load_model, text_windows
    from kvarn_compile.hf import KVarNCache, use_kvarn_attention

    model, tok = load_model()
    use_kvarn_attention(model)
    cache = KVarNCache(model.config, max_cache_len=context + steps + 8, preset="k4v2")
    ids = text_windows(tok, 1, context + steps)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    times = []
    with torch.no_grad():
        for s in range(0, context, 512):
            model(input_ids=ids[:, s:min(s + 512, context)], use_cache=True, **{kw: cache})
        for i in range(steps):
            t0 = time.perf_counter()
            model(input_ids=ids[:, context + i:context + i + 1], use_cache=True, **{kw: cache})
            times.append((time.perf_counter() - t0) * 1e3)
    out = _stats(times[2:] if len(times) > 4 else times)
    out.update({"context": context, "how": "eager SmolLM2-135M, KVarNCache k4v2, kvarn attention"})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()],
                   help="intra-op thread counts to time the freeze with")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--step-ms", type=float, default=55.0)
    p.add_argument("--no-model", action="store_true", help="skip the decode-step measurement")
    p.add_argument("--compiled", action="store_true",
                   help="also time decode steps of the model compiled with kvarn_backend (slow to compile)")
    a = p.parse_args(argv)

    from kvarn_compile.kernels.cpu import quantize as cpu_quantize

    t0 = time.perf_counter()
    cpu_quantize.build()
    result = {"env": {**env(), "loadavg": os.getloadavg(), "cpu_count": os.cpu_count()},
              "build_or_load_s": time.perf_counter() - t0, "group": G, "freeze": {}}
    threads0 = torch.get_num_threads()
    for threads in a.threads:
        torch.set_num_threads(threads)
        for name, (heads, d, _) in SHAPES.items():
            for preset in PRESETS:
                result["freeze"][f"{name}/{preset}/threads={threads}"] = {
                    "heads": heads, "head_dim": d, "threads": threads,
                    **_freeze_case(preset, heads, d, a.reps)}
    torch.set_num_threads(threads0)
    steps = {"assumed": {"ms_median": a.step_ms, "how": "--step-ms"}}
    if not a.no_model:
        steps["measured"] = _decode_step_ms(a.context, a.steps)
    if a.compiled:
        steps["compiled"] = _compiled_step_ms(a.context, a.steps)
    result["decode_step"] = steps
    heads, d, layers = SHAPES["smollm2_135m"]
    share = {}
    for threads in a.threads:
        for preset in PRESETS:
            case = result["freeze"][f"smollm2_135m/{preset}/threads={threads}"]
            for which, step in steps.items():
                window = G * step["ms_median"]
                share[f"{preset}/threads={threads}/step={which}"] = {
                    side: {"all_layers": layers * case[side]["ms_median"] / window,
                           "per_layer": case[side]["ms_median"] / window}
                    for side in ("reference", "cpp")}
    result["share_of_decode_time_smollm2"] = share
    result["env"]["loadavg_end"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
