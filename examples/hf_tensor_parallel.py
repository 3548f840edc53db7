"""A transformers model loaded tensor-parallel (``tp_plan="auto"``), compiled with ``kvarn_backend``.

    torchrun --standalone --nproc-per-node 3 examples/hf_tensor_parallel.py            # SmolLM2-135M
    torchrun --standalone --nproc-per-node 3 examples/hf_tensor_parallel.py --check    # + 1-process run
    torchrun --standalone --nproc-per-node 2 examples/hf_tensor_parallel.py --model PATH

Every rank loads its shard of the weights (transformers needs ``accelerate`` for that), and
its attention sees only its own heads, so the KVarN pass gives every rank the packed cache
of its KV heads. transformers splits by whole heads and never replicates KV heads: the KV
heads must divide by the number of ranks (SmolLM2-135M, 3 KV heads: 1 or 3 ranks; 2 is
refused before loading). Rank 0 prints the text and one report over all ranks; ``--check``
also runs the model in one process (on rank 0) and compares the tokens.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import sys

import torch
import torch.distributed as dist


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a save_pretrained folder (default: SmolLM2-135M)")
    p.add_argument("--prompt", default="The history of the printing press begins")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--preset", default="k4v2")
    p.add_argument("--compiler", default="eager", choices=["eager", "inductor"],
                   help="eager: run the rewritten graphs as they are (starts fast); inductor")
    p.add_argument("--check", action="store_true", help="compare with a one-process run")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per collective")
    opts = p.parse_args(argv)
    torch.set_grad_enabled(False)

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvarn_compile import kvarn_backend
    from kvarn_compile.distributed import check_hf_tensor_parallel, hf_tp_kwargs, print_report

    distributed = "RANK" in os.environ
    if distributed and importlib.util.find_spec("accelerate") is None:
        if os.environ.get("RANK") == "0":    # one line, not one per rank
            print("hf_tensor_parallel: transformers needs the accelerate package to load a model "
                  "tensor-parallel (tp_plan); install it with: pip install -e \".[distributed]\" "
                  "(or pip install accelerate)", file=sys.stderr)
        return 2
    if distributed:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=opts.timeout))
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if opts.model is None:
        from kvarn_compile.eval.models import _default_model_dir

        if rank == 0:
            _default_model_dir()                 # the first run converts the GGUF file once
        if distributed:
            dist.barrier()
        opts.model = str(_default_model_dir())
    check_hf_tensor_parallel(AutoConfig.from_pretrained(opts.model), world)
    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    ids = tokenizer(opts.prompt, return_tensors="pt").input_ids

    def generate(**load):
        model = AutoModelForCausalLM.from_pretrained(opts.model, dtype=torch.float32, **load).eval()
        backend = kvarn_backend(opts.preset, compiler=opts.compiler,
                                max_cache_len=ids.shape[1] + opts.new)
        model.compile(backend=backend)
        out = model.generate(ids, max_new_tokens=opts.new, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
        return out[0, ids.shape[1]:], backend

    reference = None
    if opts.check and rank == 0:
        reference, _ = generate()
        torch._dynamo.reset()
    tokens, backend = generate(**(hf_tp_kwargs() if distributed else {}))
    print_report(backend)
    if rank == 0:
        print(repr(opts.prompt + tokenizer.decode(tokens)))
        if reference is not None:
            print("same tokens as the one-process KVarN run:", tokens.tolist() == reference.tolist())
    if distributed:
        dist.destroy_process_group()
    return 0 if reference is None or tokens.tolist() == reference.tolist() else 1


if __name__ == "__main__":
    sys.exit(main())
