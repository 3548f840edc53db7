"""Fixtures of the lowering tests."""

from __future__ import annotations

import pytest
import torch

from kvarn_compile import autotune, lowering


@pytest.fixture
def fresh_inductor(tmp_path, monkeypatch):
    """An empty Inductor cache and autotune database per test (a cache hit would skip the
    lowering; an earlier winner would skip the benchmark)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("KVARN_AUTOTUNE_DB", str(tmp_path / "autotune.json"))
    autotune.DB.clear()
    lowering.register()
    torch._dynamo.reset()
    yield tmp_path
    autotune.DB.clear()
    torch._dynamo.reset()
