"""``kvarn-compile bench``: decode speed and KV-cache bytes against context length.

For every context length L the three runners of :mod:`.speed` (the model compiled with
``kvarn_backend``, the same model compiled by plain ``torch.compile`` over a full-precision
``StaticCache``, and eager) get L tokens of real text prefilled (by default once, eager, and
copied to each) and decode ``steps`` tokens in one interleaved loop. Every cache is sized to L + steps (a static
cache's decode reads all its slots, so each length compiles its own graphs: Dynamo is
reset between lengths, and the compile times are those of a cold process unless Inductor's
on-disk cache already holds the graphs). Reported per length and runner: ms per decode step
(median, quartiles, range), tokens/s, the first chunk's and first step's times (compiling),
KV bytes in use and allocated. Outputs: a table on stdout, a JSON-ready dict, a PNG plot.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
from typing import Any

import torch

__all__ = ["BENCH_DEFAULTS", "run_bench", "bench_table", "plot_bench", "add_bench_command",
           "add_bench_arguments", "validate_bench_args", "bench_from_args", "bench_command", "SCHEMA"]

BENCH_DEFAULTS = {"lengths": (1024, 2048, 4096), "steps": 12, "chunk": 512, "preset": "k4v2",
                  "warmup": 2, "plot": "kvarn-bench.png"}

#: Keys of every runner row of :func:`run_bench`'s ``rows`` (the JSON schema, tested).
SCHEMA = {
    "top": ("benchmark", "model", "preset", "config", "corpus", "steps", "chunk", "warmup",
            "compiler", "prefill_mode", "env", "rows", "total_s"),
    "row": ("context_tokens", "capacity_tokens", "runners", "kvarn_speedup"),
    "runner": ("label", "ms_per_step", "tokens_per_s", "steps_ms", "compile_prefill_s",
               "compile_decode_s", "prefill_chunk_s", "ttft_incl_compile_s",
               "kv_bytes_used", "kv_bytes_allocated"),
    "spread": ("n", "median", "p25", "p75", "min", "max"),
}


def _env() -> dict[str, Any]:
    import importlib.metadata

    env = {"torch": torch.__version__, "threads": torch.get_num_threads(),
           "machine": platform.machine(), "python": platform.python_version()}
    try:
        env["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        import os
        env["load_avg_1m"] = os.getloadavg()[0]
        env["cpus"] = os.cpu_count()
    except (OSError, AttributeError):
        pass
    return env


@torch.no_grad()
def run_bench(model_name: str | None = None, *, lengths=BENCH_DEFAULTS["lengths"],
              steps: int = BENCH_DEFAULTS["steps"], chunk: int = BENCH_DEFAULTS["chunk"],
              preset: str = BENCH_DEFAULTS["preset"], corpus: str = "lee", compiler: str = "inductor",
              eager: bool = True, warmup: int = BENCH_DEFAULTS["warmup"], progress: bool = True,
              fp_backend: str = "inductor", prefill_mode: str = "eager", model=None, tokenizer=None,
              prompt_fn=None) -> dict[str, Any]:
    """Benchmark every length (see the module docstring); return a JSON-ready dict.

    ``model``/``tokenizer`` replace loading ``model_name`` (the model is deep-copied for the
    KVarN runner); ``prompt_fn(length) -> ids [1, length]`` replaces the corpus text.
    ``fp_backend`` is the baseline's ``torch.compile`` backend (tests use ``"eager"``);
    ``prefill_mode`` is :func:`.speed.prefill`'s ``mode``.
    """
    import copy

    from kvarn_compile.config import get_config
    from kvarn_compile.eval.models import DEFAULT_MODEL, load_model, text_windows
    from kvarn_compile.hf import kv_geometry

    from .progress import Phases
    from .speed import (cache_bytes, decode_interleaved, eager_runner, make_runners, packed_bytes,
                        prefill, spread)

    lengths = sorted(int(L) for L in lengths)
    for L in lengths:
        if L > chunk and L % chunk:
            raise ValueError(f"Expected every length to be a multiple of chunk ({chunk}), but got {L}.")
    if steps < warmup + 1:
        raise ValueError(f"Expected steps >= warmup + 1 ({warmup + 1}), but got {steps}.")
    cfg = get_config(preset)
    phases = Phases(enabled=progress)
    with phases("load model and text"):
        if model is None:
            kv_model, tok = load_model(model_name)
            fp_model, _ = load_model(model_name)
        else:
            fp_model, tok = model, tokenizer
            kv_model = copy.deepcopy(model)
        corpus_used = corpus if prompt_fn is None else None
        if prompt_fn is None:
            text = text_windows(tok, 1, max(lengths), corpus)
            prompt_fn = lambda n: text[:, :n]  # noqa: E731
    kv_heads, head_dim = kv_geometry(fp_model)
    n_layers = fp_model.config.get_text_config(decoder=True).num_hidden_layers
    rows = []
    for L in lengths:
        torch._dynamo.reset()      # new cache shapes: every graph compiles afresh
        c = min(chunk, L)
        max_len = L + steps + 1
        runners = make_runners(kv_model, fp_model, preset=cfg, max_len=max_len, compiler=compiler,
                               eager=eager, fp_backend=fp_backend)
        by = {r.name: r for r in runners}
        fp_alloc = cache_bytes(by["inductor"].cache)
        with phases.group(f"context {L}"):
            source = by.get("eager") or eager_runner(fp_model, max_len)
            last = prefill(runners, prompt_fn(L), c, phases, mode=prefill_mode, source=source)
            decode_interleaved(runners, int(last["inductor"].argmax()), L, steps, phases, warmup=warmup)
        held = L + steps
        dtype_size = next(fp_model.parameters()).element_size()
        fp_used = 2 * n_layers * kv_heads * head_dim * held * dtype_size
        packed = packed_bytes(by["kvarn"].backend)
        row: dict[str, Any] = {"context_tokens": L, "capacity_tokens": max_len, "runners": {},
                               "kvarn_speedup": {}}
        for r in runners:
            compiled = r.name != "eager"
            # time to first token (--prefill compiled): the prompt's chunks through the runner's
            # own compiled graphs, the first one compiling them (benchmarks/bench_ttft_cpu.py
            # measures it without the compile too)
            own = prefill_mode == "compiled" and compiled and "prefill" in r.first_call_s
            row["runners"][r.name] = {
                "label": r.label, "ms_per_step": spread(r.step_ms),
                "tokens_per_s": 1e3 / spread(r.step_ms)["median"] if r.step_ms else None,
                "steps_ms": r.step_ms,
                "compile_prefill_s": r.first_call_s.get("prefill") if compiled else None,
                "compile_decode_s": r.first_call_s.get("decode") if compiled else None,
                "prefill_chunk_s": spread(r.prefill_s) if r.prefill_s else None,
                "ttft_incl_compile_s": (r.first_call_s["prefill"] + sum(r.prefill_s)
                                        if own else None),
                "kv_bytes_used": packed["used"] if r.name == "kvarn" else fp_used,
                "kv_bytes_allocated": packed["allocated"] if r.name == "kvarn" else fp_alloc,
            }
        row["runners"]["kvarn"]["kv_bytes_by_region"] = packed["used_by_region"]
        row["runners"]["kvarn"]["sites_rewritten"] = len(by["kvarn"].backend.report.rewritten)
        row["runners"]["kvarn"]["sites_unchanged"] = len(by["kvarn"].backend.report.unchanged)
        for other in ("inductor", "eager"):
            if other in by and by[other].step_ms and by["kvarn"].step_ms:
                paired = [o / k for o, k in zip(by[other].step_ms, by["kvarn"].step_ms)]
                row["kvarn_speedup"][other] = spread(paired)["median"]
        rows.append(row)
    torch._dynamo.reset()
    return {"benchmark": "kvarn-compile bench", "model": model_name or DEFAULT_MODEL,
            "preset": preset if isinstance(preset, str) else cfg.short(), "config": cfg.short(), "corpus": corpus_used,
            "steps": steps, "chunk": chunk, "warmup": warmup, "compiler": compiler,
            "prefill_mode": prefill_mode, "env": _env(),
            "fp_dtype": str(next(fp_model.parameters()).dtype).replace("torch.", ""),
            "rows": rows, "phases_s": dict(phases.durations), "total_s": phases.elapsed()}


# ------------------------------------------------------------------------------ outputs
def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}" if b >= 2**16 else f"{b / 2**20:.3f}"


def bench_table(res: dict[str, Any]) -> str:
    """The results as a fixed-width text table."""
    from .speed import format_spread

    ttft = res["prefill_mode"] == "compiled"
    head = (f"{'context':>7}  {'runner':14} {'ms/step median [IQR] min-max':>32} {'tok/s':>7} "
            f"{'vs KVarN':>8} {'KV MiB in use':>13} {'allocated':>9} {'compile s':>12}"
            + (f" {'TTFT s':>8}" if ttft else ""))
    lines = [f"kvarn-compile bench: {res['model']}, {res['config']}, {res['steps']} decode steps per "
             f"length ({res['warmup']} warm-up), prefill chunks of {res['chunk']} tokens, "
             f"{res['env']['threads']} thread{'s' if res['env']['threads'] != 1 else ''}",
             head, "-" * len(head)]
    for row in res["rows"]:
        for i, (name, r) in enumerate(row["runners"].items()):
            ratio = row["kvarn_speedup"].get(name)
            comp = " + ".join(f"{r[k]:.0f}" for k in ("compile_prefill_s", "compile_decode_s")
                              if r[k] is not None) or "-"
            tps = f"{r['tokens_per_s']:7.1f}" if r["tokens_per_s"] else "    n/a"
            lines.append(f"{row['context_tokens'] if i == 0 else '':>7}  {r['label']:14} "
                         f"{format_spread(r['ms_per_step']):>32} {tps} "
                         f"{(f'{ratio:.2f}x' if ratio else ''):>8} {_mib(r['kv_bytes_used']):>13} "
                         f"{_mib(r['kv_bytes_allocated']):>9} {comp:>12}"
                         + (f" {_ttft(r):>8}" if ttft else ""))
    compile_note = ("first prefill chunk + first decode step" if res["prefill_mode"] == "compiled" else
                    "first decode step (the prompt is prefilled once, eager, and copied; KVarN's "
                    "first step also packs it)")
    lines.append("vs KVarN: median of the per-step ratios runner / KVarN (> 1: KVarN is faster). "
                 f"compile s: {compile_note}, incl. compiling. KV MiB in use: the tokens held; "
                 "allocated: the capacity (context + steps)."
                 + (" TTFT s: time to first token, the prompt's chunks through the model's own "
                    "compiled graphs, the first chunk compiling them (without the compile: "
                    "benchmarks/bench_ttft_cpu.py)." if ttft else ""))
    return "\n".join(lines)


def _ttft(r: dict[str, Any]) -> str:
    return "-" if r.get("ttft_incl_compile_s") is None else f"{r['ttft_incl_compile_s']:.1f}"


def plot_bench(res: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """Two panels against context length: decode tokens/s (median, IQR bars) and KV MiB."""
    from .report import _plt

    plt = _plt()
    rows = res["rows"]
    xs = [row["context_tokens"] for row in rows]
    names = list(rows[0]["runners"])
    colors = {"kvarn": "tab:blue", "inductor": "tab:red", "eager": "tab:gray"}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    dodge = {name: 2 ** (0.025 * (i - (len(names) - 1) / 2)) for i, name in enumerate(names)}
    for name in names:
        rs = [row["runners"][name] for row in rows]
        med = [1e3 / r["ms_per_step"]["median"] if r["ms_per_step"]["n"] else float("nan") for r in rs]
        lo = [m - 1e3 / r["ms_per_step"]["p75"] if r["ms_per_step"]["n"] else 0 for m, r in zip(med, rs)]
        hi = [1e3 / r["ms_per_step"]["p25"] - m if r["ms_per_step"]["n"] else 0 for m, r in zip(med, rs)]
        a1.errorbar([x * dodge[name] for x in xs], med, yerr=[lo, hi], marker="o", capsize=3,
                    color=colors.get(name), label=rs[0]["label"])
    a1.set_title("decode speed (median, bars: interquartile range)")
    a1.set_ylabel("tokens/s (batch 1)")
    a1.set_ylim(bottom=0)
    used = {name: [row["runners"][name]["kv_bytes_used"] / 2**20 for row in rows] for name in names}
    a2.plot(xs, used["inductor"], "o-", color=colors["inductor"],
            label=f"{res.get('fp_dtype', 'fp32').replace('float', 'fp')} cache")
    a2.plot(xs, [u / 2 for u in used["inductor"]] if res.get("fp_dtype") == "float32" else [],
            "o:", color="tab:orange", label="fp16 cache (for scale)")
    a2.plot(xs, used["kvarn"], "o-", color=colors["kvarn"], label=f"KVarN {res['preset']} in use")
    a2.plot(xs, [row["runners"]["kvarn"]["kv_bytes_allocated"] / 2**20 for row in rows], "s--",
            color=colors["kvarn"], markerfacecolor="none", markersize=9,
            label="KVarN allocated (capacity)")
    a2.set_title("KV cache bytes")
    a2.set_ylabel("MiB")
    a2.set_ylim(bottom=0)
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("context length (tokens)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    t = res["env"]["threads"]
    fig.suptitle(f"{res['model']}: KVarN {res['preset']} vs full precision, decode at batch 1, "
                 f"{t} CPU thread{'s' if t != 1 else ''}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return pathlib.Path(path)


# ------------------------------------------------------------------------------ CLI
BENCH_HELP = "speed and KV bytes vs context length: KVarN vs Inductor fp vs eager"
BENCH_DESCRIPTION = ("Decode speed and KV-cache bytes at several context lengths: the model compiled "
                     "with kvarn_backend vs the same model compiled by plain torch.compile (Inductor) "
                     "over a full-precision static cache, and eager. Table on stdout, JSON and a PNG "
                     "plot.")


def add_bench_command(sub) -> argparse.ArgumentParser:
    """The ``bench`` subcommand and its arguments, on the subparsers ``sub``."""
    from kvarn_compile.eval.args import add_command

    return add_command(sub, "bench", help=BENCH_HELP, description=BENCH_DESCRIPTION,
                       arguments=add_bench_arguments)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    from kvarn_compile.eval.args import int_at_least, output_file
    from kvarn_compile.config import PRESETS

    from .cli import add_threads_argument
    from .speed import PREFILL_MODES

    d = BENCH_DEFAULTS
    p.add_argument("--lengths", type=int_at_least(1), nargs="+", default=list(d["lengths"]), metavar="L",
                   help=f"context lengths in tokens, each a multiple of --chunk (default "
                        f"{' '.join(map(str, d['lengths']))}; e.g. --lengths 2048 8192 16384 for longer "
                        "contexts: each length compiles its own graphs)")
    p.add_argument("--steps", type=int_at_least(d["warmup"] + 2, "two warm-up steps compile"),
                   default=d["steps"], metavar="N",
                   help=f"decode steps per length, the first {d['warmup']} not timed (default {d['steps']})")
    p.add_argument("--chunk", type=int_at_least(1), default=d["chunk"], metavar="N",
                   help=f"prefill chunk length (default {d['chunk']})")
    p.add_argument("--preset", default=d["preset"], choices=sorted(PRESETS),
                   help=f"KVarN format (default {d['preset']})")
    p.add_argument("--compiler", default="inductor", choices=["inductor", "eager"],
                   help="what runs kvarn_backend's rewritten graphs (default inductor)")
    p.add_argument("--no-eager", action="store_true", help="leave the eager model out")
    p.add_argument("--prefill", choices=PREFILL_MODES, default="eager",
                   help="eager (default): one full-precision eager prefill per length, copied to "
                        "every model (only decode graphs compile); compiled: each compiled model "
                        "prefills itself (its prefill graph's compile time is reported too)")
    add_threads_argument(p)
    p.add_argument("--plot", type=output_file, default=d["plot"], metavar="PATH",
                   help=f"PNG plot of tokens/s and KV bytes against context (default ./{d['plot']})")


def validate_bench_args(args: argparse.Namespace) -> None:
    from kvarn_compile.eval.args import UsageError

    bad = [L for L in args.lengths if L > args.chunk and L % args.chunk]
    if bad:
        raise UsageError(f"argument --lengths: expected multiples of --chunk ({args.chunk}) so every "
                         f"prefill chunk has one length, but got {bad[0]}")


def bench_from_args(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_grad_enabled(False)
    res = run_bench(args.model, lengths=args.lengths, steps=args.steps, chunk=args.chunk,
                    preset=args.preset, corpus=args.corpus, compiler=args.compiler,
                    eager=not args.no_eager, prefill_mode=args.prefill, progress=not args.no_progress)
    print(bench_table(res))
    path = plot_bench(res, args.plot)
    print(f"plot: {path}")
    res["plot"] = str(path)
    return res


def bench_command(args: argparse.Namespace) -> int:
    """Run ``kvarn-compile bench`` with checked ``args``: under ``--threads``, results to ``--json``."""
    from .cli import run_with_threads

    return run_with_threads(args, "bench", bench_from_args)
