"""Shared helpers for the benchmark scripts (timing, environment stamp)."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch


def env() -> dict:
    return {"torch": torch.__version__, "device": "cpu", "threads": torch.get_num_threads(),
            "machine": platform.machine(), "python": platform.python_version()}


def bench(fn: Callable[[], object], *, warmup: int = 2, reps: int = 7, min_time: float = 0.0) -> dict:
    """Median / p20 / p80 wall time in ms of ``fn`` (CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    q = lambda p: times[min(int(p * len(times)), len(times) - 1)]  # noqa: E731
    return {"ms_median": statistics.median(times), "ms_p20": q(0.2), "ms_p80": q(0.8), "reps": len(times)}
