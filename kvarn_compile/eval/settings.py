"""What one evaluation run does: :class:`EvalSettings` (the full run) and :func:`quick_settings`."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvarn_compile.config import PRESETS

from .harness import DEFAULT_METHODS, OUTLIER_METHODS, RULES, method_config

__all__ = ["EvalSettings", "quick_settings", "RETRIEVAL_LINES", "QUICK_RETRIEVAL_LINES"]

#: Record lengths (lines) of the retrieval check: full run and ``--quick``. The model is tiny;
#: these are lengths where the full-precision model still answers (see retrieval.py).
RETRIEVAL_LINES: tuple[int, ...] = (20, 40, 60)
QUICK_RETRIEVAL_LINES: tuple[int, ...] = (40,)


@dataclasses.dataclass
class EvalSettings:
    """Everything that defines one evaluation run (recorded verbatim in the JSON).

    The defaults are the full run (about 13 minutes on 2 idle CPU cores for the default
    model); :func:`quick_settings` gives the 2-minute smoke run. ``methods=None`` resolves to
    :data:`~.harness.DEFAULT_METHODS` (with ``key_outliers``: :data:`~.harness.OUTLIER_METHODS`).
    """

    model: str | None = None                 # None: SmolLM2-135M-Instruct; else a local folder
    key_outliers: bool = False               # stress model: key_outliers.add_key_outliers (bias-like keys)
    corpus: str = "lee"
    presets: tuple[str, ...] = ("k2v2", "k4v2", "k4v4")
    methods: tuple[str, ...] | None = None
    lengths: tuple[int, ...] = (512, 1024, 2048)
    windows: int = 2
    block: int = 128
    offset_tokens: int = 0                   # token offset of the first window
    rule: str = "after_block"                # pseudo-decode freezing rule (harness.RULES)
    held_out: bool = False                   # evaluate held-out text instead (see run_eval)
    held_out_offset: int = 40_000            # token offset past the tuning windows
    held_out_corpus: str = "enwiki"
    diagnostics: bool = True
    diag_length: int | None = None           # None: the largest length <= 1024
    diag_windows: int = 2
    diag_presets: tuple[str, ...] | None = None  # None: every preset
    outlier_fractions: tuple[float, ...] = (0.01, 0.05, 0.10)
    product: bool = True
    product_length: int | None = None        # None: the largest length <= 1024
    product_windows: int = 1
    product_presets: tuple[str, ...] | None = None  # None: the first two presets
    generate: int = 0                        # >0: greedy generation check with this many tokens
    generate_prompt: int = 1024
    generate_methods: tuple[str, ...] = ("kvarn",)
    retrieval: bool = True
    retrieval_lines: tuple[int, ...] = RETRIEVAL_LINES
    retrieval_prompts: int = 1
    retrieval_questions: int = 6
    retrieval_presets: tuple[str, ...] = ("k2v2",)
    retrieval_max_new_tokens: int = 6
    seed: int = 0
    quick: bool = False

    def __post_init__(self) -> None:
        if self.methods is None:
            self.methods = OUTLIER_METHODS if self.key_outliers else DEFAULT_METHODS

    def validate(self) -> None:
        for p in (*self.presets, *(self.diag_presets or ()), *(self.product_presets or ()),
                  *self.retrieval_presets):
            if p not in PRESETS:
                raise ValueError(f"Expected presets from {tuple(PRESETS)}, but got {p!r}.")
        for m in self.methods:
            method_config(m, "k4v2")   # raises a clear ValueError for an unknown name
        if self.rule not in RULES:
            raise ValueError(f"Expected rule in {RULES}, but got {self.rule!r}.")
        if not self.lengths or any(L <= self.block for L in self.lengths):
            raise ValueError(f"Expected every length > block ({self.block}), but got {self.lengths}.")
        if self.windows < 1 or self.block < 1:
            raise ValueError(f"Expected windows >= 1 and block >= 1, got {self.windows}, {self.block}.")
        for name, enabled in (("diag_length", self.diagnostics), ("product_length", self.product)):
            if not enabled:
                continue
            L = self.resolved_length(getattr(self, name))
            if not self.block < L <= max(self.lengths):
                raise ValueError(f"Expected {name} in (block={self.block}, max(lengths)="
                                 f"{max(self.lengths)}], but got {L}.")

    def resolved_length(self, wanted: int | None) -> int:
        if wanted is not None:
            return wanted
        small = [L for L in self.lengths if L <= 1024]
        return max(small) if small else min(self.lengths)


def quick_settings(**overrides: Any) -> EvalSettings:
    """The smoke run (~2 minutes on 2 cores): one window, short contexts, one preset."""
    lengths = tuple(overrides.get("lengths", (384, 768)))
    base = dict(lengths=lengths, windows=1, presets=("k2v2",), diag_windows=1, diag_length=min(lengths),
                product_length=min(lengths), retrieval_lines=QUICK_RETRIEVAL_LINES, retrieval_questions=4, quick=True)
    base.update(overrides)
    return EvalSettings(**base)


def _sink(s: EvalSettings) -> int:
    """First evaluated pseudo-decode position: the (largest) sink of the presets."""
    return max(PRESETS[p].sink for p in s.presets)
