"""Autotuning of KVarN: kernel choices (an exportable database) and the quantization knobs.

Two kinds of decisions, kept apart because one changes the numbers and the other does not:

**Kernel choices** (numerics-neutral). The Inductor lowerings of ``kvarn::attention``
(``kvarn_compile.lowering``) benchmark their choices with ``autotune_select_algorithm``
(the reference op as an extern kernel, Inductor-generated code from a torch
decomposition, and on CUDA the Triton templates with their tile configs). The winner of
every such benchmark is recorded here through Inductor's feedback-saver hook, keyed by
:class:`TuneKey` (op, device name and capability, dtype, preset, head dim, KV heads, query
heads, batch, query bucket, cache-length bucket). :func:`export` writes the records as
versioned JSON, :func:`load` reads them back; a lowering that finds its key offers exactly
one choice, so Inductor skips benchmarking. Entries recorded with another torch, triton or
kvarn source version are *stale*, entries from another device are *foreign*: both are
ignored on load with a logged reason. CLI: ``kvarn-compile autotune export|import PATH``.

File format (``"format": "kvarn-autotune"``, ``"version": 1``)::

    {"format": "kvarn-autotune", "version": 1,
     "entries": [{"key": {"op": "kvarn_attention", "device": "x86_64", "capability": "cpu",
                          "dtype": "torch.float32", "preset": "k4v2", "head_dim": 64,
                          "kv_heads": 3, "q_heads": 9, "batch": 1, "query": "decode",
                          "length_bucket": 8192},
                  "winner": {"choice": "dense"},
                  "timings_ms": {"reference": 1.92, "dense": 0.71},
                  "torch": "2.13.0+cpu", "triton": "3.9.0", "kvarn_sources": "9f2c...",
                  "recorded": "2026-07-01T12:00:00+00:00"}]}

A template winner carries its tile config: ``{"choice": "decode", "config": {"BLOCK_N": 64,
"BLOCK_M": 16, "SPLIT": 8, "num_warps": 4, "num_stages": 1}}``.

**Quantization knobs** (change the numbers): the tile length G and the Sinkhorn iteration
count T. :func:`select_quant_knobs` is the rule, a pure function: every candidate is
measured on real K/V rows against the preset's own (G, T); a candidate is *admissible*
when its relative reconstruction error of K and of V is at most ``(1 + tolerance)`` times
the preset's; among admissible candidates the fastest tile quantization wins (ties go to
the preset). Where it runs:

* :class:`KnobTuner` (``kvarn_backend(..., tune_knobs=KnobTuning(...))``) chooses **T per
  layer at the layer's first tile completion**: an observer op in the compiled graph sees
  the full-precision rows of the first tile just before ``kvarn::append_`` freezes it.
  That first tile is quantized with the preset's T (the only admissible-by-definition
  value known at that point); the chosen T applies from the next tile on, after a
  recompile of the graph without observers. G is not tuned there: the packed state is
  allocated when the graph is compiled, before any K/V exist, and G fixes its layout.
* :class:`kvarn_compile.hf.TunedKVarNCache` (a ``KVarNCache``) chooses **G and T per layer before
  allocation**: its layers allocate lazily at the first update, which sees the prefill K/V.

The rule, the tolerance and every decision (with the reason of each rejection) go into
``backend.report.notes`` and ``KnobTuner.decisions``.

Modules, one reason to change each: :mod:`.db` (the kernel-choice database, its file
format and CLI), :mod:`.knobs` (the knob rule), :mod:`.tuning` (tuning at run time).
"""

from __future__ import annotations

from typing import Any

from kvarn_compile.autotune.db import (
    DB, AutotuneDB, LoadReport, TuneKey, cli_main, default_db_path,
    environment, export, load, preset_name,
)
from kvarn_compile.autotune.knobs import (
    RULE, CandidateResult, Decision, QuantKnobs, median_timer, select_quant_knobs,
)

__all__ = [
    "TuneKey", "AutotuneDB", "DB", "export", "load", "LoadReport", "environment", "preset_name",
    "default_db_path", "cli_main",
    "QuantKnobs", "CandidateResult", "Decision", "select_quant_knobs", "median_timer",
    "KnobTuning", "KnobTuner", "RULE",
]

_TUNING = ("KnobTuning", "KnobTuner")


def __getattr__(name: str) -> Any:
    # the runtime-tuning names load their module (and its op kernels) on first use
    if name in _TUNING:
        from kvarn_compile.autotune import tuning

        return getattr(tuning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
