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
* :class:`TunedKVarNCache` (a ``hf.KVarNCache``) chooses **G and T per layer before
  allocation**: its layers allocate lazily at the first update, which sees the prefill K/V.

The rule, the tolerance and every decision (with the reason of each rejection) go into
``backend.report.notes`` and ``KnobTuner.decisions``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import pathlib
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvarn_compile.config import PRESETS, KVarNConfig

__all__ = [
    "TuneKey", "AutotuneDB", "DB", "export", "load", "LoadReport", "environment",
    "QuantKnobs", "CandidateResult", "Decision", "select_quant_knobs", "median_timer",
    "KnobTuning", "KnobTuner", "TunedKVarNCache", "RULE",
]

log = logging.getLogger(__name__)

FORMAT = "kvarn-autotune"
VERSION = 1


# ==========================================================================================
# Kernel-choice database
# ==========================================================================================
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

    def text(self) -> str:
        return "|".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TuneKey":
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(d)
        if missing:
            raise ValueError(f"autotune key is missing {sorted(missing)}")
        return cls(**{k: d[k] for k in names})


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


def add_cli_arguments(parser: Any) -> None:
    """``kvarn-compile autotune export|import PATH``."""
    parser.add_argument("action", choices=("export", "import"),
                        help="export: write the autotune database to PATH; import: merge PATH "
                             "into it (stale or foreign entries are skipped with a reason)")
    parser.add_argument("path", help="a JSON file (format kvarn-autotune, version 1)")


def cli_main(args: Any) -> int:
    if args.action == "export":
        n = export(args.path)
        print(f"kvarn autotune: exported {n} entr{'y' if n == 1 else 'ies'} to {args.path}")
        return 0
    report = load(args.path)
    print(report)
    return 0


# ==========================================================================================
# Quantization knobs: the admissibility rule
# ==========================================================================================
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
    from kvarn_compile.reference.quantize import dequantize_kv, quantize_kv

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


# ==========================================================================================
# Wiring 1: T per layer at the first tile completion (kvarn_backend)
# ==========================================================================================
@dataclasses.dataclass(frozen=True)
class KnobTuning:
    """Options of the quantization-knob tuning (``kvarn_backend(..., tune_knobs=...)``).

    ``iters``: the T candidates; ``group_sizes``: G candidates (only where G can still
    change: :class:`TunedKVarNCache`; the backend tunes T only); ``tolerance``: the allowed
    relative error increase over the preset's setting; ``timer``: see select_quant_knobs.
    """

    tolerance: float = 0.05
    iters: tuple[int, ...] = (0, 1, 2, 4, 8, 16)
    group_sizes: tuple[int, ...] = ()
    timer: Timer | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.tolerance, (int, float)) and self.tolerance >= 0):
            raise ValueError(f"KnobTuning.tolerance: expected a number >= 0, but got {self.tolerance!r}.")
        if any(not isinstance(t, int) or t < 0 for t in self.iters):
            raise ValueError(f"KnobTuning.iters: expected ints >= 0, but got {self.iters!r}.")


_TUNERS: dict[str, "KnobTuner"] = {}


@torch.library.custom_op("kvarn_tune::observe_", mutates_args=("token",))
def observe_(token: torch.Tensor, buffers: list[torch.Tensor], k: torch.Tensor,
             v: torch.Tensor, start_pos: torch.Tensor, tuner: str, site: str, recent: int,
             hold: int) -> None:
    """Hand the full-precision rows of a layer's first tile to its tuner, once.

    Runs right before the layer's ``kvarn::append_`` and reads (never writes) the state;
    ``token`` is a one-element counter it bumps so the call is not dead code.
    """
    token.add_(1)
    t = _TUNERS.get(tuner)
    if t is None or t.decided(site):
        return
    rows = first_tile_rows(buffers, k, v, start_pos, recent, hold)
    if rows is not None:
        t.decide(site, *rows)


@observe_.register_fake
def _observe_fake(token, buffers, k, v, start_pos, tuner, site, recent, hold):
    return None


def first_tile_rows(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                    start_pos: torch.Tensor, recent: int, hold: int
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The full-precision rows [B, H, G, D] of tile 0 if the coming append freezes it.

    Before the append, tokens [S, p0) of a row live in the tail ring (none frozen yet) and
    the new tokens are ``k``/``v``; tile 0 is frozen when, after the append, G committed
    tokens past the sink plus ``recent`` newer ones exist. Rows that do not freeze tile 0
    now are skipped; None when no row does.
    """
    from kvarn_compile.state import BUF

    sink_k, tail_k, tail_v = buffers[BUF["sink_k"]], buffers[BUF["tail_k"]], buffers[BUF["tail_v"]]
    s, w = sink_k.shape[2], tail_k.shape[2]
    g = buffers[BUF["k_col_scale"]].shape[-1]
    n_max = buffers[BUF["k_codes"]].shape[2]
    if n_max == 0:
        return None
    lengths, committed, n_tiles = (buffers[BUF[n]].tolist() for n in ("lengths", "committed", "n_tiles"))
    t = k.shape[2]
    ks, vs = [], []
    for row, p0 in enumerate(start_pos.tolist()):
        done, tiles = (0, 0) if p0 == 0 else (committed[row], n_tiles[row])
        if tiles:
            continue
        end = p0 + t
        committed_after = max(done, p0, end - max(hold, 0))
        if committed_after - s - recent < g:
            continue
        parts_k, parts_v = [], []
        pos = torch.arange(s, s + g, device=k.device)
        old = pos[pos < p0]                               # already in the tail ring
        if old.numel():
            slots = (old - s) % w
            parts_k.append(tail_k[row][:, slots].float())
            parts_v.append(tail_v[row][:, slots].float())
        new = pos[pos >= p0] - p0                         # from this write
        parts_k.append(k[row][:, new].to(tail_k.dtype).float())
        parts_v.append(v[row][:, new].to(tail_v.dtype).float())
        ks.append(torch.cat(parts_k, 1))
        vs.append(torch.cat(parts_v, 1))
    if not ks:
        return None
    return torch.stack(ks), torch.stack(vs)


class KnobTuner:
    """Chooses T per attention site (layer) of a :class:`~kvarn_compile.backend.KVarNBackend`.

    ``wrap`` instruments a rewritten graph: a ``kvarn_tune::observe_`` node before each
    undecided site's ``kvarn::append_``. When an observer sees the first tile of its site it
    runs :func:`select_quant_knobs` on those rows (candidates: ``options.iters`` at the
    preset's G). After the call that produced new decisions, the wrapper sets each decided
    site's ``iters`` argument, drops its observer and recompiles the graph (once per batch
    of decisions); graphs compiled later get the decided T directly and no observer.
    Graphs with symbolic shapes are not recompiled in place (their decisions apply from the
    next compile).
    """

    def __init__(self, config: KVarNConfig, options: KnobTuning):
        self.config = config
        self.options = options
        self.id = uuid.uuid4().hex
        self.decisions: dict[str, Decision] = {}
        self._lock = threading.Lock()
        self._version = 0
        _TUNERS[self.id] = self

    @property
    def active(self) -> bool:
        return self.config.method == "kvarn"

    def decided(self, site: str) -> bool:
        return site in self.decisions

    def iters_for(self, site: str) -> int | None:
        d = self.decisions.get(site)
        return None if d is None else d.chosen.iters

    def decide(self, site: str, k: torch.Tensor, v: torch.Tensor) -> Decision:
        cands = [QuantKnobs(self.config.group_size, t) for t in self.options.iters]
        decision = select_quant_knobs(k, v, self.config, cands, self.options.tolerance,
                                      self.options.timer)
        with self._lock:
            self.decisions[site] = decision
            self._version += 1
        log.info("kvarn knob tuning %s: %s", site, decision.summary())
        return decision

    def report_lines(self) -> list[str]:
        lines = [f"quant-knob rule: {RULE}; tolerance {self.options.tolerance:g}; T candidates "
                 f"{list(self.options.iters)}; G fixed at {self.config.group_size} (the packed "
                 "layout is allocated at compile time)"]
        for site in sorted(self.decisions):
            d = self.decisions[site]
            lines.append(f"quant knobs {site}: {d.summary()}")
            lines += [f"quant knobs {site}:   {c.line()}" for c in d.candidates]
        return lines

    # ------------------------------------------------------------------ graph plumbing
    def _sites(self, gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
        return [n for n in gm.graph.nodes
                if n.op == "call_function" and n.target is torch.ops.kvarn.append_.default]

    def prepare(self, gm: torch.fx.GraphModule) -> bool:
        """Apply known decisions and add observers; True when any observer was added."""
        appends = self._sites(gm)
        token_ph = next((n for n in gm.graph.nodes if n.op == "placeholder"
                         and n.name == "kvarn_tune_token"), None)
        observed = False
        for node in appends:
            site = node.args[9]
            iters = self.iters_for(site)
            if iters is not None:
                node.update_arg(5, iters)
            observers = [u for u in node.args[0][0].users if u.op == "call_function"
                         and u.target is torch.ops.kvarn_tune.observe_.default
                         and u.args[6] == site]
            if iters is not None or not self.active:
                for o in observers:
                    gm.graph.erase_node(o)
                continue
            observed = True
            if observers:
                continue
            if token_ph is None:
                last_ph = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
                with gm.graph.inserting_after(last_ph):
                    token_ph = gm.graph.placeholder("kvarn_tune_token")
                    token_ph.meta["example_value"] = torch.zeros(1, dtype=torch.int64)
            bufs, k, v, start = node.args[:4]
            with gm.graph.inserting_before(node):
                gm.graph.call_function(torch.ops.kvarn_tune.observe_.default,
                                       (token_ph, bufs, k, v, start, self.id, site,
                                        node.args[6], node.args[7]))
        if token_ph is not None and not token_ph.users:
            gm.graph.erase_node(token_ph)
        gm.recompile()
        return observed

    def wrap(self, gm: torch.fx.GraphModule, inputs: list[Any],
             compile_fn: Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]],
             report_notes: list[str]) -> Callable[..., Any]:
        """Compile ``gm`` with observers; return a callable taking the graph's inputs.

        ``inputs`` are the example inputs of ``gm`` (the state buffers included);
        ``compile_fn(gm, inputs)`` compiles it. The token tensor is appended here.
        """
        token = torch.zeros(1, dtype=torch.int64, device=_device_of(inputs))
        observed = self.prepare(gm)
        state = {"compiled": compile_fn(gm, inputs + ([token] if observed else [])),
                 "observed": observed, "version": self._version}
        symbolic = any(isinstance(x, torch.SymInt) for x in inputs) or any(
            isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape)
            for x in inputs)
        lock = threading.Lock()

        def run(*args: Any) -> Any:
            out = state["compiled"](*args, *([token] if state["observed"] else []))
            if state["observed"] and self._version != state["version"] and not symbolic:
                with lock:
                    if self._version != state["version"]:
                        state["version"] = self._version
                        observed_now = self.prepare(gm)
                        state["compiled"] = compile_fn(gm, list(args) + ([token] if observed_now else []))
                        state["observed"] = observed_now
                        _sync_notes(report_notes, self.report_lines())
            return out

        _sync_notes(report_notes, self.report_lines())
        return run


def _device_of(inputs: list[Any]) -> torch.device:
    for x in inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _sync_notes(notes: list[str], lines: list[str]) -> None:
    """Replace the knob-tuning lines of a report's notes with ``lines``."""
    notes[:] = [n for n in notes if not n.startswith(("quant-knob rule:", "quant knobs "))]
    notes.extend(lines)


# ==========================================================================================
# Wiring 2: G and T per layer before allocation (transformers cache)
# ==========================================================================================
def _tuned_cache_classes():
    from kvarn_compile.hf import KVarNCache, KVarNLayer

    class TunedKVarNLayer(KVarNLayer):
        """A KVarNLayer that picks its (G, T) from the prefill K/V before allocating."""

        def __init__(self, *args: Any, options: KnobTuning, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.options = options
            self.decision: Decision | None = None

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            if self.config.method == "kvarn":
                s = self.config.sink
                groups = self.options.group_sizes or (self.config.group_size,)
                cands = [QuantKnobs(g, t) for g in groups for t in self.options.iters]
                k = key_states[:, :, s:].float()
                v = value_states[:, :, s:].float()
                self.decision = select_quant_knobs(k, v, self.config, cands,
                                                   self.options.tolerance, self.options.timer)
                chosen = self.decision.chosen
                overrides: dict[str, Any] = {"sinkhorn_iters": chosen.iters,
                                             "group_size": chosen.group_size}
                if self.config.sink_tokens is None:   # keep the sink where the preset has it
                    overrides["sink_tokens"] = s
                self.config = self.config.replace(**overrides)
                log.info("kvarn knob tuning %s: %s", self.name, self.decision.summary())
            super().lazy_initialization(key_states, value_states)

    class TunedKVarNCache(KVarNCache):
        """``hf.KVarNCache`` whose layers choose (G, T) on the prefill K/V (see the module doc).

        The prefill must hold at least sink + G tokens for G to be measurable; otherwise the
        preset's setting stays (the decision says why). ``decisions`` lists them per layer.
        """

        def __init__(self, config: Any, max_cache_len: int, preset: Any = "k4v2", *,
                     tune: KnobTuning | None = None, spec_tokens: int = 0, **overrides: Any):
            super().__init__(config, max_cache_len, preset, spec_tokens=spec_tokens, **overrides)
            options = tune or KnobTuning()
            self.layers = [TunedKVarNLayer(self.kvarn_config, max_cache_len, spec_tokens=spec_tokens,
                                           name=layer.name, model_config=config, options=options)
                           for layer in self.layers]

        @property
        def decisions(self) -> dict[str, Decision]:
            return {layer.name: layer.decision for layer in self.layers
                    if getattr(layer, "decision", None) is not None}

    return TunedKVarNLayer, TunedKVarNCache


def __getattr__(name: str) -> Any:
    if name in ("TunedKVarNCache", "TunedKVarNLayer"):
        layer, cache = _tuned_cache_classes()
        globals().update(TunedKVarNLayer=layer, TunedKVarNCache=cache)
        return {"TunedKVarNCache": cache, "TunedKVarNLayer": layer}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
