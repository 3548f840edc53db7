"""Multi-head latent attention (DeepSeek-V2/V3 family): bytes per token and layer, and quality.

    python benchmarks/bench_mla_cpu.py [--tokens 4096 32768] [--prompt 1024] [--new 256]

``memory``: one layer's packed state, filled to ``tokens`` tokens, bytes counted from its live
tensors and divided by the tokens, against the bf16 cache of the same layer:

* ``latent``: what the absorbed form caches per token (the normed latent, 512 channels, and
  the shared RoPE key, 64; also what transformers' DeepSeek-V3 caches), as ``kvarn_backend``
  (``kvarn::latent_attention``) and ``KVarNCache`` pack it: the latent at the preset's key
  bits, the RoPE key at ``LATENT_ROPE_BITS``, one packed copy of the latent serving the
  scores and the values; bf16: 1,152 bytes;
* ``decompressed``: DeepSeek's "naive" cache (128 heads of 192-channel keys and
  128-channel values), as ``kvarn_backend`` packs it; bf16: 81,920 bytes.

``quality``: teacher-forced over ``--new`` tokens after a ``--prompt``-token prompt, top-1
agreement and KL(uncompressed || packed) of the next-token distributions:

* ``hf_deepseek_v3``: a tiny random-weight transformers ``DeepseekV3ForCausalLM`` (64-channel
  latent, 16-channel RoPE key) with ``KVarNCache``, against its own uncompressed forward;
* ``decompressed_codebase``: the tiny DeepSeek-style model of
  ``kvarn_compile.testing.codebases`` (K 48 = 32 + 16 RoPE channels, V 32) compiled with
  ``kvarn_backend``, driven by its own loop, against the same model uncompressed;
* ``absorbed_codebase``: the same model in DeepSeek's default absorbed form (64-channel latent
  and 16-channel RoPE key cached, ``kvarn::latent_attention``), same protocol;
* ``latent_hf_codebase``: the absorbed form as an HF-style patch spells it (matmul, [B, 1, T, C]
  ``torch.cat`` caches), same protocol.

Random weights: these say the packed cache follows the model closely, not how a trained
model's answers change. Prints JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import env  # noqa: E402

from kvarn_compile import get_config, kvarn_backend  # noqa: E402
from kvarn_compile import hf  # noqa: E402
from kvarn_compile.config import LATENT_ROPE_BITS  # noqa: E402
from kvarn_compile.ops.append import append_  # noqa: E402
from kvarn_compile.state import allocate_layer  # noqa: E402


def _filled_bytes(cfg, *, heads: int, d: int, dv: int, tokens: int) -> int:
    """Bytes of one layer's state holding ``tokens`` tokens (allocated for exactly those)."""
    st = allocate_layer(cfg, batch=1, kv_heads=heads, head_dim=d, value_head_dim=dv,
                        max_len=tokens, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for start in range(0, tokens, 4096):
        t = min(4096, tokens - start)
        k = torch.randn(1, heads, t, d, generator=g, dtype=torch.bfloat16)
        v = torch.randn(1, heads, t, dv, generator=g, dtype=torch.bfloat16)
        append_(st.buffers, k, v, torch.tensor([start]), method=cfg.op_method,
                iters=cfg.sinkhorn_iters)
    assert int(st.lengths[0]) == tokens
    return st.nbytes


def memory(preset: str, tokens_list) -> dict:
    base = get_config(preset)
    out = {}
    for tokens in tokens_list:
        lat = _filled_bytes(base.replace(value_bits=LATENT_ROPE_BITS), heads=1, d=512, dv=64,
                            tokens=tokens) / tokens
        out[f"latent_{tokens}"] = dict(bytes_per_token=round(lat, 1), bf16=1152,
                                       ratio=round(1152 / lat, 3))
    tokens = min(tokens_list)
    dec = _filled_bytes(base, heads=128, d=192, dv=128, tokens=tokens) / tokens
    out[f"decompressed_{tokens}"] = dict(bytes_per_token=round(dec, 1), bf16=128 * 320 * 2,
                                         ratio=round(128 * 320 * 2 / dec, 3))
    return out


def _scores(ref: torch.Tensor, got: torch.Tensor) -> dict:
    lp, lq = ref.float().log_softmax(-1), got.float().log_softmax(-1)
    return dict(top1=round((ref.argmax(-1) == got.argmax(-1)).float().mean().item(), 4),
                kl=float(f"{(lp.exp() * (lp - lq)).sum(-1).mean().item():.3g}"))


def hf_deepseek_v3(preset: str, prompt: int, new: int) -> dict:
    import transformers as T

    cfg = T.DeepseekV3Config(vocab_size=128, hidden_size=128, intermediate_size=256,
                             moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=64,
                             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                             n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
                             max_position_embeddings=prompt + new + 8)
    torch.manual_seed(0)
    model = T.DeepseekV3ForCausalLM(cfg).eval()
    for p in model.parameters():
        if p.dim() == 2:
            p.data.mul_(2.0)
    ids = torch.randint(0, 128, (1, prompt + new), generator=torch.Generator().manual_seed(1))
    cache = hf.KVarNCache(cfg, max_cache_len=prompt + new, preset=preset)
    with torch.no_grad():
        ref = model(ids).logits[0, prompt - 1:prompt + new - 1]
        got = [model(ids[:, :prompt], cache=cache).logits[0, -1:]]
        for t in range(prompt, prompt + new - 1):
            got.append(model(ids[:, t:t + 1], cache=cache).logits[0])
    return _scores(ref, torch.cat(got)) | dict(state_bytes=cache.nbytes)


def _codebase(name: str, preset: str, prompt: int, new: int, **cfg) -> dict:
    """A codebase model (``kvarn_compile.testing.codebases``) compiled with ``kvarn_backend`` and
    driven by its own loop, teacher-forced on the uncompressed model's greedy tokens."""
    from kvarn_compile.testing.codebases import build, run_generate

    torch._dynamo.reset()
    model = build(name, max_len=prompt + new + 2, **cfg)
    ids = torch.randint(0, 128, (1, prompt), generator=torch.Generator().manual_seed(1))
    backend = kvarn_backend(preset, compiler="eager")
    fp_tokens, fp = run_generate(copy.deepcopy(model), ids, new)
    m = copy.deepcopy(model)
    _, got = run_generate(m, ids, new, step=torch.compile(m, backend=backend), forced=fp_tokens)
    report = backend.report
    return _scores(torch.cat(fp), torch.cat(got)) | dict(
        rewritten=len(report.rewritten), sites=len(report.sites), state_bytes=backend.nbytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--presets", nargs="+", default=["k4v2"])
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    out = {"env": env(), "latent_rope_bits": LATENT_ROPE_BITS, "results": {}}
    for preset in args.presets:
        out["results"][preset] = dict(
            memory=memory(preset, args.tokens),
            hf_deepseek_v3=hf_deepseek_v3(preset, args.prompt, args.new),
            decompressed_codebase=_codebase("deepseek", preset, args.prompt, args.new,
                                            mla=(64, 32, 16, 32)),
            absorbed_codebase=_codebase("deepseek", preset, args.prompt, args.new,
                                        mla=(64, 32, 16, 32), absorb=True),
            latent_hf_codebase=_codebase("latent-hf", preset, args.prompt, args.new,
                                         mla=(64, 32, 16, 32)))
        print(json.dumps({preset: out["results"][preset]}), file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
