"""The flow fuzzer (``kvarn_compile.testing.flows``) on models compiled with ``kvarn_backend``.

Random sequences of calls on one compiled model, every step's logits against the
uncompressed model within the preset's own quantization error (8-bit codes, so a cache that
lost or misplaced tokens stands far out), or refused with a one-line error. A finding prints
its flow's seed and steps. ``KVARN_FLOWS`` scales the number of flows (``KVARN_FLOWS=200`` for
a long run), ``KVARN_FLOW_SEED`` picks another set of flows.

Plain torch between compiled calls is fuzzed too: a cache continued by the model's
uncompiled forward, a helper step run uncompiled, a packed buffer copied into another cache
(``cache_book.PackedBuffer``/``PackedHandle`` give such code the packed tokens dequantized).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvarn_compile import kvarn_backend
from kvarn_compile.cache_book import CacheBook
from kvarn_compile.testing.flows import HelperSubject, HFSubject, run_flows

pytestmark = pytest.mark.usefixtures("many_recompiles")

SEED = int(os.environ.get("KVARN_FLOW_SEED", "0"))
SCALE = float(os.environ.get("KVARN_FLOWS", "0") or 0)


def _flows(default: int) -> int:
    return int(SCALE) if SCALE else default


def _backend():
    return kvarn_backend("k4v2", key_bits=8, value_bits=8, group_size=32, compiler="eager",
                         max_cache_len=256)


@pytest.mark.parametrize("window,graph_break,copies,newest",
                         [(None, False, True, False), (96, False, False, False),
                          (96, False, False, True), (None, True, True, False)],
                         ids=["prefix", "window-later", "newest-window", "graph-break"])
def test_attention_helper_flows(window, graph_break, copies, newest):
    subject = HelperSubject(_backend(), window=window, graph_break=graph_break, copies=copies,
                            newest=newest)
    findings = run_flows(subject, _flows(40), seed=SEED)
    assert not findings, "\n".join(map(str, findings))


#: flows per compiled model: each flow's call signatures, cache types and batch sizes are
#: Dynamo guards of the model's forward, and about 150 varied flows on one compiled model
#: pass Dynamo's recompile limit (64) with any backend (kvarn then refuses: the run would fall
#: back to eager over released caches). A long run compiles a fresh model (a fresh process)
#: every PER_MODEL flows.
PER_MODEL = 40


def test_transformers_flows():
    n, findings = _flows(40), []
    for first in range(0, n, PER_MODEL):
        torch._dynamo.reset()
        findings += run_flows(HFSubject(_backend()), min(PER_MODEL, n - first), seed=SEED,
                              first=first)
    assert not findings, "\n".join(map(str, findings))


def test_the_fuzzer_finds_a_full_precision_graph_reading_a_packed_cache(monkeypatch):
    """Without the guard (before the cache book), a graph the pass leaves unchanged — the
    window read as the newest positions (``[..., -window:]``, which the pass refuses) once the
    sequence outgrows the window — reads the model's buffers, which the packed state
    replaced: the fuzzer must say so."""
    monkeypatch.setattr(CacheBook, "guard", lambda self, args, *rest: args)
    # (seed 0 always: these flows reach such a graph; KVARN_FLOW_SEED picks others, which
    # need not)
    findings = run_flows(HelperSubject(_backend(), window=96, copies=False, newest=True), 40,
                         seed=0)
    assert findings and all("silently wrong" in f.what for f in findings), findings
