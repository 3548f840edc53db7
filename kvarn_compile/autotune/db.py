"""The kernel-choice database: Inductor autotuning winners of the kvarn lowerings, exportable.

Numerics-neutral decisions (which kernel or tile config runs an op) are recorded here by
the lowerings' feedback saver, keyed by :class:`TuneKey`, exported as versioned JSON and
replayed (one choice offered: no benchmarking). See the package docstring for the format;
CLI: ``kvarn-compile autotune export|import PATH``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import pathlib
import threading
import uuid
from typing import Any

import torch

from kvarn_compile.config import PRESETS

__all__ = ["TuneKey", "AutotuneDB", "DB", "export", "load", "LoadReport", "environment",
           "preset_name", "default_db_path", "cli_main", "FORMAT", "VERSION"]

log = logging.getLogger(__name__)

FORMAT = "kvarn-autotune"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class TuneKey:
    """What a kernel-choice decision depends on (static shapes, device, format)."""

    op: str
    device: str
    capability: str
    dtype: str
    preset: str
    head_dim: int
    kv_heads: int
    q_heads: int
    batch: int
    query: str
    length_bucket: int
    #: the values' head dim where it differs from ``head_dim`` (multi-head latent attention
    #: decompressed); 0 = the same (and left out of :meth:`text`, as in keys written before)
    value_head_dim: int = 0

    def text(self) -> str:
        return "|".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                        if f.name != "value_head_dim" or self.value_head_dim)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TuneKey":
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(d) - {"value_head_dim"}
        if missing:
            raise ValueError(f"autotune key is missing {sorted(missing)}")
        return cls(**{k: d[k] for k in names if k in d})


def preset_name(key_bits: int, value_bits: int, group: int, scale_dtype: torch.dtype) -> str:
    """The preset a packed format corresponds to ("k4v2", "k4v2_g64", or a spelled-out one)."""
    sdt = str(scale_dtype).replace("torch.", "")
    for name, cfg in PRESETS.items():
        if (cfg.key_bits, cfg.value_bits, cfg.group_size) == (key_bits, value_bits, group) \
                and cfg.scale_dtype == sdt:
            return name
    return f"k{key_bits}v{value_bits}_g{group}_{sdt}"


def environment() -> dict[str, Any]:
    """Versions an entry is only valid for: torch, triton and the kvarn sources hash."""
    from kvarn_compile._torch_compat import kvarn_sources_hash, triton_version

    return {"torch": torch.__version__, "triton": triton_version(),
            "kvarn_sources": kvarn_sources_hash()}


def _local_devices() -> set[tuple[str, str]]:
    from kvarn_compile._torch_compat import device_identity

    devices = {device_identity("cpu")}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            devices.add(device_identity(f"cuda:{i}"))
    return devices


@dataclasses.dataclass
class LoadReport:
    """What :func:`load` did: entries taken, and (key, reason) of every ignored one."""

    path: str
    loaded: int = 0
    ignored: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"kvarn autotune: loaded {self.loaded} entr{'y' if self.loaded == 1 else 'ies'} "
                 f"from {self.path}, ignored {len(self.ignored)}"]
        lines += [f"  ignored {k}: {r}" for k, r in self.ignored]
        return "\n".join(lines)


def default_db_path() -> pathlib.Path | None:
    """Where the process-wide database persists: ``<kvarn cache dir>/autotune.json``.

    ``KVARN_AUTOTUNE_DB`` overrides the file; ``KVARN_AUTOTUNE_DB=off`` keeps it in memory.
    """
    import os

    env = os.environ.get("KVARN_AUTOTUNE_DB", "").strip()
    if env.lower() in ("off", "0", "none", "false"):
        return None
    if env:
        return pathlib.Path(env)
    from kvarn_compile.paths import cache_dir

    return cache_dir() / "autotune.json"


class AutotuneDB:
    """Winners of the kvarn lowerings' benchmarks, keyed by :class:`TuneKey`. Thread-safe.

    With ``persist=True`` every recorded winner is also written to :func:`default_db_path`
    (resolved at write time), and :meth:`load_default` reads that file back, so that
    ``kvarn-compile autotune export`` in another process sees what a compile recorded.
    """

    def __init__(self, persist: bool = False) -> None:
        self.entries: dict[str, dict[str, Any]] = {}
        self.persist = persist
        self._lock = threading.Lock()
        self._default_loaded: pathlib.Path | None = None

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)

    def record(self, key: TuneKey, winner: dict[str, Any], timings_ms: dict[str, float]) -> None:
        entry = {"key": dataclasses.asdict(key), "winner": dict(winner),
                 "timings_ms": {k: (None if not math.isfinite(v) else round(v, 6))
                                for k, v in timings_ms.items()},
                 **environment(),
                 "recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        with self._lock:
            self.entries[key.text()] = entry
        log.info("kvarn autotune: recorded %s -> %s", key.text(), winner)
        if self.persist:
            self.save_default()

    def save_default(self) -> None:
        """Write the valid entries to :func:`default_db_path` (no-op when persistence is off)."""
        path = default_db_path()
        if path is None:
            return
        try:
            self.load_default()           # merge what another process may have added
            self.export(path)
        except OSError as err:            # a read-only cache dir must not break a compile
            log.warning("kvarn autotune: could not write %s: %s", path, err)

    def load_default(self) -> LoadReport | None:
        """Merge :func:`default_db_path` once per path (stale/foreign entries ignored)."""
        path = default_db_path()
        if path is None or not path.exists() or self._default_loaded == path:
            return None
        self._default_loaded = path
        try:
            return self.load(path, quiet=True)
        except (OSError, ValueError) as err:
            log.warning("kvarn autotune: ignoring unreadable %s: %s", path, err)
            return None

    def lookup(self, key: TuneKey) -> dict[str, Any] | None:
        """The winner recorded for ``key`` (only valid entries are ever stored)."""
        with self._lock:
            entry = self.entries.get(key.text())
        return None if entry is None else dict(entry["winner"])

    # ------------------------------------------------------------------ files
    def to_json(self) -> dict[str, Any]:
        with self._lock:
            entries = [self.entries[k] for k in sorted(self.entries)]
        return {"format": FORMAT, "version": VERSION, "entries": entries}

    def export(self, path: str | pathlib.Path) -> int:
        path = pathlib.Path(path)
        data = self.to_json()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + f".tmp{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
        return len(data["entries"])

    def load(self, path: str | pathlib.Path, quiet: bool = False) -> LoadReport:
        """Merge the valid entries of a file; stale and foreign ones are ignored with a reason.

        Each ignored entry is logged (WARNING, or INFO with ``quiet`` for the default file,
        whose entries go stale with every kvarn source edit) and listed in the report.
        """
        path = pathlib.Path(path)
        report = LoadReport(str(path))
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path}: expected a kvarn autotune file (\"format\": \"{FORMAT}\"), "
                             f"but got {str(data)[:80]!r}.")
        if data.get("version") != VERSION:
            raise ValueError(f"{path}: expected kvarn autotune format version {VERSION}, but got "
                             f"{data.get('version')!r}. Re-run the autotuning and export again.")
        env = environment()
        local = _local_devices()
        for raw in data.get("entries", []):
            try:
                key = TuneKey.from_dict(raw["key"])
                winner = raw["winner"]
                if not isinstance(winner, dict) or "choice" not in winner:
                    raise ValueError("entry has no winner choice")
            except (KeyError, TypeError, ValueError) as err:
                report.ignored.append((str(raw.get("key") if isinstance(raw, dict) else raw)[:80],
                                       f"malformed: {err}"))
                continue
            reason = _entry_problem(raw, key, env, local)
            if reason:
                report.ignored.append((key.text(), reason))
                log.log(logging.INFO if quiet else logging.WARNING,
                        "kvarn autotune: ignoring %s: %s", key.text(), reason)
                continue
            with self._lock:
                self.entries[key.text()] = raw
            report.loaded += 1
        log.info("%s", report)
        return report


def _entry_problem(raw: dict[str, Any], key: TuneKey, env: dict[str, Any],
                   local: set[tuple[str, str]]) -> str | None:
    if (key.device, key.capability) not in local:
        here = ", ".join(f"{n} ({c})" for n, c in sorted(local))
        return (f"foreign: recorded on {key.device} ({key.capability}); this machine has {here}")
    for field, what in (("torch", "torch"), ("triton", "triton"), ("kvarn_sources", "kvarn sources")):
        if raw.get(field) != env[field]:
            got, want = raw.get(field), env[field]
            if field == "kvarn_sources":
                got, want = str(got)[:12], str(want)[:12]
            return f"stale: recorded with {what} {got}, this is {want}"
    return None


#: The process-wide database the lowerings read and the feedback saver writes (persistent).
DB = AutotuneDB(persist=True)


def export(path: str | pathlib.Path) -> int:
    """Write every recorded winner (this process's and the persisted ones) to ``path``."""
    DB.load_default()
    return DB.export(path)


def load(path: str | pathlib.Path) -> LoadReport:
    """Load winners from ``path``; later lowerings with these keys replay them unbenchmarked.

    The valid entries are also merged into the persistent default file.
    """
    DB.load_default()
    report = DB.load(path)
    if DB.persist and report.loaded:
        DB.save_default()
    return report


def cli_main(args: Any) -> int:
    if args.action == "export":
        n = export(args.path)
        print(f"kvarn autotune: exported {n} entr{'y' if n == 1 else 'ies'} to {args.path}")
        return 0
    report = load(args.path)
    print(report)
    return 0


