"""Resident memory of a model whose own K/V buffers ``kvarn_backend`` releases.

    python benchmarks/bench_released_buffers.py [--seq 16384] [--no-reset]

The Llama-style example (``examples/llama_ref_model.py``, [B, S, H, D] register_buffer
caches; ``--example gpt_fast``: the gpt-fast example) with large caches, compiled with ``kvarn_backend(compiler="eager")``. Prints JSON:
the bytes of the model's fp K/V buffers, the process's resident set (``/proc/self/statm``)
right after building the model, after a compiled ``generate`` (the buffers are released),
after ``reset_caches()`` (``zero_()`` writes every page again) and after a second
``generate``, for ``release_buffers=True`` and ``False``, plus the released bytes the
report counts. Linux only (RSS).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, os, sys
import torch
sys.path.insert(0, {examples!r})
from kvarn_compile import kvarn_backend

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

torch.set_num_threads(1)
torch.manual_seed(0)
if {example!r} == "llama_ref":
    import llama_ref_model as lm
    args = lm.ModelArgs(vocab_size=64, dim=128, n_layers=4, n_heads=4, n_kv_heads=2,
                        max_batch_size=1, max_seq_len={seq})
    model = lm.Transformer(args).eval()
    buffers = [t for layer in model.layers for t in (layer.attention.cache_k, layer.attention.cache_v)]
else:
    import gpt_fast_model as lm
    model = lm.Transformer(lm.ModelArgs(vocab_size=64, n_layer=4, dim=128, n_head=4,
                                        n_local_heads=2)).eval()
    model.setup_caches(max_batch_size=1, max_seq_length={seq})
    buffers = [t for layer in model.layers
               for t in (layer.attention.kv_cache.k_cache, layer.attention.kv_cache.v_cache)]
    model.reset_caches = lambda: [t.zero_() for t in buffers]
out = dict(release_buffers={release}, fp_buffer_bytes=sum(t.numel() * t.element_size() for t in buffers))
backend = kvarn_backend("k4v2", group_size=64, compiler="eager", max_cache_len={seq},
                        release_buffers={release})
step = torch.compile(model, backend=backend)
prompt = torch.randint(0, 64, (1, 200))
torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))      # Dynamo's own start-up
out["rss_built"] = rss()
lm.generate(model, prompt, 8, step=step)
out["rss_after_generate"] = rss()
if {reset}:
    model.reset_caches()
    out["rss_after_reset"] = rss()
    lm.generate(model, prompt, 8, step=step)
    out["rss_after_second_generate"] = rss()
out["released_bytes_reported"] = backend.report.released_bytes
out["packed_state_bytes"] = backend.nbytes
print("RESULT " + json.dumps(out))
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=16384, help="cache capacity (tokens)")
    p.add_argument("--no-reset", action="store_true", help="skip reset_caches() + second generate")
    p.add_argument("--example", choices=["llama_ref", "gpt_fast"], default="llama_ref")
    a = p.parse_args()
    rows = []
    for release in (True, False):
        code = _CHILD.format(examples=str(ROOT / "examples"), seq=a.seq, release=release,
                             reset=not a.no_reset, example=a.example)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=dict(os.environ))
        if proc.returncode != 0:
            rows.append({"release_buffers": release, "exit_code": proc.returncode,
                         "stderr_tail": proc.stderr[-400:]})
            continue
        rows.append(json.loads(proc.stdout.split("RESULT ", 1)[1]))
    print(json.dumps({"benchmark": "released_buffers", "example": a.example, "seq": a.seq,
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
