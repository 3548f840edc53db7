"""Tensor parallelism: every rank keeps the packed KVarN cache of its own KV heads.

Nothing in the backend, the pass or ``KVarNCache`` is rank-aware. Under tensor
parallelism the attention of each rank sees plain local tensors holding its share of the
heads (transformers' ``tp_plan="auto"``: the column-sharded ``k_proj`` / ``v_proj`` outputs;
a gpt-fast style model: its sharded ``wqkv``), and the packed states are sized from those
tensors, so each rank allocates and quantizes only its heads. Quantization works per KV
head, so a rank's tiles hold exactly what the single-process cache holds for those heads.
``to_local`` / ``from_local`` / ``redistribute`` and the functional collectives
(``_c10d_functional.all_reduce`` + ``wait_tensor``, and the ``copy_`` Dynamo adds after an
in-place ``dist.all_reduce``) match no row of the pass's tables and are left as they are.

This module holds what *is* about ranks:

* :func:`tensor_parallel_heads`: how many query and KV heads each rank holds, by the rule
  the serving engines use (KV heads split evenly; when there are fewer KV heads than
  ranks, one KV head per rank, replicated, as vLLM does, if the model's own sharding does
  that), or a clear ``ValueError``;
* :func:`check_hf_tensor_parallel`: the same for a transformers config under
  ``tp_plan="auto"``, whose rule never replicates: the KV heads must divide by the size
  (transformers' ``get_kv_heads_per_rank``); otherwise it refuses before loading, instead
  of the model failing later with a reshape error inside its attention;
  :func:`hf_tp_kwargs` spells ``tp_plan="auto"`` for ``from_pretrained``;
* :func:`gather_report` / :func:`print_report`: every rank's report (sites, graphs, packed
  bytes, KV heads, released bytes) gathered with one collective, and one summary printed
  on rank 0 (sites, bytes per rank, bytes in total).

Context parallelism (one sequence's tiles spread over ranks) is :mod:`kvarn_compile.ops.context_parallel`.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, TextIO

import torch

__all__ = ["TensorParallelHeads", "tensor_parallel_heads", "check_hf_tensor_parallel", "hf_tp_kwargs",
           "RankReport", "DistributedReport", "rank_report", "gather_report", "print_report"]


# ------------------------------------------------------------------------------ heads
@dataclasses.dataclass(frozen=True)
class TensorParallelHeads:
    """Heads per rank under tensor parallelism of size ``tp``.

    ``kv_replicas`` > 1 when each KV head is held by that many ranks (fewer KV heads than
    ranks); such a rank's packed cache holds a full copy of its one KV head.
    """

    tp: int
    num_heads: int
    num_kv_heads: int
    q_heads: int
    kv_heads: int
    kv_replicas: int

    def q_range(self, rank: int) -> range:
        """The global query heads rank ``rank`` holds."""
        self._check_rank(rank)
        return range(rank * self.q_heads, (rank + 1) * self.q_heads)

    def kv_range(self, rank: int) -> range:
        """The global KV heads rank ``rank`` holds (one, shared, when replicated)."""
        self._check_rank(rank)
        first = rank // self.kv_replicas * self.kv_heads
        return range(first, first + self.kv_heads)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.tp:
            raise ValueError(f"Expected a rank in [0, {self.tp}), but got {rank}.")


def tensor_parallel_heads(num_heads: int, num_kv_heads: int, tp: int, *,
                          replicate_kv: bool = True) -> TensorParallelHeads:
    """Query and KV heads per rank for tensor parallelism of size ``tp``.

    The query heads must divide by ``tp``. The KV heads are split evenly when they divide
    by ``tp``. With fewer KV heads than ranks and ``replicate_kv`` (the rule of vLLM and
    the other serving engines), each rank keeps the one KV head its query heads read,
    replicated on ``tp // num_kv_heads`` ranks; that needs ``tp % num_kv_heads == 0``.
    Anything else raises ``ValueError`` saying which sizes work.
    """
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("tp", tp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Expected {name} to be a positive int, but got {value!r}.")
    if num_heads % num_kv_heads:
        raise ValueError(f"Expected num_heads ({num_heads}) to be a multiple of num_kv_heads "
                         f"({num_kv_heads}).")
    if num_heads % tp:
        raise ValueError(
            f"Expected the tensor-parallel size to divide the {num_heads} query heads, but got "
            f"tp={tp}. Sizes that work: {_sizes(num_heads, num_kv_heads, replicate_kv)}.")
    if num_kv_heads % tp == 0:
        return TensorParallelHeads(tp, num_heads, num_kv_heads, num_heads // tp,
                                   num_kv_heads // tp, 1)
    if replicate_kv and tp % num_kv_heads == 0:
        return TensorParallelHeads(tp, num_heads, num_kv_heads, num_heads // tp, 1,
                                   tp // num_kv_heads)
    rule = ("the KV heads must divide by it, or it must be a multiple of them (one KV head per "
            "rank, replicated)" if replicate_kv else "the KV heads must divide by it")
    raise ValueError(
        f"Expected a tensor-parallel size that fits the {num_kv_heads} KV heads ({rule}), but "
        f"got tp={tp}. Sizes that work: {_sizes(num_heads, num_kv_heads, replicate_kv)}.")


def _sizes(num_heads: int, num_kv_heads: int, replicate_kv: bool) -> str:
    ok = [t for t in range(1, num_heads + 1) if num_heads % t == 0
          and (num_kv_heads % t == 0 or (replicate_kv and t % num_kv_heads == 0))]
    return ", ".join(map(str, ok))


def check_hf_tensor_parallel(config: Any, tp: int) -> TensorParallelHeads:
    """Heads per rank of a transformers model loaded with ``tp_plan="auto"`` on ``tp`` ranks,
    or a ``ValueError`` before anything is loaded.

    transformers shards ``q_proj``/``k_proj``/``v_proj`` by whole heads and never replicates
    KV heads (its ``get_kv_heads_per_rank``): the KV heads must divide by ``tp``. E.g.
    SmolLM2-135M (9 query, 3 KV heads) runs on 1 or 3 ranks; on 2 its attention would fail
    with a reshape error. Pass the model's config (``AutoConfig.from_pretrained(path)``).
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    try:
        return tensor_parallel_heads(heads, kv, tp, replicate_kv=False)
    except ValueError as err:
        raise ValueError(
            f"{type(text).__name__} with {heads} query / {kv} KV heads cannot be loaded with "
            f"tp_plan='auto' on {tp} ranks: {err} (transformers splits k_proj by whole heads "
            "and does not replicate KV heads.)") from None


def hf_tp_kwargs() -> dict[str, Any]:
    """``from_pretrained`` keywords for tensor parallelism with the model's own plan:
    ``distributed_config=DistributedConfig(tp_plan="auto")`` (the spelling transformers
    asks for; the bare ``tp_plan="auto"`` still works but warns), ``tp_plan="auto"`` on
    transformers releases without ``DistributedConfig``."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return {"tp_plan": "auto"}
    return {"distributed_config": DistributedConfig(tp_plan="auto")}


# ------------------------------------------------------------------------------ reports
@dataclasses.dataclass
class RankReport:
    """What one rank's KVarN object holds (a ``kvarn_backend``, an ``inductor_pass`` or a
    ``KVarNCache``)."""

    rank: int
    kind: str
    #: attention sites rewritten / left unchanged, over all compiled graphs (a KVarNCache:
    #: its initialized layers, none unchanged)
    rewritten: int
    unchanged: int
    #: graphs the backend or pass compiled (0 for a KVarNCache)
    graphs: int
    #: graphs Dynamo compiled in this process (``counters["stats"]["unique_graphs"]``)
    dynamo_graphs: int
    #: bytes of the packed states (live tensors) and their KV heads, one entry per state
    nbytes: int
    kv_heads: list[int]
    #: bytes of model-owned full-precision K/V buffers freed
    released_bytes: int
    #: names of the rewritten sites (the same on every rank for a tensor-parallel model)
    sites: list[str]
    text: str

    def line(self) -> str:
        heads = sorted(set(self.kv_heads))
        return (f" rank {self.rank}: {self.rewritten} rewritten, {self.unchanged} unchanged, "
                f"{self.graphs} graph(s), {len(self.kv_heads)} state(s) of "
                f"{'/'.join(map(str, heads)) or '-'} KV head(s), {self.nbytes} bytes"
                + (f", released {self.released_bytes} bytes" if self.released_bytes else ""))


def rank_report(obj: Any, rank: int | None = None) -> RankReport:
    """The :class:`RankReport` of ``obj`` in this process (no collective)."""
    from torch._dynamo.utils import counters

    if rank is None:
        rank = torch.distributed.get_rank() if _initialized() else 0
    report = getattr(obj, "report", None)
    if report is not None:                                  # kvarn_backend / inductor_pass
        states = list(obj.states.values())
        rewritten = sorted({s.name for s in report.rewritten})
        kind = type(obj).__name__
        return RankReport(rank, kind, len(report.rewritten), len(report.unchanged),
                          report.graphs, int(counters["stats"]["unique_graphs"]), obj.nbytes,
                          [s.kv_heads for s in states], report.released_bytes, rewritten,
                          str(report))
    layers = getattr(obj, "layers", None)
    if layers is None or not hasattr(obj, "nbytes"):
        raise TypeError(f"Expected a kvarn_backend, an inductor_pass or a KVarNCache, but got "
                        f"{type(obj).__name__}.")
    states = [layer.state for layer in layers if getattr(layer, "state", None) is not None]
    names = [s.name for s in states]
    text = "\n".join([f"KVarNCache: {len(states)} layer(s) allocated"]
                     + [f"  {s.describe()}" for s in states])
    return RankReport(rank, type(obj).__name__, len(states), 0, 0,
                      int(counters["stats"]["unique_graphs"]), obj.nbytes,
                      [s.kv_heads for s in states], 0, names, text)


@dataclasses.dataclass
class DistributedReport:
    """Every rank's :class:`RankReport`, in rank order, and the summary over them."""

    ranks: list[RankReport]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def bytes_per_rank(self) -> list[int]:
        return [r.nbytes for r in self.ranks]

    @property
    def bytes_total(self) -> int:
        """Packed bytes over all ranks (a replicated KV head counts once per rank holding it)."""
        return sum(self.bytes_per_rank)

    @property
    def consistent(self) -> bool:
        """True when every rank rewrote the same sites and left none unchanged that another
        rewrote (a tensor-parallel model runs the same graph on every rank)."""
        first = self.ranks[0]
        return all(r.sites == first.sites and r.unchanged == first.unchanged for r in self.ranks)

    def __str__(self) -> str:
        first = self.ranks[0]
        lines = [f"KVarN tensor-parallel report: {self.world_size} rank(s), {first.kind}, "
                 f"{first.rewritten} attention site(s) rewritten and {first.unchanged} left "
                 f"unchanged on rank 0, {first.graphs} graph(s) on rank 0"]
        lines.extend(r.line() for r in self.ranks)
        lines.append(f" bytes per rank: {', '.join(map(str, self.bytes_per_rank))}; "
                     f"total {self.bytes_total} bytes")
        if not self.consistent:
            differ = [r.rank for r in self.ranks if r.sites != first.sites
                      or r.unchanged != first.unchanged]
            lines.append(f" warning: ranks {differ} rewrote other sites than rank 0; their "
                         "reports follow")
            lines.extend(f"[rank {r.rank}] {r.text}" for r in self.ranks if r.rank in differ)
        return "\n".join(lines)

    __repr__ = __str__

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "bytes_per_rank": self.bytes_per_rank,
                "bytes_total": self.bytes_total, "consistent": self.consistent,
                "ranks": [dataclasses.asdict(r) for r in self.ranks]}


def _initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def gather_report(obj: Any, group: Any = None) -> DistributedReport:
    """Every rank's report of ``obj`` (its ``kvarn_backend``, ``inductor_pass`` or
    ``KVarNCache``), on every rank of ``group``; one ``all_gather_object`` (it obeys the
    process group's timeout). Every rank must call it. Without an initialized process
    group: this process's report alone."""
    mine = rank_report(obj)
    if not _initialized():
        return DistributedReport([mine])
    dist = torch.distributed
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return DistributedReport(sorted(gathered, key=lambda r: r.rank))


def print_report(obj: Any, group: Any = None, *, per_rank: bool = False,
                 file: TextIO | None = None) -> DistributedReport:
    """:func:`gather_report`, printed once, on rank 0 of ``group`` (with ``per_rank``, each
    rank's full report too, prefixed ``[rank r]``). Every rank must call it; every rank
    gets the report back."""
    report = gather_report(obj, group)
    rank = torch.distributed.get_rank(group) if _initialized() else 0
    if rank == 0:
        out = file or sys.stdout
        if per_rank:
            for r in report.ranks:
                print("\n".join(f"[rank {r.rank}] {line}" for line in r.text.splitlines()), file=out)
        print(report, file=out, flush=True)
    return report
