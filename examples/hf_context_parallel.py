"""Context-parallel decoding: one long sequence's packed KV tiles spread over the ranks.

    torchrun --standalone --nproc-per-node 2 examples/hf_context_parallel.py            # SmolLM2-135M
    torchrun --standalone --nproc-per-node 2 examples/hf_context_parallel.py --check    # + 1-process run
    torchrun --standalone --nproc-per-node 2 examples/hf_context_parallel.py --cache kvarncache

Every rank loads the whole model and runs every step (weights replicated); the KV cache
is what is split: ``kvarn_backend(context_parallel=True)`` (or ``KVarNCache(...,
context_parallel=True)`` with the ``kvarn`` attention) gives rank r the r-th contiguous
range of each layer's packed tiles, and every attention call merges the ranks' partial
results with one ``all_gather``. The prompt is ``--prompt`` tokens of news text, so the
cache holds many tiles. Rank 0 prints the text, the packed bytes of every rank, and with
``--check`` whether the tokens equal a one-process KVarN run (computed on rank 0).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens (news text)")
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--preset", default="k4v2")
    p.add_argument("--cache", default="backend", choices=["backend", "kvarncache"],
                   help="backend: kvarn_backend (compiled); kvarncache: KVarNCache, eager")
    p.add_argument("--compiler", default="eager", choices=["eager", "inductor"])
    p.add_argument("--check", action="store_true", help="compare with a one-process run")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per collective")
    opts = p.parse_args(argv)
    if opts.prompt < 1 or opts.new < 1:
        p.error("expected --prompt >= 1 and --new >= 1")
    torch.set_grad_enabled(False)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvarn_compile import kvarn_backend
    from kvarn_compile.eval.models import _default_model_dir, text_windows
    from kvarn_compile.hf import KVarNCache, cache_kwarg, static_cache_for, use_kvarn_attention

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=opts.timeout))
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if rank == 0:               # the first run converts the GGUF file and fetches the corpus
        text_windows(AutoTokenizer.from_pretrained(_default_model_dir()), 1, opts.prompt)
    if distributed:
        dist.barrier()
    path = _default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = text_windows(tokenizer, 1, opts.prompt)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    max_len = ids.shape[1] + opts.new

    def generate(cp):
        extra = {} if cp is None else {"context_parallel": cp}
        fwd = model.forward
        if opts.cache == "kvarncache":
            use_kvarn_attention(model)
            cache = KVarNCache(model.config, max_len, opts.preset, **extra)
            holder = cache
        else:
            holder = kvarn_backend(opts.preset, compiler=opts.compiler, max_cache_len=max_len, **extra)
            model.forward = torch.compile(fwd, backend=holder)
            cache = static_cache_for(model, max_len)
        try:
            # cache=cache on transformers >= 5.24, past_key_values before: cache_kwarg asks the model
            out = model.generate(ids, max_new_tokens=opts.new, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id, **{cache_kwarg(model): cache})
        finally:
            model.forward = fwd
        return out[0, ids.shape[1]:], holder

    reference = None
    if opts.check and rank == 0:
        reference, _ = generate(None)
        torch._dynamo.reset()
    tokens, holder = generate(True if distributed else None)
    nbytes = torch.tensor([holder.nbytes])
    if distributed:
        parts = [torch.zeros_like(nbytes) for _ in range(world)]
        dist.all_gather(parts, nbytes)
        nbytes = torch.cat(parts)
    if rank == 0:
        print(repr(tokenizer.decode(tokens)))
        print(f"packed KV bytes per rank ({world} rank(s), {max_len} tokens): {nbytes.tolist()}")
        if reference is not None:
            print("same tokens as the one-process KVarN run:", tokens.tolist() == reference.tolist())
    if distributed:
        dist.destroy_process_group()
    return 0 if reference is None or tokens.tolist() == reference.tolist() else 1


if __name__ == "__main__":
    sys.exit(main())
