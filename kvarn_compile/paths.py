"""Where kvarn_compile keeps files it makes: converted models, corpora, the autotune database."""

from __future__ import annotations

import os
import pathlib

__all__ = ["cache_dir", "CACHE_ENV"]

#: Environment variable that overrides :func:`cache_dir`.
CACHE_ENV = "KVARN_CACHE_DIR"


def cache_dir() -> pathlib.Path:
    """Return the folder that holds converted models and corpora (it may not exist yet).

    Defaults to ``~/.cache/kvarn_compile``; set the environment variable ``KVARN_CACHE_DIR``
    to use another folder. Everything in it can be deleted; it is rebuilt on demand.
    """
    override = os.environ.get(CACHE_ENV)
    if override:
        return pathlib.Path(override).expanduser()
    return pathlib.Path.home() / ".cache" / "kvarn_compile"
