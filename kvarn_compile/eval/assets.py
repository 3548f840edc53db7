"""Local copies of the evaluation assets (the default model, the text corpora) in the cache folder.

:func:`~kvarn_compile.paths.cache_dir` holds them, never the repository. A copy is written
to a temporary name and renamed into place, so concurrent processes never see half a file
or folder; :class:`AssetMissingError` says which command fetches what is missing.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

__all__ = ["AssetMissingError"]


class AssetMissingError(RuntimeError):
    """A model file or corpus is not available locally; the message names the fixing command."""


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
