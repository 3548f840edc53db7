"""Decode-speed measurement shared by ``kvarn-compile run`` and ``kvarn-compile bench``.

Three runners of one model decode the same tokens:

* ``kvarn``: a copy compiled with ``kvarn_backend`` (``model.compile(backend=...)``, as a user
  writes it) over a transformers ``StaticCache`` that the pass takes over into packed states;
* ``inductor``: the model compiled with plain ``torch.compile`` (Inductor) over a
  full-precision ``StaticCache`` of the same length;
* ``eager``: the same model, not compiled, over its own full-precision ``StaticCache``.

Every cache is sized to exactly the prompt plus the new tokens: a static cache's decode
step reads every slot of it, so a larger one would slow it down. The prompt is prefilled
in chunks of equal length (:func:`prefill`): by default once, eagerly in full precision,
into a cache every runner gets a copy of (the KVarN model's first compiled step takes it
over into packed states); or through each compiled model. Decoding is greedy on the
Inductor model; the other runners are fed its tokens (teacher forcing), so all of them see
the same sequence and every position's logits can be compared. The step loop is
interleaved: in every step each runner runs once, in an order that rotates from step to
step, so load on a shared machine hits all runners alike; the first ``warmup`` steps
compile the decode graphs and are not timed.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Runner", "spread", "format_spread", "make_runners", "prefill", "decode_interleaved",
           "cache_bytes", "packed_bytes", "PREFILL_MODES", "eager_runner"]


def spread(values: list[float]) -> dict[str, float | int]:
    """Median, quartiles and range of a list of timings (any unit)."""
    if not values:
        return {"n": 0, "median": float("nan"), "p25": float("nan"), "p75": float("nan"),
                "min": float("nan"), "max": float("nan")}
    v = sorted(values)
    if len(v) >= 2:
        q = statistics.quantiles(v, n=4, method="inclusive")
        p25, p75 = q[0], q[2]
    else:
        p25 = p75 = v[0]
    return {"n": len(v), "median": statistics.median(v), "p25": p25, "p75": p75,
            "min": v[0], "max": v[-1]}


def format_spread(s: dict[str, Any], fmt: str = ".1f") -> str:
    """``median [p25-p75] min-max``."""
    if not s["n"]:
        return "n/a"
    f = lambda x: format(x, fmt)  # noqa: E731
    return f"{f(s['median'])} [{f(s['p25'])}-{f(s['p75'])}] {f(s['min'])}-{f(s['max'])}"


@dataclasses.dataclass
class Runner:
    """One model + its cache, run one chunk or step at a time."""

    name: str
    label: str
    model: Callable[..., Any]
    cache: Any
    cache_kwarg: str
    backend: Any = None                     # the KVarNBackend of the kvarn runner
    step_ms: list[float] = dataclasses.field(default_factory=list)
    #: seconds of the first prefill chunk / the first decode step (compiling, if compiled)
    first_call_s: dict[str, float] = dataclasses.field(default_factory=dict)
    warmup_s: list[float] = dataclasses.field(default_factory=list)
    prefill_s: list[float] = dataclasses.field(default_factory=list)
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)
    #: Dynamo / Inductor timers (seconds, >= 0.5 s) of the first decode step's compile
    compile_timers_s: dict[str, float] = dataclasses.field(default_factory=dict)

    def __call__(self, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, float]:
        """Run ``ids`` [1, n] at positions start..start+n-1; (last logits [V] fp32, seconds)."""
        pos = torch.arange(start, start + ids.shape[-1])
        t0 = time.perf_counter()
        out = self.model(input_ids=ids, cache_position=pos, use_cache=True, logits_to_keep=1,
                         **{self.cache_kwarg: self.cache})
        took = time.perf_counter() - t0
        return out.logits[0, -1].float(), took


def make_runners(kv_model, fp_model, *, preset, max_len: int, compiler: str = "inductor",
                 eager: bool = True, fp_backend: str = "inductor") -> list[Runner]:
    """The kvarn, inductor (and eager) runners over fresh caches of ``max_len`` tokens.

    ``kv_model`` is compiled in place with a new ``kvarn_backend``; ``fp_model`` is wrapped by
    ``torch.compile(backend=fp_backend)`` (its own forward stays eager for the eager runner).
    ``compiler`` is what runs kvarn_backend's rewritten graphs (``"eager"``: no Inductor).
    """
    from kvarn_compile.backend import kvarn_backend
    from kvarn_compile.hf import cache_kwarg, static_cache_for

    backend = kvarn_backend(preset, max_cache_len=max_len, compiler=compiler)
    kv_model.compile(backend=backend)
    fp_compiled = torch.compile(fp_model, backend=fp_backend)
    fp_name = "Inductor" if fp_backend == "inductor" else f"compiled ({fp_backend})"
    runners = [Runner("kvarn", "KVarN", kv_model, static_cache_for(kv_model, max_len),
                      cache_kwarg(kv_model), backend=backend),
               Runner("inductor", f"{fp_name} {_dtype_name(fp_model)}", fp_compiled,
                      static_cache_for(fp_model, max_len),
                      cache_kwarg(fp_model))]
    if eager:
        runners.append(eager_runner(fp_model, max_len))
    return runners


def eager_runner(fp_model, max_len: int) -> Runner:
    """The uncompiled model over a fresh full-precision ``StaticCache`` of ``max_len`` tokens."""
    from kvarn_compile.hf import cache_kwarg, static_cache_for

    return Runner("eager", f"eager {_dtype_name(fp_model)}", fp_model,
                  static_cache_for(fp_model, max_len), cache_kwarg(fp_model))


def _dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def _dtype_name(model) -> str:
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    return names.get(_dtype(model), str(_dtype(model)).replace("torch.", ""))


#: How the prompt gets into the caches (see :func:`prefill`).
PREFILL_MODES = ("eager", "compiled")


def prefill(runners: list[Runner], ids: torch.Tensor, chunk: int, phases, *, mode: str = "eager",
            source: Runner | None = None) -> dict[str, torch.Tensor]:
    """Prefill ``ids`` [1, L] in chunks of ``chunk`` tokens into every runner's cache.

    ``mode="eager"``: the prompt runs once through the uncompiled full-precision model
    (``source``, default the eager runner) over a cache that grows with it (each chunk
    attends only the tokens before it: :func:`_prefill_grown`), and its K/V go into the
    source's ``StaticCache``; every other runner starts from a copy of that cache. The KVarN model's first compiled step then takes these
    K/V over into its packed states (as with transformers' ``generate(...,
    compile_config=...)``, which also prefills eagerly and compiles only the decoding step).
    No prefill graph compiles; the prompt is attended exactly while it is prefilled.

    ``mode="compiled"``: the KVarN model and the Inductor model prefill through their own
    compiled prefill graphs (their first chunk compiles it; every later chunk of the KVarN
    model attends the packed tiles of the earlier ones); the eager runner starts from a copy
    of the Inductor model's cache.

    Chunks of several runners are interleaved. Returns each runner's logits of the last
    prompt position.
    """
    if mode not in PREFILL_MODES:
        raise ValueError(f"Expected a prefill mode in {PREFILL_MODES}, but got {mode!r}.")
    by = {r.name: r for r in runners}
    if mode == "eager":
        source = source or by.get("eager")
        if source is None:
            raise ValueError("Expected an eager runner (or source=) for mode='eager'.")
        active, copy_from = [source], source
    else:
        active = [r for r in runners if r.name in ("kvarn", "inductor")]
        copy_from = by.get("inductor")
    n = ids.shape[-1]
    starts = list(range(0, n, chunk))
    last: dict[str, torch.Tensor] = {}
    if mode == "eager":
        last[source.name] = _prefill_grown(source, ids, chunk, phases)
    else:
        for r in active:
            with phases(f"compile prefill: {r.label}", note=f"first {min(chunk, n)}-token chunk"):
                last[r.name], took = r(ids[:, :chunk], 0)
            r.first_call_s["prefill"] = took
        names = " and ".join(r.label for r in active)
        for i in phases.bar(range(1, len(starts)), f"prefill {n} tokens ({names}, {chunk}-token chunks)",
                            total=len(starts) - 1, unit="chunk"):
            k = i % len(active)
            for r in active[k:] + active[:k]:
                last[r.name], took = r(ids[:, starts[i]:starts[i] + chunk], starts[i])
                r.prefill_s.append(took)
    for r in runners:
        if r not in active and copy_from is not None:
            r.cache = copy.deepcopy(copy_from.cache)
            last[r.name] = last[copy_from.name]
    return last


def _prefill_grown(source: Runner, ids: torch.Tensor, chunk: int, phases) -> torch.Tensor:
    """The uncompiled prompt prefill: chunks of ``chunk`` tokens through ``source.model`` over
    a cache that grows with the prompt (transformers' ``DynamicCache``), so each chunk attends
    only the tokens before it, not every slot of the static cache (about half the attention
    work of the whole prompt); then the K/V go into ``source.cache``'s first positions.
    Returns the last prompt position's logits."""
    from transformers import DynamicCache

    n = ids.shape[-1]
    grown = DynamicCache(config=source.model.config)
    grower = dataclasses.replace(source, cache=grown, logits=[], prefill_s=[])
    last = None
    for start in phases.bar(range(0, n, chunk), f"prefill {n} tokens ({source.label}, {chunk}-token "
                            "chunks)", total=-(-n // chunk), unit="chunk"):
        last, took = grower(ids[:, start:start + chunk], start)
        source.prefill_s.append(took)
    positions = {"cache_position": torch.arange(n)}
    for i, layer in enumerate(grown.layers):     # through the cache's own bookkeeping (its length)
        source.cache.update(layer.keys, layer.values, i, positions)
    return last


def _compile_timers() -> dict[str, float]:
    """torch.compile's cumulative timers of this process (name -> seconds), or {} where
    this torch has none."""
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
        return {n: float(v) for n, v in zip(names, values)}
    except Exception:  # a private API: its absence must not stop a measurement
        return {}


def decode_interleaved(runners: list[Runner], first_token: int, start: int, steps: int,
                       phases, *, warmup: int = 2, reference: str = "inductor") -> torch.Tensor:
    """``steps`` decode steps from position ``start``, greedy on the ``reference`` runner; every
    runner is fed the same tokens (``first_token``, then the reference's argmax).

    Appends each runner's logits of every step to ``runner.logits`` and the wall time of
    every step after the first ``warmup`` (which compile the decode graphs) to
    ``runner.step_ms``. Returns the tokens fed [steps + 1] (the last one only predicted).
    """
    ref = next(r for r in runners if r.name == reference)
    tokens = [int(first_token)]

    def step(i: int, r: Runner) -> float:
        logits, took = r(torch.tensor([[tokens[i]]]), start + i)
        r.logits.append(logits)
        return took

    n_warm = min(warmup, steps)
    for i in range(n_warm):
        if i == 0:
            for r in runners:
                if r.name == "eager":
                    r.first_call_s["decode"] = step(i, r)
                    continue
                before = _compile_timers()
                with phases(f"compile decode: {r.label}"):
                    r.first_call_s["decode"] = step(i, r)
                after = _compile_timers()
                r.compile_timers_s = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()
                                      if v - before.get(k, 0.0) >= 0.5}
        else:
            with phases(f"warm-up decode step {i + 1}", note="all runners"):
                for r in runners:
                    r.warmup_s.append(step(i, r))
        tokens.append(int(ref.logits[-1].argmax()))
    for i in phases.bar(range(n_warm, steps), f"decode, {len(runners)} runners interleaved",
                        total=steps - n_warm, unit="step"):
        k = i % len(runners)
        for r in runners[k:] + runners[:k]:
            r.step_ms.append(1e3 * step(i, r))
        tokens.append(int(ref.logits[-1].argmax()))
    return torch.tensor(tokens)


def cache_bytes(cache) -> int:
    """Bytes of a transformers cache's K/V tensors (live storage)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.untyped_storage().nbytes()
    return total


def packed_bytes(backend) -> dict[str, Any]:
    """Bytes of a kvarn backend's packed states: in use (by region) and allocated."""
    used: dict[str, int] = {}
    for state in backend.states.values():
        for region, n in state.used_bytes().items():
            used[region] = used.get(region, 0) + n
    return {"used": sum(used.values()), "allocated": backend.nbytes, "used_by_region": used}
