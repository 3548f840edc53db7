"""A nanoGPT-style GPT-2 (MHA, learned positions) with a slice-assigned KV cache and the
eager attention chain q @ k^T * scale + mask -> softmax -> @ v.

Single file, no framework. The cache write is ``k_cache[:, :, start:start + T] = k`` with a
Python int ``start``; the attention is written out by hand (no SDPA), which is the second
spelling kvarn_compile's pass recognizes:

    python examples/nanogpt_model.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 512        # maximum sequence length (also the cache capacity)
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        hd = cfg.n_embd // cfg.n_head
        self.register_buffer("k_cache", torch.zeros(1, cfg.n_head, cfg.block_size, hd), persistent=False)
        self.register_buffer("v_cache", torch.zeros(1, cfg.n_head, cfg.block_size, hd), persistent=False)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("bias", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)   # [B, H, T, D]
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        self.k_cache[:, :, start:start + t] = k
        self.v_cache[:, :, start:start + t] = v
        att = (q @ self.k_cache.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        allowed = self.bias[:, :, start:start + t, :]                       # [1, 1, T, L]
        att = att + torch.zeros_like(allowed, dtype=att.dtype).masked_fill(~allowed, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ self.v_cache                                              # [B, H, T, D]
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), start)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, start: int) -> torch.Tensor:
        # idx: [B, T] tokens at positions start .. start + T - 1
        pos = torch.arange(start, start + idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x, start)
        return self.lm_head(self.ln_f(x))


@torch.no_grad()
def generate(model: GPT, prompt: torch.Tensor, new_tokens: int, step=None) -> torch.Tensor:
    step = model if step is None else step
    t = prompt.shape[1]
    out = [step(prompt, 0)[:, -1].argmax(-1, keepdim=True)]
    for i in range(new_tokens - 1):
        out.append(step(out[-1], t + i)[:, -1].argmax(-1, keepdim=True))
    return torch.cat(out, 1)


if __name__ == "__main__":
    from kvarn_compile import kvarn_backend

    torch.manual_seed(0)
    model = GPT(GPTConfig()).eval()
    prompt = torch.randint(0, 256, (1, 200))
    eager = generate(model, prompt, 32)
    backend = kvarn_backend(preset="k4v4", group_size=64)
    tokens = generate(model, prompt, 32, step=torch.compile(model, backend=backend))
    print(backend.report)
    same = (tokens == eager).all(0)                 # per position, every batch row
    first = int(same.long().cumprod(0).sum())
    print(f"greedy tokens: the first {first} of {same.numel()} equal the uncompressed model's "
          f"({same.float().mean():.0%} of all positions). The weights are random, so the top two "
          "logits are near ties and any rounding flips some; a greedy stream that took another "
          "token then continues another text. `kvarn-compile run` measures a trained model.")
