"""Arguments and entry point of ``kvarn-compile eval`` (wired into :mod:`kvarn_compile.cli`), and
``--threads`` (:func:`add_threads_argument`, :func:`using_threads`), which ``run`` and ``bench`` share."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["add_eval_command", "add_eval_arguments", "validate_eval_args", "eval_main",
           "add_threads_argument", "using_threads", "run_with_threads"]

EVAL_HELP = "quality evaluation: static vs pseudo-decode KL, diagnostics, product path, retrieval"


def add_eval_command(sub) -> argparse.ArgumentParser:
    """The ``eval`` subcommand and its arguments, on the subparsers ``sub``."""
    from kvarn_compile.eval.args import add_common_arguments

    p = sub.add_parser("eval", help=EVAL_HELP, description=EVAL_HELP[0].upper() + EVAL_HELP[1:] + ".")
    add_eval_arguments(p)
    add_common_arguments(p, json_flag=False)
    return p


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the eval subcommand. Flags left unset take the full-run or --quick defaults."""
    from kvarn_compile.eval.args import add_model_arguments, int_at_least, output_folder
    from kvarn_compile.config import PRESETS

    from .harness import ALL_METHODS, RULES
    from .settings import QUICK_RETRIEVAL_LINES, RETRIEVAL_LINES

    add_model_arguments(p, corpus_default=None)
    p.add_argument("--key-outliers", action="store_true",
                   help="stress model: add k_proj-bias-like offsets (100, 150) to two key channels "
                        "of the first 4 layers (kvarn_compile.eval.key_outliers.add_key_outliers)")
    p.add_argument("--presets", nargs="+", default=None, choices=sorted(PRESETS),
                   help="default: k2v2 k4v2 k4v4 (--quick: k2v2)")
    p.add_argument("--methods", nargs="+", default=None, choices=ALL_METHODS,
                   help="default: none kivi hadamard kvarn kvarn+clip (with --key-outliers also "
                        "hadamard+krot kvarn+krot: the rotated-only reference key frame)")
    p.add_argument("--lengths", nargs="+", type=int_at_least(2), default=None, metavar="L",
                   help="context lengths L (default: 512 1024 2048; --quick: 384 768)")
    p.add_argument("--windows", type=int_at_least(1), default=None, metavar="N",
                   help="text windows averaged (default 2; --quick 1)")
    p.add_argument("--block", type=int_at_least(1), default=None, metavar="B",
                   help="pseudo-decode block size b (default 128)")
    p.add_argument("--offset", type=int_at_least(0), default=None, metavar="TOKENS",
                   help="token offset of the first window (default 0)")
    p.add_argument("--rule", default=None, choices=RULES,
                   help="pseudo-decode freezing rule (default after_block: a block sees itself exact)")
    p.add_argument("--out", type=output_folder, default="kvarn-eval", metavar="FOLDER",
                   help="output folder for eval.json, summary.md and the PNG plots (default ./kvarn-eval)")
    p.add_argument("--quick", action="store_true",
                   help="the smoke run: one window, 384 and 768 tokens, k2v2 only (about 2 minutes "
                        "on 2 idle cores)")
    p.add_argument("--held-out", action="store_true",
                   help="evaluate held-out text: the corpus past the tuning windows, and enwiki")
    p.add_argument("--held-out-offset", type=int_at_least(0), default=None, metavar="TOKENS",
                   help="token offset of held-out text (default 40000)")
    p.add_argument("--no-diagnostics", action="store_true",
                   help="skip the diagnostics (per-layer errors, error split, outlier restore)")
    p.add_argument("--diag-length", type=int_at_least(2), default=None, metavar="L",
                   help="context of the diagnostics (default: the largest length <= 1024)")
    p.add_argument("--diag-windows", type=int_at_least(1), default=None, metavar="N",
                   help="windows of the diagnostics (default 2)")
    p.add_argument("--no-product", action="store_true", help="skip the packed-cache (product path) check")
    p.add_argument("--product-length", type=int_at_least(2), default=None, metavar="L",
                   help="context of the product-path check (default: the largest length <= 1024)")
    p.add_argument("--product-presets", nargs="+", default=None, choices=sorted(PRESETS),
                   help="presets of the product-path check (default: the first two presets)")
    p.add_argument("--generate", type=int_at_least(1), default=None, metavar="N",
                   help="also compare N greedy tokens through KVarNCache with the fp model")
    p.add_argument("--no-retrieval", action="store_true", help="skip the line-retrieval check")
    p.add_argument("--retrieval-lines", nargs="+", type=int_at_least(1), default=None, metavar="N",
                   help=f"record lengths in lines (default {' '.join(map(str, RETRIEVAL_LINES))}; "
                        f"--quick {' '.join(map(str, QUICK_RETRIEVAL_LINES))})")
    p.add_argument("--retrieval-prompts", type=int_at_least(1), default=None, metavar="N",
                   help="records per length (default 1)")
    p.add_argument("--retrieval-questions", type=int_at_least(1), default=None, metavar="N",
                   help="questions per record (default 6; --quick 4)")
    p.add_argument("--retrieval-presets", nargs="+", default=None, choices=sorted(PRESETS),
                   help="presets of the retrieval check (default k2v2)")
    p.add_argument("--outlier-fractions", nargs="+", type=float, default=None,
                   help="fractions of worst entries restored in the outlier experiment (default 0.01 0.05 0.1)")
    p.add_argument("--seed", type=int, default=None, help="seed of the retrieval records (default 0)")
    add_threads_argument(p)


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """--threads (eval, run, bench); apply it with :func:`using_threads`."""
    p.add_argument("--threads", type=_threads_arg, default="auto", metavar="N|auto",
                   help="torch CPU threads, or 'auto' (default): 1 when other processes already keep "
                        ">= cores - 0.5 cores busy (sampled for 0.5 s; several multi-threaded processes "
                        "on few cores slow each other down several times), else torch's choice")


@contextlib.contextmanager
def using_threads(value: str | int | None, command: str = "eval"):
    """Run the block with the thread count ``--threads`` asks for; restore it afterwards."""
    import torch

    threads = torch.get_num_threads()
    wanted = _threads(value, command)
    if wanted:
        torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_with_threads(args: argparse.Namespace, command: str,
                     work: Callable[[argparse.Namespace], dict[str, Any]]) -> int:
    """``work(args)`` with the threads ``--threads`` asks for; its results go to ``--json``."""
    from kvarn_compile.eval.args import write_json

    with using_threads(args.threads, command):
        results = work(args)
    if args.json:
        write_json(args.json, results)
    return 0


def settings_from_args(args: argparse.Namespace):
    from .settings import EvalSettings, quick_settings

    over = {}
    pairs = {"model": "model", "corpus": "corpus", "presets": "presets", "methods": "methods",
             "lengths": "lengths", "windows": "windows", "block": "block", "offset": "offset_tokens",
             "rule": "rule", "held_out_offset": "held_out_offset", "diag_length": "diag_length",
             "diag_windows": "diag_windows", "product_length": "product_length", "product_presets": "product_presets",
             "generate": "generate",
             "retrieval_lines": "retrieval_lines", "retrieval_prompts": "retrieval_prompts",
             "retrieval_questions": "retrieval_questions", "retrieval_presets": "retrieval_presets",
             "outlier_fractions": "outlier_fractions", "seed": "seed"}
    for arg, field in pairs.items():
        value = getattr(args, arg)
        if value is not None:
            over[field] = tuple(value) if isinstance(value, list) else value
    if args.held_out:
        over["held_out"] = True
    if args.key_outliers:
        over["key_outliers"] = True
    if args.no_diagnostics:
        over["diagnostics"] = False
    if args.no_product:
        over["product"] = False
    if args.no_retrieval:
        over["retrieval"] = False
    return quick_settings(**over) if args.quick else EvalSettings(**over)


def _threads_arg(value: str) -> str:
    if value != "auto":
        try:
            if int(value) >= 1:
                return value
        except ValueError:
            pass
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'auto', but got {value!r}")
    return value


def validate_eval_args(args: argparse.Namespace) -> None:
    """Build the settings and check them now, before the model loads (usage errors)."""
    from kvarn_compile.eval.args import UsageError

    try:
        settings_from_args(args).validate()
    except ValueError as err:
        raise UsageError(str(err).rstrip(".")) from None


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) CPU jiffies of the whole machine from /proc/stat; None where unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)      # idle + iowait
    return sum(fields) - idle, sum(fields)


def _busy_cores(sample_s: float = 0.5) -> float | None:
    """How many cores other processes keep busy right now: sampled over ``sample_s`` seconds
    from /proc/stat (this process sleeps meanwhile), else the 1-minute load average. The load
    average lags: right after another run it still counts that run for a minute or more."""
    import os
    import time

    first = _cpu_times()
    if first is not None:
        time.sleep(sample_s)
        second = _cpu_times()
        if second is not None and second[1] > first[1]:
            return (os.cpu_count() or 1) * (second[0] - first[0]) / (second[1] - first[1])
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None


def _threads(value: str | int | None, command: str = "eval") -> int | None:
    """Threads to use: an explicit count, or for 'auto' 1 on a busy machine and None otherwise."""
    if value is None or value == "":
        return None
    if str(value) != "auto":
        n = int(value)
        if n < 1:
            raise ValueError(f"Expected --threads >= 1 or 'auto', but got {value!r}.")
        return n
    import os
    cores = os.cpu_count() or 1
    busy = _busy_cores() if cores > 1 else None
    if busy is not None and busy >= cores - 0.5:
        print(f"kvarn-compile {command}: other processes keep {busy:.1f} of {cores} cores busy, using 1 "
              "torch thread (pass --threads N to override)", file=sys.stderr)
        return 1
    return None


def eval_main(args: argparse.Namespace) -> int:
    from .findings import FaithfulnessError
    from .report import markdown_summary, write_outputs
    from .suite import run_eval

    settings = settings_from_args(args)
    t0 = time.perf_counter()
    status = 0
    with using_threads(args.threads):
        try:
            result = run_eval(settings, progress=not args.no_progress)
        except FaithfulnessError as err:
            result, status = err.result, 3
            print(f"error: {err}", file=sys.stderr)
    print(markdown_summary(result), flush=True)      # the results first: saving may still fail
    try:
        paths = write_outputs(result, args.out)
    except OSError as err:
        from kvarn_compile.eval.args import ResultsNotSaved, rescue_folder

        rescue = rescue_folder("kvarn-eval-")
        write_outputs(result, rescue)
        raise ResultsNotSaved(f"could not write into {args.out} ({err.strerror or err}); the results "
                              f"were saved to {rescue} instead") from None
    print(f"wrote {', '.join(str(p) for p in paths.values())} in {time.perf_counter() - t0:.1f} s")
    return status
