"""The main job: compile the real default model with ``kvarn_backend`` and generate.

1. Load SmolLM2-135M-Instruct and take a window of real news text as the prompt.
2. Uncompressed reference: greedy decoding with transformers' default cache; the logits
   of every generated position are kept.
3. KVarN: a copy of the model compiled with ``kvarn_backend(preset)``, with a transformers
   ``StaticCache`` (early-initialized, so the pass can take over and release its buffers).
   Free-running greedy decoding gives tokens/s and the first divergence; a second,
   teacher-forced pass over the reference tokens gives top-1 agreement and KL(fp ‖ KVarN)
   on every generated position.
4. Bytes: an fp16 K/V cache of the same tokens vs the packed KVarN states (live tensors),
   and the bytes of the model's own fp buffers that the backend released.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from kvarn_compile.config import get_config

__all__ = ["run_main_job", "print_main_job"]


@torch.no_grad()
def run_main_job(model_name: str | None = None, *, preset: str = "k4v2", prompt_tokens: int = 1536,
                 new_tokens: int = 128, corpus: str = "lee", compiler: str = "inductor",
                 progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import DynamicCache

    from kvarn_compile.backend import kvarn_backend
    from kvarn_compile.hf import kv_geometry, static_cache_for
    from kvarn_compile.eval.models import load_model, text_windows
    from kvarn_compile.state import fp16_cache_bytes

    cfg = get_config(preset)
    model, tok = load_model(model_name)
    ids = text_windows(tok, 1, prompt_tokens, corpus)
    text = model.config.get_text_config(decoder=True)
    kv_heads, head_dim = kv_geometry(model)
    max_len = prompt_tokens + new_tokens

    def decode(m, cache, forced: torch.Tensor | None, desc: str):
        """Prefill, then greedy (or teacher-forced) steps; logits of each new position."""
        t0 = time.perf_counter()
        out = m(input_ids=ids, past_key_values=cache, use_cache=True)
        prefill_s = time.perf_counter() - t0
        logits, tokens, step_s = [out.logits[:, -1].float()], [], []
        for i in tqdm(range(new_tokens), desc=desc, disable=not progress, file=sys.stderr):
            nxt = logits[-1].argmax(-1, keepdim=True) if forced is None else forced[:, i:i + 1]
            tokens.append(nxt)
            if i + 1 < new_tokens:
                t0 = time.perf_counter()
                out = m(input_ids=nxt, past_key_values=cache, use_cache=True)
                step_s.append(time.perf_counter() - t0)
                logits.append(out.logits[:, -1].float())
        steady = step_s[2:] or step_s                      # the first steps include compiling
        return torch.stack(logits, 1), torch.cat(tokens, 1), prefill_s, len(steady) / sum(steady)

    fp_logits, fp_tokens, fp_prefill, fp_tps = decode(model, DynamicCache(config=model.config), None,
                                                      "uncompressed")

    kv_model, _ = load_model(model_name)
    backend = kvarn_backend(cfg, max_cache_len=max_len, compiler=compiler)
    kv_model.compile(backend=backend)

    t0 = time.perf_counter()
    _, kv_tokens, kv_prefill, kv_tps = decode(kv_model, static_cache_for(kv_model, max_len), None,
                                              f"KVarN {preset}")
    first_run_s = time.perf_counter() - t0
    kv_logits, _, _, _ = decode(kv_model, static_cache_for(kv_model, max_len), fp_tokens,
                                f"KVarN {preset} (teacher-forced)")

    logp_fp, logp_kv = torch.log_softmax(fp_logits, -1), torch.log_softmax(kv_logits, -1)
    kl = (logp_fp.exp() * (logp_fp - logp_kv)).sum(-1)
    agree = (fp_logits.argmax(-1) == kv_logits.argmax(-1)).float()
    same = (kv_tokens == fp_tokens)[0]
    first_div = int((~same).nonzero()[0]) if bool((~same).any()) else new_tokens

    tokens_held = max_len - 1
    fp16 = fp16_cache_bytes(batch=1, kv_heads=kv_heads, head_dim=head_dim,
                            tokens=tokens_held) * text.num_hidden_layers
    used = {}
    for state in backend.states.values():
        for region, n in state.used_bytes().items():
            used[region] = used.get(region, 0) + n
    tiles = sum(int(s.n_tiles.max()) for s in backend.states.values())
    any_state = next(iter(backend.states.values()))
    per_tile = sum(t[0, 0, 0].numel() * t.element_size() for t in any_state.buffers[2:10])
    return {
        "model": model_name or "smollm2-135m-instruct", "preset": preset, "config": cfg.short(),
        "corpus": corpus, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "compiler": compiler, "report": str(backend.report),
        "sites_rewritten": len(backend.report.rewritten), "sites_total": len(backend.report.sites),
        "graphs_compiled": backend.report.graphs,
        "kv_bytes": {"fp16": fp16, "kvarn_allocated": backend.nbytes, "kvarn_used": sum(used.values()),
                     "kvarn_by_region": used,
                     "model_fp_buffers_released": sum(s.released_bytes for s in backend.report.sites)},
        "compression_vs_fp16": fp16 / sum(used.values()),
        "bpe_overall": 8 * sum(used.values()) / (fp16 / 2),
        "bpe_tiles": 8 * per_tile / (2 * cfg.group_size * head_dim) if tiles else None,
        "tokens_per_s": {"uncompressed_eager": fp_tps, "kvarn_compiled": kv_tps},
        "prefill_s": {"uncompressed_eager": fp_prefill, "kvarn_compiled_first_call": kv_prefill},
        "kvarn_first_run_s_incl_compile": first_run_s,
        "agreement": {"teacher_forced_top1": agree.mean().item(), "kl_mean": kl.mean().item(),
                      "kl_max": kl.max().item(), "greedy_first_divergence": first_div,
                      "greedy_token_match": same.float().mean().item()},
        "sample": {"uncompressed": tok.decode(fp_tokens[0, :40]), "kvarn": tok.decode(kv_tokens[0, :40])},
    }


def print_main_job(res: dict[str, Any]) -> None:
    kb, a, tps = res["kv_bytes"], res["agreement"], res["tokens_per_s"]
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    print(f"\nkvarn_backend({res['preset']!r}) on {res['model']}: {res['prompt_tokens']}-token prompt of "
          f"'{res['corpus']}' + {res['new_tokens']} generated tokens ({res['compiler']})")
    print(f"  rewrite    {res['sites_rewritten']}/{res['sites_total']} attention sites rewritten in "
          f"{res['graphs_compiled']} graph(s); {mib(kb['model_fp_buffers_released'])} of the model's "
          "fp K/V buffers released")
    print(f"  KV cache   fp16 {mib(kb['fp16'])} | KVarN {mib(kb['kvarn_used'])} in use "
          f"({res['compression_vs_fp16']:.2f}x smaller), {mib(kb['kvarn_allocated'])} allocated")
    bpe_tiles = res["bpe_tiles"] if res["bpe_tiles"] is not None else float("nan")
    print(f"  bits/elem  {res['bpe_overall']:.3f} overall (sink + tiles + tail), {bpe_tiles:.3f} in the packed tiles")
    print(f"  speed      uncompressed (eager) {tps['uncompressed_eager']:.1f} tok/s | KVarN compiled "
          f"{tps['kvarn_compiled']:.1f} tok/s (steady state; first run incl. compile "
          f"{res['kvarn_first_run_s_incl_compile']:.0f} s)")
    print(f"  quality    teacher-forced top-1 agreement {a['teacher_forced_top1']:.3f}, KL "
          f"{a['kl_mean']:.4f} nats/token (max {a['kl_max']:.3f}); greedy streams agree for the first "
          f"{a['greedy_first_divergence']} tokens ({a['greedy_token_match']:.2f} of positions)")
    print(f"  fp16 : {res['sample']['uncompressed']!r}")
    print(f"  KVarN: {res['sample']['kvarn']!r}")
