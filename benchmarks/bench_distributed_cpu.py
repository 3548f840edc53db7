"""CPU, gloo: the default model over 1..N ranks, tensor or context parallel, KVarN cache per rank.

    python benchmarks/bench_distributed_cpu.py [--ranks 1 2 3] [--prompt 512] [--new 32]
        [--preset k4v2] [--compiler inductor|eager] [--mode tp|cp] [--cache kvarn|fp]

For each rank count the script starts ``torchrun --standalone --nproc-per-node N`` on
itself. Every rank loads SmolLM2-135M with ``tp_plan="auto"`` (one process and no plan for
N=1), compiles it with ``kvarn_backend``, prefills one ``--prompt``-token prompt into a
per-rank ``StaticCache`` (``static_cache_for``: the pass takes it over into the packed
state and frees it; the prompt is the start of the Lee news corpus), then decodes ``--new`` greedy tokens. Reported per rank count:
packed bytes on every rank and in total (``kvarn_compile.distributed.gather_report``), the
full-precision cache bytes each rank freed, prefill seconds (including compilation), decode
tokens/s (medians over the steps after the first two, which compile), the greedy tokens
and whether they equal the one-rank tokens.

SmolLM2-135M has 9 query and 3 KV heads; transformers shards by whole heads and never
replicates KV heads, so 2 ranks are refused (``check_hf_tensor_parallel``, the message is
in the JSON) and 3 ranks hold one KV head each. Every rank runs one thread
(``OMP_NUM_THREADS=1``); on a machine with fewer cores than ranks the ranks share cores
and tokens/s says little about scaling, the bytes per rank are exact.

``--mode cp`` (context parallel, :mod:`kvarn_compile.ops.context_parallel`): every rank loads
the whole model (no plan, any rank count), ``kvarn_backend(context_parallel=True)``; each
rank holds 1/N of every layer's packed tiles, sink and tail replicated, and each attention
call runs one ``all_gather``. ``--cache fp`` compiles with plain Inductor over the
full-precision ``StaticCache`` instead (tensor parallel only): it tells whether tokens that
differ between rank counts come from the sharded sums themselves or from the quantized cache.
Prints JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import env  # noqa: E402

def _rank_main(opts) -> int:
    import torch
    import torch.distributed as dist

    from kvarn_compile import kvarn_backend
    from kvarn_compile.distributed import check_hf_tensor_parallel, gather_report, hf_tp_kwargs
    from kvarn_compile.eval.models import _default_model_dir, text_windows
    from kvarn_compile.hf import kv_geometry, static_cache_for

    torch.set_grad_enabled(False)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=opts.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if rank == 0:     # converts the GGUF and fetches the corpus once, before the others read
        text_windows(AutoTokenizer.from_pretrained(_default_model_dir()), 1, opts.prompt)
    dist.barrier()
    path = _default_model_dir()

    tp = opts.mode == "tp"
    heads = check_hf_tensor_parallel(AutoConfig.from_pretrained(path), world if tp else 1)
    kw = hf_tp_kwargs() if world > 1 and tp else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa", **kw).eval()
    if opts.cache == "fp":
        backend = None
        model.compile(backend="inductor" if opts.compiler == "inductor" else "eager")
    else:
        backend = kvarn_backend(opts.preset, compiler=opts.compiler,
                                max_cache_len=opts.prompt + opts.new,
                                context_parallel=None if tp else True)
        model.compile(backend=backend)
    cache = static_cache_for(model, opts.prompt + opts.new)
    kv_heads, head_dim = kv_geometry(model)
    fp32_bytes = sum(t.numel() * t.element_size() for layer in cache.layers
                     for t in (layer.keys, layer.values))
    prompt = text_windows(AutoTokenizer.from_pretrained(path), 1, opts.prompt)  # news text

    def step(ids, start):
        out = model(input_ids=ids, cache=cache, use_cache=True,
                    cache_position=torch.arange(start, start + ids.shape[1]))
        return out.logits[:, -1:].argmax(-1)

    dist.barrier()
    t0 = time.perf_counter()
    token = step(prompt, 0)
    prefill_s = time.perf_counter() - t0
    tokens, times = [token.item()], []
    for i in range(opts.new - 1):
        dist.barrier()           # every rank starts the step together: time the slowest
        t0 = time.perf_counter()
        token = step(token, opts.prompt + i)
        times.append(time.perf_counter() - t0)
        tokens.append(token.item())
    steady = times[2:] or times
    report = gather_report(backend) if backend is not None else None
    if rank == 0:
        med = statistics.median(steady)
        row = {"ranks": world, "mode": opts.mode, "cache": opts.cache,
               "kv_heads_per_rank": kv_heads, "head_dim": head_dim,
               "kv_replicas": heads.kv_replicas if tp else 1}
        if report is not None:
            row.update({
                "bytes_per_rank": report.bytes_per_rank, "bytes_total": report.bytes_total,
                "fp32_cache_bytes_per_rank_released": fp32_bytes,
                "released_bytes_per_rank": [r.released_bytes for r in report.ranks],
                "sites_rewritten": report.ranks[0].rewritten, "graphs": report.ranks[0].graphs,
                "consistent": report.consistent})
            if not tp:
                row["tile_slots_per_rank"] = [sum(s.max_tiles for s in backend.states.values())]
        else:
            row["fp32_cache_bytes_per_rank"] = fp32_bytes
        row.update({
            "prefill_s_incl_compile": prefill_s,
            "first_steps_ms": [t * 1e3 for t in times[:2]],
            "decode_ms_median": med * 1e3,
            "decode_ms_p20": sorted(steady)[int(0.2 * len(steady))] * 1e3,
            "decode_ms_p80": sorted(steady)[min(int(0.8 * len(steady)), len(steady) - 1)] * 1e3,
            "decode_tokens_per_s": 1.0 / med,
            "tokens": tokens,
        })
        pathlib.Path(opts.out).write_text(json.dumps(row))
    dist.destroy_process_group()
    return 0


def _launch(n: int, opts, out: pathlib.Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", __file__, "--rank-program", "--out", str(out),
           "--prompt", str(opts.prompt), "--new", str(opts.new), "--preset", opts.preset,
           "--compiler", opts.compiler, "--timeout", str(opts.timeout), "--mode", opts.mode,
           "--cache", opts.cache]
    env_vars = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env_vars, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=opts.run_timeout)
    if proc.returncode:
        return {"ranks": n, "error": f"exit {proc.returncode}", "output_tail": proc.stdout[-3000:]}
    row = json.loads(out.read_text())
    row["wall_s"] = time.perf_counter() - t0
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--preset", default="k4v2")
    p.add_argument("--compiler", default="inductor", choices=["inductor", "eager"])
    p.add_argument("--mode", default="tp", choices=["tp", "cp"],
                   help="tp: tensor parallel (heads per rank); cp: context parallel (tiles per rank)")
    p.add_argument("--cache", default="kvarn", choices=["kvarn", "fp"],
                   help="kvarn: kvarn_backend; fp: plain torch.compile over the fp32 StaticCache "
                        "(tensor parallel only)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per collective")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds per rank count")
    p.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.mode == "cp" and opts.cache == "fp":
        p.error("--cache fp is a tensor-parallel baseline; use it with --mode tp")
    if min(opts.ranks) < 1 or opts.prompt < 1 or opts.new < 4:
        p.error("expected --ranks >= 1, --prompt >= 1 and --new >= 4 (two steps compile)")
    if opts.rank_program:
        return _rank_main(opts)

    result = {"benchmark": "distributed_cpu", "env": {**env(), "cpu_cores": os.cpu_count(),
                                                      "threads_per_rank": 1},
              "model": "smollm2-135m-instruct (9 query / 3 KV heads, head_dim 64, 30 layers)",
              "preset": opts.preset, "compiler": opts.compiler, "prompt": opts.prompt,
              "new_tokens": opts.new, "mode": opts.mode, "cache": opts.cache}

    from transformers import AutoConfig

    from kvarn_compile.distributed import check_hf_tensor_parallel
    from kvarn_compile.eval.models import _default_model_dir

    config = AutoConfig.from_pretrained(_default_model_dir())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in opts.ranks:
            try:
                if opts.mode == "tp":
                    check_hf_tensor_parallel(config, n)
            except ValueError as err:
                rows.append({"ranks": n, "refused": str(err)})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                continue
            rows.append(_launch(n, opts, pathlib.Path(tmp) / f"{opts.mode}{n}.json"))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}),
                  file=sys.stderr, flush=True)
    one = next((r for r in rows if r.get("ranks") == 1 and "tokens" in r), None)
    for r in rows:
        if one is not None and "tokens" in r:
            r["same_tokens_as_1_rank"] = r["tokens"] == one["tokens"]
            r["first_different_token"] = next(
                (i for i, (a, b) in enumerate(zip(r["tokens"], one["tokens"])) if a != b), None)
            if "bytes_per_rank" in r:
                r["bytes_per_rank_over_1_rank"] = max(r["bytes_per_rank"]) / one["bytes_per_rank"][0]
    result["tensor_parallel" if opts.mode == "tp" else "context_parallel"] = rows
    print(json.dumps(result, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
