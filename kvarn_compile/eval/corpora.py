"""Real text for tuning and evaluating KV-cache quantizers: :func:`text_windows`.

The corpora are test data files inside the ``gensim`` wheel, fetched once with
``pip download`` (gensim is never installed or imported) into a user cache folder
(:func:`~kvarn_compile.paths.cache_dir`), never inside the repository.

* ``"lee"`` (default): the Lee background corpus (gensim's ``lee_background.cor``, after
  Lee, Pincombe and Welsh 2005), 300 short ABC news articles (~75k tokens).
* ``"enwiki"``: 100+ English Wikipedia articles (encyclopedic prose, a different style),
  converted from wikitext to plain paragraphs; use it for held-out evaluation.
"""

from __future__ import annotations

import bz2
import functools
import html
import logging
import pathlib
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvarn_compile.paths import cache_dir

from .assets import AssetMissingError, _write_bytes_atomic

if TYPE_CHECKING:  # transformers is imported lazily: it takes seconds
    from transformers import PreTrainedTokenizerBase

__all__ = ["CORPORA", "corpus_token_ids", "load_corpus", "text_windows"]

log = logging.getLogger(__name__)

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
