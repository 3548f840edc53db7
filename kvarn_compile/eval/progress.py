"""Phase lines with elapsed time on stderr, for the long-running commands (run, bench).

    phases = Phases(enabled=True)
    with phases("compile prefill (KVarN)"):
        model(...)                       # a ticker shows the seconds while it runs
    for i in phases.bar(range(n), "prefill"):
        ...
    phases.durations                     # {"compile prefill (KVarN)": 41.2, ...}

On a terminal the running phase's line is redrawn every second (``[0:12] compile prefill
(KVarN) ... 7 s``) and finished with its duration; elsewhere (a log file, a pipe) each phase
prints one line when it starts and one when it ends. With ``enabled=False`` nothing is
printed, but the durations are still recorded.

``kvarn-compile eval`` counts its coarse steps on one tqdm bar instead (:class:`_Progress`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

__all__ = ["Phases", "clock"]


def clock(seconds: float) -> str:
    """``m:ss`` (or ``h:mm:ss``) of a duration."""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Phases:
    """Named, timed phases of a job (see the module docstring)."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None, tick_s: float = 1.0):
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tick_s = tick_s
        self.t0 = time.perf_counter()
        self.durations: dict[str, float] = {}
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._prefix = ""

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    @contextlib.contextmanager
    def group(self, name: str) -> Iterator[None]:
        """Prefix the phases inside the block with ``name: `` (e.g. one context length)."""
        old, self._prefix = self._prefix, f"{self._prefix}{name}: "
        try:
            yield
        finally:
            self._prefix = old

    @contextlib.contextmanager
    def __call__(self, name: str, note: str = "") -> Iterator[None]:
        """Time the block as phase ``name``; ``note`` is shown after the name.

        The closing line says how the block ended: ``done in``, ``interrupted after`` (Ctrl-C)
        or ``failed after`` (an exception). On a terminal, anything else written to stderr
        while the phase runs (a notice, a warning) gets a line of its own: the phase line is
        cleared first and redrawn below it on the next tick."""
        name = self._prefix + name
        head = f"[{clock(self.elapsed())}] {name}" + (f" ({note})" if note else "")
        stop = threading.Event()
        ticker = None
        guard = None
        start = time.perf_counter()
        if self.enabled:
            if self._tty:
                guard = _LineGuard(self.stream)
                guard.draw(f"\r{head} ...")

                def tick() -> None:
                    while not stop.wait(self.tick_s):
                        guard.draw(f"\r{head} ... {time.perf_counter() - start:.0f} s")

                ticker = threading.Thread(target=tick, daemon=True)
                ticker.start()
                if sys.stderr is self.stream:
                    sys.stderr = guard      # type: ignore[assignment]
            else:
                self._write(f"{head} ...\n")
        ended = "done in"
        try:
            yield
        except KeyboardInterrupt:
            ended = "interrupted after"
            raise
        except BaseException:
            ended = "failed after"
            raise
        finally:
            stop.set()
            if ticker is not None:
                ticker.join()
            if guard is not None and sys.stderr is guard:
                sys.stderr = self.stream
            took = time.perf_counter() - start
            if ended == "done in":
                self.durations[name] = self.durations.get(name, 0.0) + took
            if self.enabled:
                if self._tty:
                    self._write(f"\r{head}: {took:.1f} s\x1b[K\n" if ended == "done in"
                                else f"\r{head}: {ended} {took:.1f} s\x1b[K\n")
                else:
                    self._write(f"{head}: {ended} {took:.1f} s\n")

    def bar(self, iterable: Iterable[Any], name: str, total: int | None = None,
            unit: str = "it") -> Iterator[Any]:
        """Iterate with a tqdm bar labelled like a phase (timed as phase ``name``)."""
        from tqdm import tqdm

        name = self._prefix + name
        start = time.perf_counter()
        desc = f"[{clock(self.elapsed())}] {name}"
        bar = tqdm(iterable, desc=desc, total=total, unit=unit, file=self.stream,
                   disable=not self.enabled, dynamic_ncols=True, leave=True,
                   mininterval=0.5 if self._tty else 30.0)
        try:
            yield from bar
        finally:
            bar.close()
            self.durations[name] = self.durations.get(name, 0.0) + time.perf_counter() - start


class _LineGuard:
    """Stands in for ``sys.stderr`` while a phase line is drawn on a terminal: a write from
    anyone else first clears the phase line, so a notice never lands in its middle."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._lock = threading.Lock()
        self._drawn = False

    def draw(self, text: str) -> None:
        with self._lock:
            self._stream.write(text + "\x1b[K")     # clear what a longer foreign line left
            self._stream.flush()
            self._drawn = True

    def write(self, text: str) -> int:
        with self._lock:
            if self._drawn and text:
                self._stream.write("\r\x1b[K")
                self._drawn = False
            n = self._stream.write(text)
        return n

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _Progress:
    """A tqdm bar on stderr (or nothing), counting coarse steps of :func:`~.suite.run_eval`."""

    def __init__(self, enabled: bool, total: int):
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc="kvarn eval", file=sys.stderr, dynamic_ncols=True)

    def step(self, label: str, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(n)

    def label(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
