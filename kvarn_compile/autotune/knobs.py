"""The quantization-knob rule: which tile length G and Sinkhorn iteration count T a layer may use.

These decisions change the numbers, so they follow an explicit admissibility rule
(:data:`RULE`, :func:`select_quant_knobs`, a pure function) and every decision carries
the measurements behind it (:class:`Decision`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from kvarn_compile.config import KVarNConfig

__all__ = ["RULE", "QuantKnobs", "CandidateResult", "Decision", "select_quant_knobs", "median_timer"]

log = logging.getLogger(__name__)

RULE = ("a (G, T) candidate is admissible iff its relative reconstruction error "
        "||x^ - x|| / ||x|| of K and of V, measured on the layer's first completed tile(s), is "
        "<= (1 + tolerance) x that of the preset's (G, T); among admissible candidates the "
        "fastest tile quantization wins (ties: the preset)")


@dataclasses.dataclass(frozen=True, order=True)
class QuantKnobs:
    """The two quantization knobs: tile length G and Sinkhorn iterations T."""

    group_size: int
    iters: int

    def __str__(self) -> str:
        return f"G={self.group_size},T={self.iters}"


@dataclasses.dataclass
class CandidateResult:
    knobs: QuantKnobs
    k_err: float = math.nan
    v_err: float = math.nan
    seconds: float = math.nan
    admissible: bool = False
    reason: str = ""

    def line(self) -> str:
        verdict = "ok" if self.admissible else f"rejected: {self.reason}"
        return (f"{self.knobs}: K err {self.k_err:.4f}, V err {self.v_err:.4f}, "
                f"{self.seconds * 1e3:.3f} ms -> {verdict}")


@dataclasses.dataclass
class Decision:
    """Outcome of :func:`select_quant_knobs`: the winner and every candidate's verdict."""

    chosen: QuantKnobs
    reference: QuantKnobs
    tolerance: float
    rows: int
    candidates: list[CandidateResult]
    rule: str = RULE

    @property
    def rejected(self) -> list[CandidateResult]:
        return [c for c in self.candidates if not c.admissible]

    def summary(self) -> str:
        ref = next((c for c in self.candidates if c.knobs == self.reference), None)
        win = next((c for c in self.candidates if c.knobs == self.chosen), None)
        s = f"chose {self.chosen} (preset {self.reference}, tolerance {self.tolerance:g}, {self.rows} rows"
        if ref is not None and win is not None and math.isfinite(ref.seconds) and win.seconds > 0:
            s += (f"; K err {win.k_err:.4f} vs {ref.k_err:.4f}, V err {win.v_err:.4f} vs "
                  f"{ref.v_err:.4f}, {ref.seconds / win.seconds:.2f}x faster quantization")
        return s + ")"

    def lines(self) -> list[str]:
        return [self.summary()] + ["  " + c.line() for c in self.candidates]


Timer = Callable[[QuantKnobs, Callable[[], object]], float]


def median_timer(knobs: QuantKnobs, fn: Callable[[], object], reps: int = 3) -> float:
    """Median wall time in seconds of ``fn`` over ``reps`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rel_err(x_hat: torch.Tensor, x: torch.Tensor) -> float:
    x = x.float()
    return float((x_hat.float() - x).norm() / x.norm().clamp_min(1e-12))


def select_quant_knobs(k: torch.Tensor, v: torch.Tensor, config: KVarNConfig,
                       candidates: Sequence[QuantKnobs | tuple[int, int]], tolerance: float,
                       timer: Timer | None = None) -> Decision:
    """The quality-gated knob rule (see :data:`RULE`), as a pure function.

    Args:
        k, v: full-precision K/V rows [..., T, D] (post-RoPE, token-major): the layer's
            first completed tile(s), or more. Each candidate is measured on the largest
            whole number of its tiles that fits (``T`` rows are cut down to a multiple of G).
        config: the preset; its (group_size, sinkhorn_iters) is the reference setting, its
            bits, method and scale dtype are used for every candidate.
        candidates: (G, T) pairs to consider; the reference is always added.
        tolerance: allowed relative error increase over the reference (0.05 = 5%).
        timer: ``timer(knobs, fn) -> seconds`` timing the quantization of K and V with the
            candidate's knobs; default :func:`median_timer`.

    A candidate is rejected, with its reason, when there are too few rows for one of its
    tiles, when its G does not pack whole bytes, or when its K or V error exceeds the
    bound. Errors are ||dequant(quant(x)) - x|| / ||x|| over the rows measured, in the
    original (unrotated) frame.
    """
    from kvarn_compile.quant.quantize import dequantize_kv, quantize_kv

    if tolerance < 0 or not math.isfinite(tolerance):
        raise ValueError(f"Expected a finite tolerance >= 0, but got {tolerance!r}.")
    if k.shape != v.shape or k.dim() < 2:
        raise ValueError(f"Expected K and V rows of the same shape [..., T, D], but got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}.")
    timer = timer or median_timer
    ref = QuantKnobs(config.group_size, config.sinkhorn_iters)
    knobs = [ref] + [c if isinstance(c, QuantKnobs) else QuantKnobs(*c) for c in candidates]
    knobs = list(dict.fromkeys(knobs))
    tokens, d = k.shape[-2], k.shape[-1]
    results: list[CandidateResult] = []
    for kn in knobs:
        res = CandidateResult(kn)
        results.append(res)
        n = (tokens // kn.group_size) * kn.group_size
        if n == 0:
            res.reason = f"needs {kn.group_size} rows for one tile, only {tokens} available"
            continue
        if (kn.group_size * config.key_bits) % 8 or (d * config.value_bits) % 8 or kn.iters < 0:
            res.reason = "does not pack whole bytes" if kn.iters >= 0 else "negative T"
            continue
        kk, vv = k[..., :n, :], v[..., :n, :]

        def run(kn: QuantKnobs = kn, kk: torch.Tensor = kk, vv: torch.Tensor = vv):
            opts = dict(method=config.method, group=kn.group_size, iters=kn.iters,
                        scale_dtype=config.torch_scale_dtype)
            return (quantize_kv(kk, "k", bits=config.key_bits, **opts),
                    quantize_kv(vv, "v", bits=config.value_bits, **opts))

        qk, qv = run()
        rotated = config.method != "kivi"
        res.k_err = _rel_err(dequantize_kv(qk, "k", rotated=rotated), kk)
        res.v_err = _rel_err(dequantize_kv(qv, "v", rotated=rotated), vv)
        res.seconds = float(timer(kn, run)) * tokens / n   # per the same number of tokens
    base = results[0]
    if not math.isfinite(base.k_err):
        base.reason = base.reason or "reference not measurable"
        return Decision(ref, ref, tolerance, tokens, results)
    k_bound, v_bound = base.k_err * (1 + tolerance), base.v_err * (1 + tolerance)
    for res in results:
        if res.reason:
            continue
        bad = []
        if not res.k_err <= k_bound + 1e-12:
            bad.append(f"K err {res.k_err:.4f} > {k_bound:.4f} (= {base.k_err:.4f} x {1 + tolerance:g})")
        if not res.v_err <= v_bound + 1e-12:
            bad.append(f"V err {res.v_err:.4f} > {v_bound:.4f} (= {base.v_err:.4f} x {1 + tolerance:g})")
        res.admissible = not bad
        res.reason = "; ".join(bad)
    admissible = [r for r in results if r.admissible]
    best = min(admissible, key=lambda r: (r.seconds, r.knobs != ref))
    return Decision(best.knobs, ref, tolerance, tokens, results)


