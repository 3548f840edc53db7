"""CPU: where the cold compile goes, kvarn_backend vs plain Inductor, cold and warm.

    python benchmarks/bench_compile_cpu.py [--prompt 256] [--steps 3] [--preset k4v2]

Each run is a fresh Python process (so nothing is shared in memory) on the default model
(SmolLM2-135M, fp32, sdpa) over a transformers ``StaticCache``: one compiled prefill of
``--prompt`` tokens, then ``--steps`` single-token decode steps, timed from the first call
(compile included). Four runs, in this order:

* ``kvarn cold``: ``model.compile(backend=kvarn_backend(preset, compiler="inductor"))``
  with an empty Inductor cache directory and an empty autotune database;
* ``kvarn warm``: the same in a second process over the caches the first one left;
* ``inductor cold`` / ``inductor warm``: ``model.compile()`` (plain Inductor), the same way.

The warm runs are repeated ``--warm-runs`` times (default 3), kvarn and Inductor taking
turns, and the run with the median time stands for each (the ratio of a few seconds is
otherwise at the mercy of one noisy moment); ``warm_first_s`` lists them all.

Per run: wall time of the prefill and of the first decode step (both compile), and the
breakdown Dynamo records (``torch._dynamo.utils.compilation_time_metrics``: Dynamo's
tracing, AOTAutograd, Inductor's lowering and code generation, C++ compilation), the time
kvarn's graph pass took, and the time spent benchmarking kvarn's autotune choices (from
the lowering's decision log). The C++ kernels of ``kernels/`` are built (or loaded from
the extension cache) before timing starts and reported separately. Prints JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])

#: compilation_time_metrics keys summarized (others are in "all_s").
_PHASES = {
    "dynamo_total": "_compile.compile_inner",
    "backend_compile": "OutputGraph.call_user_compiler",
    "aot_autograd": "create_aot_dispatcher_function",
    "inductor_compile_fx_inner": "compile_fx_inner",
    "inductor_lowering": "GraphLowering.run",
    "inductor_codegen": "GraphLowering.codegen",
    "inductor_compile_to_module": "GraphLowering.compile_to_module",
    "cpp_compile_wait": "async_compile.wait",
}


def _child(args) -> dict:
    import torch

    torch.set_grad_enabled(False)
    from transformers import StaticCache

    from kvarn_compile.eval.models import load_model
    from kvarn_compile.kernels.cpu import attention as cpu_attention, quantize as cpu_quantize

    t0 = time.perf_counter()
    built = {"cpu_attention": cpu_attention.available(), "cpu_quantize": cpu_quantize.available()}
    ext_s = time.perf_counter() - t0
    model, _ = load_model()
    c = model.config
    cache = StaticCache(config=c, max_cache_len=args.prompt + args.steps)
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cache.early_initialization(1, heads, dim, torch.float32, "cpu")
    pass_s = [0.0]
    backend = None
    if args.runner == "kvarn":
        from kvarn_compile import backend as backend_mod
        from kvarn_compile import kvarn_backend

        inner = backend_mod.rewrite_graph

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                pass_s[0] += time.perf_counter() - t

        backend_mod.rewrite_graph = timed
        backend = kvarn_backend(args.preset, max_cache_len=args.prompt + args.steps,
                                compiler="inductor")
        model.compile(backend=backend)
    else:
        model.compile()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, c.vocab_size, (1, args.prompt), generator=g)
    t0 = time.perf_counter()
    model(input_ids=ids, cache=cache, use_cache=True,
          cache_position=torch.arange(args.prompt))
    prefill_s = time.perf_counter() - t0
    steps = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True,
              cache_position=torch.tensor([args.prompt + i]))
        steps.append(time.perf_counter() - t0)
    metrics = {k: sum(v) for k, v in torch._dynamo.utils.compilation_time_metrics.items()}
    out = {"prefill_s": prefill_s, "first_step_s": steps[0], "later_steps_s": steps[1:],
           "phases_s": {name: metrics.get(key, 0.0) for name, key in _PHASES.items()},
           # the first calls' time outside Dynamo's compile (running them; kvarn's shared graph)
           "outside_compile_s": prefill_s + steps[0] - metrics.get(_PHASES["dynamo_total"], 0.0),
           "all_s": {k: round(v, 4) for k, v in sorted(metrics.items(), key=lambda kv: -kv[1])[:25]},
           "kernel_extensions": {"built": built, "s": ext_s}}
    if backend is not None:
        from kvarn_compile import lowering

        decisions = list(lowering.DECISIONS)
        out["kvarn_pass_s"] = pass_s[0]
        out["kvarn_sites_rewritten"] = len(backend.report.rewritten)
        out["kvarn_autotune"] = {
            "decisions": len(decisions),
            "benchmarked": sum(1 for d in decisions if d.timings_ms and not d.replayed),
            "replayed": sum(1 for d in decisions if d.replayed),
            "benchmark_ms_of_choices": sum(sum(d.timings_ms.values()) for d in decisions
                                           if d.timings_ms and not d.replayed)}
    return out


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=_positive, default=256, help="prompt tokens (one compiled prefill)")
    p.add_argument("--steps", type=_positive, default=3, help="decode steps after the prefill")
    p.add_argument("--preset", default="k4v2")
    p.add_argument("--warm-runs", type=_positive, default=3,
                   help="warm processes per runner, taking turns; the median one is reported")
    p.add_argument("--runners", nargs="+", default=["kvarn", "inductor"], choices=["kvarn", "inductor"])
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.runner = args.child
        print("RESULT " + json.dumps(_child(args)), flush=True)
        return 0

    from _common import env

    first = lambda r: r["prefill_s"] + r["first_step_s"]  # noqa: E731
    runs: dict[str, dict] = {}
    warm: dict[str, list[dict]] = {runner: [] for runner in args.runners}
    with contextlib.ExitStack() as stack:
        envs = {}
        for runner in args.runners:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"kvarn-compile-{runner}-"))
            envs[runner] = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                                KVARN_AUTOTUNE_DB=os.path.join(tmp, "autotune.json"))
        order = [(r, "cold") for r in args.runners] + [
            (r, "warm") for _ in range(args.warm_runs) for r in args.runners]
        for runner, phase in order:
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, __file__, "--child", runner, "--prompt",
                                str(args.prompt), "--steps", str(args.steps), "--preset",
                                args.preset], env=envs[runner], capture_output=True, text=True)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if r.returncode or not line:
                print(r.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{runner} {phase} run failed (exit {r.returncode})")
            res = json.loads(line[-1][7:])
            res["process_s"] = time.perf_counter() - t0
            if phase == "cold":
                runs[f"{runner}_cold"] = res
            else:
                warm[runner].append(res)
            print(json.dumps({f"{runner}_{phase}": {k: res[k] for k in ("prefill_s", "first_step_s")}}),
                  file=sys.stderr, flush=True)
    for runner, results in warm.items():
        ranked = sorted(results, key=first)
        runs[f"{runner}_warm"] = dict(ranked[(len(ranked) - 1) // 2],
                                      warm_first_s=[round(first(x), 3) for x in results])
    out = {"benchmark": "compile_cpu", "env": env(), "prompt": args.prompt, "steps": args.steps,
           "preset": args.preset, "warm_runs": args.warm_runs, "runs": runs}
    if "kvarn_cold" in runs and "inductor_cold" in runs:
        out["cold_kvarn_over_inductor"] = first(runs["kvarn_cold"]) / first(runs["inductor_cold"])
        out["warm_kvarn_over_inductor"] = first(runs["kvarn_warm"]) / first(runs["inductor_warm"])
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
