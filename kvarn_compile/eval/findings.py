"""The checks of the paper's findings on the grid's numbers, and of the harness's faithfulness.

:func:`~.suite.run_eval` records both: per text source the claims (KIVI's pseudo-decode KL
above its static KL and growing with context, KVarN's at most half of KIVI's, KVarN <=
Hadamard <= KIVI, and KVarN vs Hadamard window by window with :func:`paired_difference`),
and whether method "none" reproduced the plain model (else :class:`FaithfulnessError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .settings import EvalSettings

__all__ = ["FAITHFUL_KL", "FaithfulnessError", "paired_difference"]

#: Method "none" must reproduce the plain model within this mean KL (nats per token).
FAITHFUL_KL = 1e-6


class FaithfulnessError(AssertionError):
    """Method "none" did not reproduce the plain model: the harness itself is wrong."""


def paired_difference(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """a vs b over the same windows: in how many a is lower, the mean difference a - b and
    its standard error (None for one window)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"Expected two equally long, non-empty per-window lists, but got "
                         f"{len(a)} and {len(b)} values.")
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    se = (sum((x - mean) ** 2 for x in d) / (n - 1) / n) ** 0.5 if n > 1 else None
    return {"lower_in": sum(x < 0 for x in d), "windows": n, "mean_diff": mean, "se": se}


def _findings(grid: dict[str, Any], s: EvalSettings) -> dict[str, Any]:
    """Check the paper's claims on one text source; every check lists the numbers it used.

    A check the run cannot decide is ``None``, never a "no": a length where KIVI's KL is 0
    (nothing quantized is attended yet: the sink and each block's own tokens are exact, so
    every method's KL is 0 there), or a trend over fewer than two lengths. ``undecided``
    says why for each such check."""
    res, out = grid["results"], {}
    lengths = [str(L) for L in sorted(s.lengths)]
    for preset, by_m in res.items():
        f: dict[str, Any] = {}
        undecided: dict[str, str] = {}
        if "kivi" in by_m:
            kivi = by_m["kivi"]["by_length"]
            quantized = [L for L in lengths if kivi[L]["pseudo"]["kl"] > 0 or kivi[L]["static"]["kl"] > 0]
            blank = [L for L in lengths if L not in quantized]
            if blank:
                undecided["lengths"] = (f"at L={', '.join(blank)} every KL is 0: no quantized token is "
                                        "attended yet (the sink and each block's own tokens are exact); "
                                        "use longer --lengths")
            f["kivi_pseudo_gt_static_last_block"] = {
                L: (kivi[L]["pseudo"]["kl_last_block"] > kivi[L]["static"]["kl"]) if L in quantized else None
                for L in lengths}
            pk = [kivi[L]["pseudo"]["kl"] for L in quantized]
            pl = [kivi[L]["pseudo"]["kl_last_block"] for L in quantized]
            trend_ok = len(quantized) >= 2
            if not trend_ok:
                undecided["trend"] = "a trend over context needs at least two lengths with quantized tokens"
            f["kivi_pseudo_kl_grows_with_context"] = (all(a < b for a, b in zip(pk, pk[1:]))
                                                      if trend_ok else None)
            f["kivi_pseudo_last_block_kl_grows_with_context"] = (all(a < b for a, b in zip(pl, pl[1:]))
                                                                 if trend_ok else None)
            if "kvarn" in by_m:
                L = lengths[-1]
                den = kivi[L]["pseudo"]["kl"]
                ratio = by_m["kvarn"]["by_length"][L]["pseudo"]["kl"] / den if den > 0 else None
                f["kvarn_over_kivi_pseudo_kl_at_max_length"] = {
                    "length": int(L), "ratio": ratio,
                    "at_most_half": ratio <= 0.5 if ratio is not None else None}
        if all(m in by_m for m in ("kvarn", "hadamard", "kivi")):
            order = {}
            for L in lengths:
                for setting in ("static", "pseudo"):
                    kv, hd, ki = (by_m[m]["by_length"][L][setting]["kl"] for m in ("kvarn", "hadamard", "kivi"))
                    order[f"{setting}@{L}"] = (kv <= hd <= ki) if ki > 0 else None
            f["ordering_kvarn_le_hadamard_le_kivi"] = order
            # how sure: the windows are paired (same text), so compare them one by one
            f["kvarn_vs_hadamard_pseudo_per_window"] = {
                L: paired_difference(by_m["kvarn"]["by_length"][L]["pseudo"]["kl_windows"],
                                     by_m["hadamard"]["by_length"][L]["pseudo"]["kl_windows"])
                for L in lengths}
        if undecided:
            f["undecided"] = undecided
        out[preset] = f
    return out


def _faithfulness(grids: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Method "none" must reproduce the plain model on every text source, length and window."""
    static_kl, pseudo_kl = [], []
    for grid in grids:
        for by_m in grid["results"].values():
            if "none" in by_m:
                for entry in by_m["none"]["by_length"].values():
                    static_kl.append(max(entry["static"]["kl_windows"]))
                    pseudo_kl.append(max(*entry["pseudo"]["kl_windows"], entry["pseudo"]["kl_last_block"]))
    if not static_kl:
        return {"checked": False, "reason": "method 'none' not evaluated"}
    worst = max(max(static_kl), max(pseudo_kl))
    return {"checked": True, "static_kl_max": max(static_kl), "pseudo_kl_max": max(pseudo_kl),
            "threshold": FAITHFUL_KL, "passed": worst < FAITHFUL_KL}
