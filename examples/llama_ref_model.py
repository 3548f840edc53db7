"""A Llama-style decoder written the way the original reference code writes its attention.

Single file, no framework. The KV cache is laid out ``[batch, seq, kv_heads, head_dim]``
(sequence on dim 1), one ``register_buffer`` pair per layer sized for the largest batch:

    cache_k[:bsz, start_pos:start_pos + seqlen] = xk        # write a slice of the batch
    keys = cache_k[:bsz, :start_pos + seqlen]               # read every position so far
    keys = repeat_kv(keys, n_rep).transpose(1, 2)           # GQA on [B, S, H, D], then [B, H, S, D]
    scores = softmax((xq @ keys.transpose(2, 3)) / sqrt(d) + mask, fp32).type_as(xq)

``start_pos`` is a Python int; the prefill passes an additive causal mask, decode steps
none. ``reset_caches()`` zeroes the buffers for a new request. Run it:

    python examples/llama_ref_model.py        # eager vs torch.compile(kvarn_backend) tokens
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    max_batch_size: int = 2
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


def rope_table(head_dim: int, length: int, theta: float) -> torch.Tensor:
    """[length, head_dim / 2] complex rotations e^(i * pos * freq)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(length).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    # x: [B, S, H, D]; rot: [S, D / 2]
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * rot[None, :, None, :]).flatten(3).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    # [B, S, Hkv, D] -> [B, S, Hkv * n_rep, D], each KV head repeated n_rep times in a row
    bs, slen, n_kv, hd = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv, n_rep, hd).reshape(bs, slen, n_kv * n_rep, hd)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.n_rep = args.n_heads // args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        shape = (args.max_batch_size, args.max_seq_len, args.n_kv_heads, self.head_dim)
        self.register_buffer("cache_k", torch.zeros(shape), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape), persistent=False)

    def forward(self, x: torch.Tensor, start_pos: int, rot: torch.Tensor, mask: torch.Tensor | None):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rope(xq, rot), apply_rope(xk, rot)

        self.cache_k[:bsz, start_pos:start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos:start_pos + seqlen] = xv
        keys = repeat_kv(self.cache_k[:bsz, :start_pos + seqlen], self.n_rep)
        values = repeat_kv(self.cache_v[:bsz, :start_pos + seqlen], self.n_rep)

        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask            # [seqlen, start_pos + seqlen]
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        out = torch.matmul(scores, values)    # [B, H, seqlen, D]
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        hidden = 2 * args.dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, start_pos, rot, mask):
        h = x + self.attention(self.attention_norm(x), start_pos, rot, mask)
        n = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(n)) * self.w3(n))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rot", rope_table(args.dim // args.n_heads, args.max_seq_len,
                                               args.rope_theta), persistent=False)

    def reset_caches(self) -> None:
        """Forget the previous request: zero every layer's KV cache."""
        for layer in self.layers:
            layer.attention.cache_k.zero_()
            layer.attention.cache_v.zero_()

    def forward(self, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        # tokens: [B, seqlen] at positions start_pos .. start_pos + seqlen - 1
        _, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        rot = self.rot[start_pos:start_pos + seqlen]
        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device).triu(1)
            mask = torch.hstack([torch.zeros(seqlen, start_pos, device=tokens.device), mask])
        for layer in self.layers:
            h = layer(h, start_pos, rot, mask)
        return self.output(self.norm(h)).float()


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, new_tokens: int, step=None,
             prefill=None) -> torch.Tensor:
    """Greedy decoding: the prompt [B, T] through ``prefill`` (default: ``step``), then one
    token at a time through ``step`` (default: the model)."""
    step = model if step is None else step
    prefill = step if prefill is None else prefill
    t = prompt.shape[1]
    out = [prefill(prompt, 0)[:, -1].argmax(-1, keepdim=True)]
    for i in range(new_tokens - 1):
        out.append(step(out[-1], t + i)[:, -1].argmax(-1, keepdim=True))
    return torch.cat(out, 1)


if __name__ == "__main__":
    from kvarn_compile import kvarn_backend

    torch.manual_seed(0)
    model = Transformer(ModelArgs()).eval()
    prompt = torch.randint(0, 256, (2, 200))
    eager = generate(model, prompt, 32)
    model.reset_caches()
    backend = kvarn_backend(preset="k4v2", group_size=64)
    tokens = generate(model, prompt, 32, step=torch.compile(model, backend=backend))
    print(backend.report)
    same = (tokens == eager).all(0)                 # per position, every batch row
    first = int(same.long().cumprod(0).sum())
    print(f"greedy tokens: the first {first} of {same.numel()} equal the uncompressed model's "
          f"({same.float().mean():.0%} of all positions). The weights are random, so the top two "
          "logits are near ties and any rounding flips some; a greedy stream that took another "
          "token then continues another text. `kvarn-compile run` measures a trained model.")
