"""Tensor-parallel gpt-fast with a KVarN cache: the model of ``gpt_fast_model.py`` sharded
over ranks, its reductions written with functional collectives (as gpt-fast's ``tp.py``).

    torchrun --standalone --nproc-per-node 2 examples/gpt_fast_tp.py
    torchrun --standalone --nproc-per-node 2 examples/gpt_fast_tp.py --kv-heads 1   # replicated
    python examples/gpt_fast_tp.py                                                  # one process

Sharding (rank r of tp): ``wqkv`` keeps the rows of this rank's query heads and KV heads,
``w1``/``w3`` a slice of their output rows (column-wise parallel); ``wo``/``w2`` the matching
input columns (row-wise parallel), and a forward hook sums their partial outputs with
``torch.distributed._functional_collectives.all_reduce``. Embedding, norms and output stay
replicated. Every rank's cache, and so its packed KVarN state, holds only its KV heads;
with fewer KV heads than ranks each rank keeps the one KV head its query heads read
(vLLM's rule, see ``kvarn_compile.distributed.tensor_parallel_heads``).

The script compiles the sharded model with ``kvarn_backend`` on every rank, generates,
prints each rank's packed bytes and one summary on rank 0, and with ``--check`` compares
the tokens with the single-process KVarN run of the same weights (computed on rank 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpt_fast_model as gf  # noqa: E402

from kvarn_compile.distributed import TensorParallelHeads, tensor_parallel_heads  # noqa: E402


def _rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    # column-wise parallel: keep output features `rows` (weight [out, in])
    linear.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    linear.out_features = len(rows)


def _cols(linear: nn.Linear, cols: torch.Tensor) -> None:
    # row-wise parallel: keep input features `cols`; the partial outputs are summed
    linear.weight = nn.Parameter(linear.weight.detach()[:, cols].clone(), requires_grad=False)
    linear.in_features = len(cols)


def _heads(rng: range, head_dim: int, offset: int = 0) -> torch.Tensor:
    # the feature indices of heads `rng`: [h0 * D, (h_last + 1) * D) + offset
    return torch.arange(rng.start * head_dim, rng.stop * head_dim) + offset


def apply_tp(model: gf.Transformer, rank: int, world: int, group=None) -> TensorParallelHeads:
    """Shard ``model`` in place for rank ``rank`` of ``world`` (before ``setup_caches``)."""
    a = model.args
    heads = tensor_parallel_heads(a.n_head, a.n_local_heads, world)
    group = group if group is not None else dist.group.WORLD
    d, kv_dim = a.head_dim, a.n_local_heads * a.head_dim
    q_rows = _heads(heads.q_range(rank), d)
    kv = heads.kv_range(rank)
    local = dataclasses.replace(a, n_head=heads.q_heads, n_local_heads=heads.kv_heads,
                                dim=heads.q_heads * d)     # Attention's view of its heads
    hidden = torch.arange(a.intermediate_size).chunk(world)[rank]

    def all_reduce(_module, _inputs, out):
        return funcol.all_reduce(out, "sum", group)

    for layer in model.layers:
        att = layer.attention
        _rows(att.wqkv, torch.cat([q_rows, _heads(kv, d, a.dim), _heads(kv, d, a.dim + kv_dim)]))
        _cols(att.wo, q_rows)
        att.args = local
        att.register_forward_hook(all_reduce)
        _rows(layer.w1, hidden)
        _rows(layer.w3, hidden)
        _cols(layer.w2, hidden)
        layer.w2.register_forward_hook(all_reduce)
    # setup_caches sizes every KVCache from model.args: this rank's KV heads only
    model.args = dataclasses.replace(a, n_local_heads=heads.kv_heads)
    return heads


def build(args: gf.ModelArgs, *, seed: int = 0, scale: float = 3.0) -> gf.Transformer:
    """The full model, the same on every rank (seeded; ``scale`` sharpens the logits of the
    random weights so greedy decoding does not collapse)."""
    torch.manual_seed(seed)
    model = gf.Transformer(args).eval()
    for p in model.parameters():
        p.data.mul_(scale)
        p.requires_grad_(False)
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads of the model (n_local_heads)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--preset", default="k4v2")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--compiler", default="eager", choices=["eager", "inductor"])
    p.add_argument("--check", action="store_true", help="compare with the single-process run")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per collective")
    opts = p.parse_args(argv)
    torch.set_grad_enabled(False)

    from kvarn_compile import kvarn_backend
    from kvarn_compile.distributed import print_report

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=opts.timeout))
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    margs = gf.ModelArgs(n_head=opts.heads, n_local_heads=opts.kv_heads)
    prompt = torch.randint(0, margs.vocab_size, (1, opts.prompt),
                           generator=torch.Generator().manual_seed(1))
    preset = dict(preset=opts.preset, group_size=opts.group_size)

    def run(model):
        model.setup_caches(max_batch_size=1, max_seq_length=opts.max_len)
        backend = kvarn_backend(**preset, compiler=opts.compiler)
        tokens = gf.generate(model, prompt, opts.new, step=torch.compile(model, backend=backend))
        return tokens, backend

    model = build(margs)
    reference = None
    if opts.check and rank == 0:
        reference, _ = run(build(margs))                  # the single-process KVarN run
        torch._dynamo.reset()
    heads = apply_tp(model, rank, world) if distributed else None
    tokens, backend = run(model)
    print(f"[rank {rank}] KV heads {list(heads.kv_range(rank)) if heads else 'all'}: "
          f"{backend.nbytes} packed bytes", flush=True)
    print_report(backend)
    if rank == 0:
        print("tokens:", tokens[0].tolist())
        if reference is not None:
            same = tokens.tolist() == reference.tolist()
            print("same tokens as the single-process KVarN run:", same)
    if distributed:
        dist.destroy_process_group()
    return 0 if reference is None or tokens.tolist() == reference.tolist() else 1


if __name__ == "__main__":
    sys.exit(main())
