"""Tiny models written in the spelling of public PyTorch codebases that keep their own KV cache.

Each class is written here from scratch (no code of those projects): a tiny config, random
weights, and the attention and cache update spelled the way the named codebase spells them;
each has its own greedy generation loop (prefill, then one token per step), as that codebase
drives its model. Spellings (item letters of the "real model code" issue):

    name         codebase                            spelling
    torchtune    pytorch/torchtune KVCache           (a) positions in a ``cache_pos`` buffer the
                                                     module advances itself:
                                                     ``k_cache[:, :, self.cache_pos[:T]] = k`` (or
                                                     ``index_copy_(2, self.cache_pos[:T], k)``), then
                                                     ``self.cache_pos.add_(T)``; GQA by
                                                     unsqueeze/expand/flatten; sdpa, bool mask
    stacked      mistral-inference BufferCache,      (b) one cache ``[L, B, S, H, D]`` for all layers:
                 karpathy/nanochat KVCache           ``cache_k[layer, :bsz, a:b] = xk``, read
                                                     ``cache_k[layer, :bsz, :b]``; repeat_kv, matmul chain
    gemma        google/gemma_pytorch                caches passed in as a list, ``index_copy_(1,
                                                     kv_write_indices, xk)`` on ``[B, S, H, D]``, the
                                                     whole cache read, repeat_interleave(dim=2),
                                                     ``q.mul_(scaling)``, + mask (a local sliding mask on
                                                     every other layer), softmax(fp32)
    deepseek     deepseek-ai/DeepSeek-V3 (naive)     (d) ``einsum("bshd,bthd->bsht")`` scores,
                                                     ``scores += mask.unsqueeze(1)``,
                                                     ``softmax(-1, dtype=float32)``,
                                                     ``einsum("bsht,bthd->bshd")``; with ``mla``
                                                     its latent attention decompressed: K =
                                                     cat(k_nope, k_pe.expand(heads)) and V from
                                                     one up-projection of the normed latent, K
                                                     and V of different head dims; with
                                                     ``absorb`` the absorbed form (the latent
                                                     and the RoPE key cached, no heads axis)
    latent-hf    madsys-dev/deepseekv2-profile       absorbed multi-head latent attention over an HF-style
                 (DeepseekV2Attention, absorbed)     cat cache with a heads axis of one: matmul + .mT,
                                                     ``compressed_kv.squeeze(1).unsqueeze(-3)``, the
                                                     pe term first, a 4-D float mask,
                                                     ``einsum("bhql,blc->bhqc")``
    window       per-layer windows (gpt-oss,         (c) ``k_cache[:, :, max(0, end - W):end]`` with W per
                 Gemma 3 style local layers)         layer (None: a full layer)

``reference(config)`` makes every model here read its K/V as a whole-sequence cache of that
preset holds them (``kvarn_compile.quant.cache.quantize_cache``): the quantization error the
preset itself makes, the yardstick of the tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["CodebaseConfig", "CODEBASES", "build", "reference", "run_generate"]

_REFERENCE = None   # a KVarNConfig while ``reference`` is active


@contextlib.contextmanager
def reference(config):
    """Inside: every model of this module reads K/V quantized by ``config`` (eager only)."""
    global _REFERENCE
    old, _REFERENCE = _REFERENCE, config
    try:
        yield
    finally:
        _REFERENCE = old


def _ref_kv(k: torch.Tensor, v: torch.Tensor, end, seq_axis: int):
    """K/V with positions [0, end) along ``seq_axis`` as a whole-sequence cache of the
    reference preset holds them (the identity outside ``reference``). 3-D [B, S, C] caches
    are a multi-head latent attention latent (``k``) and RoPE key (``v``, at
    ``LATENT_ROPE_BITS``), one head."""
    if _REFERENCE is None:
        return k, v
    from kvarn_compile.config import LATENT_ROPE_BITS
    from kvarn_compile.quant.cache import quantize_cache

    latent = k.dim() == 3

    def tokens_last(x):          # [..., S, D]
        return x.movedim(seq_axis, -2) if x.dim() == 4 else x.unsqueeze(1)

    config = _REFERENCE.replace(value_bits=LATENT_ROPE_BITS) if latent else _REFERENCE
    kq, vq = quantize_cache(tokens_last(k).narrow(-2, 0, end), tokens_last(v).narrow(-2, 0, end),
                            config).dequantize()
    out = []
    for x, xq in ((k, kq), (v, vq)):
        y = tokens_last(x).clone()
        y[..., :end, :] = xq.to(x.dtype)
        out.append(y.squeeze(1) if latent else y.movedim(-2, seq_axis))
    return out[0], out[1]


@dataclasses.dataclass
class CodebaseConfig:
    vocab: int = 128
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    max_batch: int = 1
    max_len: int = 96
    windows: tuple = (None, 48)      # "window": per layer (None: full attention)
    write: str = "setitem"           # "torchtune": "setitem" | "index_copy" | "late_v" (twin:
    #                                  V written one position later, after cache_pos moved on)
    twin: bool = False               # the must-not-match spelling of a codebase
    #: "deepseek" as multi-head latent attention, decompressed ("naive" mode): (kv_lora_rank,
    #: qk_nope_head_dim, qk_rope_head_dim, v_head_dim); K has nope + rope channels, V v_head_dim
    mla: tuple | None = None
    #: with ``mla``: the absorbed form (DeepSeek's default): the up-projection folded into the
    #: queries and the output, the normed latent and the RoPE key cached per token (no heads axis)
    absorb: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# ------------------------------------------------------------------------------ shared parts
def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [B, T, H, D] at positions pos [T]."""
    d = x.shape[-1]
    freqs = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * freqs[None]
    cos, sin = ang.cos().repeat(1, 2)[None, :, None], ang.sin().repeat(1, 2)[None, :, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return (x * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class _Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Block(nn.Module):
    def __init__(self, cfg: CodebaseConfig, attn: nn.Module):
        super().__init__()
        self.attn = attn
        self.n1, self.n2 = _Norm(cfg.dim), _Norm(cfg.dim)
        self.up = nn.Linear(cfg.dim, 2 * cfg.dim, bias=False)
        self.down = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)

    def forward(self, x, *args):
        x = x + self.attn(self.n1(x), *args)
        return x + self.down(F.silu(self.up(self.n2(x))))


class _LM(nn.Module):
    """Embedding, blocks, head; ``forward(tokens, *per-codebase arguments)``."""

    def __init__(self, cfg: CodebaseConfig, attn_cls):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(_Block(cfg, attn_cls(cfg, i)) for i in range(cfg.n_layers))
        self.norm = _Norm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def _run(self, tokens, *args):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, *args)
        return self.head(self.norm(h))


# ------------------------------------------------------------------------------ (a) torchtune
class _TuneKVCache(nn.Module):
    """torchtune-style KVCache: [B, H, S, D] buffers and a ``cache_pos`` buffer of positions
    that ``update`` advances itself."""

    def __init__(self, cfg: CodebaseConfig):
        super().__init__()
        shape = (cfg.max_batch, cfg.n_kv_heads, cfg.max_len, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("cache_pos", torch.arange(cfg.max_len), persistent=False)
        self.write = cfg.write

    def reset(self):
        self.k_cache.zero_()
        self.v_cache.zero_()
        self.cache_pos -= self.cache_pos[0].item()

    def update(self, k_val, v_val):
        seq_len = k_val.shape[2]
        k_out, v_out = self.k_cache, self.v_cache
        if self.write == "index_copy":
            k_out.index_copy_(2, self.cache_pos[:seq_len], k_val)
            v_out.index_copy_(2, self.cache_pos[:seq_len], v_val)
        elif self.write == "late_v":          # twin: V written after the positions moved on
            k_out[:, :, self.cache_pos[:seq_len]] = k_val
            self.cache_pos.add_(seq_len)
            v_out[:, :, self.cache_pos[:seq_len] - (seq_len - 1)] = v_val     # one position later
            return k_out, v_out
        else:
            k_out[:, :, self.cache_pos[:seq_len]] = k_val
            v_out[:, :, self.cache_pos[:seq_len]] = v_val
        self.cache_pos.add_(seq_len)
        return k_out, v_out


class _TuneAttention(nn.Module):
    def __init__(self, cfg: CodebaseConfig, idx: int):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.output_proj = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        self.kv_cache = _TuneKVCache(cfg)

    def forward(self, x, mask, input_pos):
        b, s, _ = x.shape
        c = self.cfg
        q = _rope(self.q_proj(x).view(b, s, c.n_heads, c.head_dim), input_pos).transpose(1, 2)
        k = _rope(self.k_proj(x).view(b, s, c.n_kv_heads, c.head_dim), input_pos).transpose(1, 2)
        v = self.v_proj(x).view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)
        k, v = self.kv_cache.update(k, v)
        k, v = _ref_kv(k, v, int(input_pos[-1]) + 1 if _REFERENCE is not None else 0, 2)
        q_per_kv = c.n_heads // c.n_kv_heads
        expand = (b, c.n_kv_heads, q_per_kv, -1, c.head_dim)
        k = k.unsqueeze(2).expand(expand).flatten(1, 2)
        v = v.unsqueeze(2).expand(expand).flatten(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, :, :])
        return self.output_proj(out.transpose(1, 2).reshape(b, s, -1))


class TorchtuneModel(_LM):
    def __init__(self, cfg: CodebaseConfig):
        super().__init__(cfg, _TuneAttention)
        self.register_buffer("causal_mask", torch.ones(cfg.max_len, cfg.max_len, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, tokens, mask, input_pos):
        return self._run(tokens, mask, input_pos)

    def reset(self):
        for layer in self.layers:
            layer.attn.kv_cache.reset()

    def generate(self, prompt, new, step=None, forced=None):
        # torchtune's generation: masks = causal_mask[None, :T]; decode masks[:, pos, None, :]
        step = self if step is None else step
        t = prompt.shape[1]
        pos = torch.arange(t)
        logits = [step(prompt, self.causal_mask[None, :t], pos)[:, -1]]
        tokens = [_next(logits, forced, 0)]
        for i in range(new - 1):
            pos = torch.tensor([t + i])
            logits.append(step(tokens[-1], self.causal_mask[None, t + i, None, :], pos)[:, -1])
            tokens.append(_next(logits, forced, i + 1))
        return torch.cat(tokens, 1), logits


def _next(logits, forced, i):
    return logits[-1].argmax(-1, keepdim=True) if forced is None else forced[:, i:i + 1]


# ------------------------------------------------------------------------------ (b) stacked
class _StackedAttention(nn.Module):
    """llama-reference attention over a cache stacked over layers ([L, B, S, H, D], one tensor
    for the whole model, mistral-inference / nanochat style), indexed by ``layer_idx``."""

    def __init__(self, cfg: CodebaseConfig, idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, idx
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)

    def forward(self, x, cache_k, cache_v, start_pos: int, pos, mask):
        bsz, seqlen, _ = x.shape
        c = self.cfg
        xq = _rope(self.wq(x).view(bsz, seqlen, c.n_heads, c.head_dim), pos)
        xk = _rope(self.wk(x).view(bsz, seqlen, c.n_kv_heads, c.head_dim), pos)
        xv = self.wv(x).view(bsz, seqlen, c.n_kv_heads, c.head_dim)
        end = start_pos + seqlen
        if c.twin:
            # mistral-inference's own update: index_copy_ into the layer's cache flattened
            # over batch and positions (flat positions b * S + p)
            flat = pos + torch.arange(bsz).repeat_interleave(seqlen) * c.max_len
            cache_k[self.layer_idx].view(-1, c.n_kv_heads, c.head_dim).index_copy_(0, flat, xk.flatten(0, 1))
            cache_v[self.layer_idx].view(-1, c.n_kv_heads, c.head_dim).index_copy_(0, flat, xv.flatten(0, 1))
        else:
            cache_k[self.layer_idx, :bsz, start_pos:end] = xk
            cache_v[self.layer_idx, :bsz, start_pos:end] = xv
        keys = cache_k[self.layer_idx, :bsz, :end]
        values = cache_v[self.layer_idx, :bsz, :end]
        keys, values = _ref_kv(keys, values, end, 1)
        rep = c.n_heads // c.n_kv_heads
        keys = keys[:, :, :, None, :].expand(bsz, end, c.n_kv_heads, rep, c.head_dim).reshape(
            bsz, end, c.n_heads, c.head_dim)
        values = values[:, :, :, None, :].expand(bsz, end, c.n_kv_heads, rep, c.head_dim).reshape(
            bsz, end, c.n_heads, c.head_dim)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(c.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        out = torch.matmul(scores, values)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class StackedModel(_LM):
    def __init__(self, cfg: CodebaseConfig):
        super().__init__(cfg, _StackedAttention)
        shape = (cfg.n_layers, cfg.max_batch, cfg.max_len, cfg.n_kv_heads, cfg.head_dim)
        self.register_buffer("cache_k", torch.zeros(shape), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape), persistent=False)

    def forward(self, tokens, start_pos: int):
        seqlen = tokens.shape[1]
        pos = torch.arange(start_pos, start_pos + seqlen)
        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf")).triu(1)
            mask = torch.hstack([torch.zeros(seqlen, start_pos), mask])
        return self._run(tokens, self.cache_k, self.cache_v, start_pos, pos, mask)

    def reset(self):
        self.cache_k.zero_()
        self.cache_v.zero_()

    def generate(self, prompt, new, step=None, forced=None):
        step = self if step is None else step
        t = prompt.shape[1]
        logits = [step(prompt, 0)[:, -1]]
        tokens = [_next(logits, forced, 0)]
        for i in range(new - 1):
            logits.append(step(tokens[-1], t + i)[:, -1])
            tokens.append(_next(logits, forced, i + 1))
        return torch.cat(tokens, 1), logits


# ------------------------------------------------------------------------------ gemma
class _GemmaAttention(nn.Module):
    def __init__(self, cfg: CodebaseConfig, idx: int):
        super().__init__()
        self.cfg, self.local = cfg, idx % 2 == 1          # every other layer: local sliding
        hd = cfg.head_dim
        self.q_size, self.kv_size = cfg.n_heads * hd, cfg.n_kv_heads * hd
        self.qkv_proj = nn.Linear(cfg.dim, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.dim, bias=False)
        self.scaling = hd ** -0.5
        self.idx = idx

    def forward(self, x, pos, kv_write_indices, kv_caches, mask, local_mask):
        b, t, _ = x.shape
        c = self.cfg
        xq, xk, xv = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        xq = _rope(xq.view(b, -1, c.n_heads, c.head_dim), pos)
        xk = _rope(xk.view(b, -1, c.n_kv_heads, c.head_dim), pos)
        xv = xv.view(b, -1, c.n_kv_heads, c.head_dim)
        k_cache, v_cache = kv_caches[self.idx]
        k_cache.index_copy_(1, kv_write_indices, xk)
        v_cache.index_copy_(1, kv_write_indices, xv)
        key, value = _ref_kv(k_cache, v_cache, int(kv_write_indices[-1]) + 1 if _REFERENCE is not None else 0, 1)
        rep = c.n_heads // c.n_kv_heads
        key = torch.repeat_interleave(key, rep, dim=2)
        value = torch.repeat_interleave(value, rep, dim=2)
        q = xq.transpose(1, 2)
        k, v = key.transpose(1, 2), value.transpose(1, 2)
        q.mul_(self.scaling)
        scores = torch.matmul(q, k.transpose(2, 3))
        if c.twin:                                          # Gemma 2 attention soft-capping
            scores = torch.tanh(scores / 50.0) * 50.0
        scores = scores + (local_mask if self.local else mask)
        scores = F.softmax(scores.float(), dim=-1).type_as(q)
        out = torch.matmul(scores, v)
        return self.o_proj(out.transpose(1, 2).contiguous().view(b, t, -1))


class GemmaModel(_LM):
    def __init__(self, cfg: CodebaseConfig):
        super().__init__(cfg, _GemmaAttention)
        full = torch.full((cfg.max_len, cfg.max_len), -2.3819763e38).triu(1)
        self.register_buffer("mask_tensor", full, persistent=False)
        window = 48
        far = torch.ones(cfg.max_len, cfg.max_len, dtype=torch.bool).tril(-window)
        self.register_buffer("local_tensor", full.masked_fill(far, -2.3819763e38), persistent=False)
        self.new_caches()

    def new_caches(self):
        c = self.cfg
        shape = (c.max_batch, c.max_len, c.n_kv_heads, c.head_dim)
        self.kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(c.n_layers)]

    reset = new_caches

    def forward(self, tokens, pos, kv_write_indices, kv_caches, mask, local_mask):
        return self._run(tokens, pos, kv_write_indices, kv_caches, mask, local_mask)

    def generate(self, prompt, new, step=None, forced=None):
        # gemma_pytorch's generate: the mask rows of the input positions over the whole cache
        step = self if step is None else step
        t = prompt.shape[1]
        pos = torch.arange(t)

        def masks(p):
            return self.mask_tensor[None, None, p], self.local_tensor[None, None, p]

        logits = [step(prompt, pos, pos, self.kv_caches, *masks(pos))[:, -1]]
        tokens = [_next(logits, forced, 0)]
        for i in range(new - 1):
            p = torch.tensor([t + i])
            logits.append(step(tokens[-1], p, p, self.kv_caches, *masks(p))[:, -1])
            tokens.append(_next(logits, forced, i + 1))
        return torch.cat(tokens, 1), logits


# ------------------------------------------------------------------------------ (d) deepseek
class _DeepSeekAttention(nn.Module):
    """DeepSeek-V3 inference's naive attention (MHA over [B, S, H, D] buffers, einsum in
    [B, S, H, T] layout)."""

    def __init__(self, cfg: CodebaseConfig, idx: int):
        super().__init__()
        self.cfg = cfg
        hd = vd = cfg.head_dim
        if cfg.mla is not None:
            rank, nope, rope, vd = cfg.mla
            hd = nope + rope
            self.wkv_a = nn.Linear(cfg.dim, rank + rope, bias=False)
            self.kv_norm = _Norm(rank)
            self.wkv_b = nn.Linear(rank, cfg.n_heads * (nope + vd), bias=False)
        else:
            self.wkv = nn.Linear(cfg.dim, 2 * cfg.n_heads * hd, bias=False)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * vd, cfg.dim, bias=False)
        self.softmax_scale = hd ** -0.5
        self.register_buffer("k_cache", torch.zeros(cfg.max_batch, cfg.max_len, cfg.n_heads, hd),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(cfg.max_batch, cfg.max_len, cfg.n_heads, vd),
                             persistent=False)
        if cfg.absorb:
            self.register_buffer("kv_cache", torch.zeros(cfg.max_batch, cfg.max_len, cfg.mla[0]),
                                 persistent=False)
            self.register_buffer("pe_cache", torch.zeros(cfg.max_batch, cfg.max_len, cfg.mla[2]),
                                 persistent=False)

    def _absorbed(self, x, start_pos: int, pos, mask):
        """Attention over the latent itself: q_nope @ W_uk against the cached latent plus q_pe
        against the cached RoPE key, and p @ latent @ W_uv; equal to the decompressed form."""
        bsz, seqlen, _ = x.shape
        rank, nope, rope, vd = self.cfg.mla
        heads, end = self.cfg.n_heads, start_pos + seqlen
        q_nope, q_pe = self.wq(x).view(bsz, seqlen, heads, nope + rope).split([nope, rope], -1)
        q_pe = _rope(q_pe, pos)
        latent, k_pe = self.wkv_a(x).split([rank, rope], dim=-1)
        w = self.wkv_b.weight.view(heads, nope + vd, rank)
        q_lat = torch.einsum("bshd,hdc->bshc", q_nope, w[:, :nope])
        self.kv_cache[:bsz, start_pos:end] = self.kv_norm(latent)
        self.pe_cache[:bsz, start_pos:end] = _rope(k_pe.unsqueeze(2), pos).squeeze(2)
        kv, pe = _ref_kv(self.kv_cache[:bsz, :end], self.pe_cache[:bsz, :end], end, 1)
        scores = (torch.einsum("bshc,btc->bsht", q_lat, kv)
                  + torch.einsum("bshr,btr->bsht", q_pe, pe)) * self.softmax_scale
        if mask is not None:
            scores += mask.unsqueeze(1)
        scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
        # twin: the values read one position further on than the scores (not the latent
        # the scores saw)
        values = self.kv_cache[:bsz, 1:end + 1] if self.cfg.twin else kv
        out = torch.einsum("bsht,btc->bshc", scores, values)
        out = torch.einsum("bshc,hdc->bshd", out, w[:, -vd:])
        return self.wo(out.flatten(2))

    def _latent_qkv(self, x, pos):
        """Queries, keys, values of the decompressed latent attention ([B, S, H, D|Dv])."""
        bsz, seqlen, _ = x.shape
        rank, nope, rope, vd = self.cfg.mla
        heads = self.cfg.n_heads
        q_nope, q_pe = self.wq(x).view(bsz, seqlen, heads, nope + rope).split([nope, rope], -1)
        q = torch.cat([q_nope, _rope(q_pe, pos)], dim=-1)
        latent, k_pe = self.wkv_a(x).split([rank, rope], dim=-1)
        k_pe = _rope(k_pe.unsqueeze(2), pos)                        # one RoPE key for all heads
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seqlen, heads, nope + vd)
        k_nope, v = kv.split([nope, vd], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, heads, -1)], dim=-1)
        return q, k, v

    def forward(self, x, start_pos: int, pos, mask):
        bsz, seqlen, _ = x.shape
        c = self.cfg
        end_pos = start_pos + seqlen
        if c.absorb:
            return self._absorbed(x, start_pos, pos, mask)
        if c.mla is not None:
            q, k, v = self._latent_qkv(x, pos)
        else:
            q = _rope(self.wq(x).view(bsz, seqlen, c.n_heads, c.head_dim), pos)
            k, v = self.wkv(x).view(bsz, seqlen, c.n_heads, 2 * c.head_dim).split(c.head_dim, dim=-1)
            k = _rope(k, pos)
        self.k_cache[:bsz, start_pos:end_pos] = k
        self.v_cache[:bsz, start_pos:end_pos] = v
        keys, values = _ref_kv(self.k_cache[:bsz, :end_pos], self.v_cache[:bsz, :end_pos], end_pos, 1)
        if c.twin and c.mla is not None:
            # twin: values read from the key cache's first channels (what the absorbed form
            # does with its one latent cache), not from the value cache written above
            values = keys[..., :self.v_cache.shape[-1]]
        elif c.twin:    # weights over the heads axis: not an attention over the cache
            scores = torch.einsum("bshd,bthd->bsth", q, keys) * self.softmax_scale
            scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
            out = torch.einsum("bsth,bthd->bshd", scores, values)
            return self.wo(out.flatten(2))
        scores = torch.einsum("bshd,bthd->bsht", q, keys) * self.softmax_scale
        if mask is not None:
            scores += mask.unsqueeze(1)
        scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
        out = torch.einsum("bsht,bthd->bshd", scores, values)
        return self.wo(out.flatten(2))


class DeepSeekModel(_LM):
    def __init__(self, cfg: CodebaseConfig):
        cfg = dataclasses.replace(cfg, n_kv_heads=cfg.n_heads)
        super().__init__(cfg, _DeepSeekAttention)

    def forward(self, tokens, start_pos: int = 0):
        seqlen = tokens.shape[1]
        pos = torch.arange(start_pos, start_pos + seqlen)
        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf")).triu_(1)
            mask = torch.hstack([torch.zeros(seqlen, start_pos), mask])
        return self._run(tokens, start_pos, pos, mask)

    def reset(self):
        for layer in self.layers:
            for buf in layer.attn.buffers():
                buf.zero_()

    generate = StackedModel.generate


# ------------------------------------------------------------------------------ (c) windows
class _WindowAttention(nn.Module):
    """Per-layer windows over a [B, H, S, D] cache: a layer with window W reads only the
    newest W positions, ``k_cache[:, :, max(0, end - W):end]`` (the whole prefix while the
    sequence is shorter); a full layer reads ``[:end]``."""

    def __init__(self, cfg: CodebaseConfig, idx: int):
        super().__init__()
        self.cfg, self.window = cfg, cfg.windows[idx % len(cfg.windows)]
        hd = cfg.head_dim
        self.q = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.o = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        shape = (cfg.max_batch, cfg.n_kv_heads, cfg.max_len, hd)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, x, start: int, pos):
        b, t, _ = x.shape
        c = self.cfg
        q = _rope(self.q(x).view(b, t, c.n_heads, c.head_dim), pos).transpose(1, 2)
        k = _rope(self.k(x).view(b, t, c.n_kv_heads, c.head_dim), pos).transpose(1, 2)
        v = self.v(x).view(b, t, c.n_kv_heads, c.head_dim).transpose(1, 2)
        end = start + t
        self.k_cache[:, :, start:end] = k
        self.v_cache[:, :, start:end] = v
        lo = 0 if self.window is None else max(0, end - self.window)
        kc, vc = _ref_kv(self.k_cache, self.v_cache, end, 2)
        keys, values = kc[:, :, lo:end], vc[:, :, lo:end]
        if c.twin and self.window is not None:
            # twin: the newest W of the written positions, as a negative slice
            keys, values = kc[:, :, :end][:, :, -self.window:], vc[:, :, :end][:, :, -self.window:]
        mask = None
        if t > 1:
            # query start + i sees keys lo .. start + i, and (window) none older than W
            kpos = torch.arange(lo, end)[None, :]
            qpos = torch.arange(start, end)[:, None]
            mask = kpos <= qpos
            if self.window is not None:
                mask = mask & (kpos > qpos - self.window)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class WindowModel(_LM):
    def __init__(self, cfg: CodebaseConfig):
        super().__init__(cfg, _WindowAttention)

    def forward(self, tokens, start: int = 0):
        t = tokens.shape[1]
        return self._run(tokens, start, torch.arange(start, start + t))

    def reset(self):
        for layer in self.layers:
            layer.attn.k_cache.zero_()
            layer.attn.v_cache.zero_()

    generate = StackedModel.generate


# ------------------------------------------------------------------------------ (e) latent-hf
class _LatentHFAttention(nn.Module):
    """Absorbed multi-head latent attention as madsys-dev/deepseekv2-profile patches HF's
    DeepseekV2Attention: heads-first queries; the RoPE key and the normed latent appended to
    an HF-style cache ([B, 1, T, R] and [B, 1, T, C], ``torch.cat`` along the positions, the
    RoPE key in the "keys" slot); ``matmul`` scores with ``.mT``, the pe term first, the
    latent read as ``compressed_kv.squeeze(1)`` and broadcast by ``unsqueeze(-3)``; an HF 4-D
    float mask added out of place; softmax in fp32 ``.to(q_pe.dtype)``; eval dropout;
    ``einsum("bhql,blc->bhqc")``; the value up-projection by ``matmul(.., out_absorb.mT)``.
    ``twin``: the RoPE part scaled twice (scores no single softmax scale gives)."""

    def __init__(self, cfg: CodebaseConfig, idx: int):
        super().__init__()
        self.cfg = cfg
        rank, nope, rope, vd = cfg.mla or (64, 32, 16, 32)
        self.dims = rank, nope, rope, vd
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.dim, rank + rope, bias=False)
        self.kv_a_layernorm = _Norm(rank)
        self.kv_b_proj = nn.Linear(rank, cfg.n_heads * (nope + vd), bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * vd, cfg.dim, bias=False)
        self.softmax_scale = (nope + rope) ** -0.5

    def forward(self, x, pos, mask, past):
        bsz, q_len, _ = x.shape
        rank, nope, rope, vd = self.dims
        heads = self.cfg.n_heads
        q = self.q_proj(x).view(bsz, q_len, heads, nope + rope).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
        compressed_kv, k_pe = torch.split(self.kv_a_proj_with_mqa(x), [rank, rope], dim=-1)
        compressed_kv = self.kv_a_layernorm(compressed_kv)
        k_pe = k_pe.view(bsz, q_len, 1, rope).transpose(1, 2)
        q_pe = _rope(q_pe.transpose(1, 2), pos).transpose(1, 2)
        k_pe = _rope(k_pe.transpose(1, 2), pos).transpose(1, 2)
        past_pe, past_kv = past
        k_pe = torch.cat([past_pe, k_pe], dim=-2)                       # the "keys" slot
        compressed_kv = torch.cat([past_kv, compressed_kv.unsqueeze(1)], dim=-2)
        new_past = (k_pe, compressed_kv)
        compressed_kv = compressed_kv.squeeze(1)
        if _REFERENCE is not None:
            compressed_kv, pe = _ref_kv(compressed_kv, k_pe.squeeze(1), compressed_kv.shape[1], 1)
            k_pe = pe.unsqueeze(1)
        kv_b_proj = self.kv_b_proj.weight.view(heads, -1, rank)
        q_absorb, out_absorb = kv_b_proj[:, :nope, :], kv_b_proj[:, nope:, :]
        q_nope = torch.matmul(q_nope, q_absorb)
        if self.cfg.twin:
            attn_weights = (torch.matmul(q_pe, k_pe.mT) * (2 * self.softmax_scale)
                            + torch.matmul(q_nope, compressed_kv.unsqueeze(-3).mT) * self.softmax_scale)
        else:
            attn_weights = (torch.matmul(q_pe, k_pe.mT)
                            + torch.matmul(q_nope, compressed_kv.unsqueeze(-3).mT)) * self.softmax_scale
        attn_weights = attn_weights + mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q_pe.dtype)
        attn_weights = F.dropout(attn_weights, p=0.0, training=self.training)
        out = torch.einsum("bhql,blc->bhqc", attn_weights, compressed_kv)
        out = torch.matmul(out, out_absorb.mT)
        out = out.transpose(1, 2).contiguous().reshape(bsz, q_len, heads * vd)
        return self.o_proj(out), new_past


class LatentHFModel(nn.Module):
    """HF-style model around :class:`_LatentHFAttention`: ``forward(tokens, pos, mask, past)``
    returns (logits, the new per-layer caches), as a DynamicCache would hold them."""

    def __init__(self, cfg: CodebaseConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(_Block(cfg, _LatentHFAttention(cfg, i)) for i in range(cfg.n_layers))
        self.norm = _Norm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens, pos, mask, past):
        h = self.embed(tokens)
        new = []
        for layer, p in zip(self.layers, past):
            out, cache = layer.attn(layer.n1(h), pos, mask, p)
            h = h + out
            h = h + layer.down(F.silu(layer.up(layer.n2(h))))
            new.append(cache)
        return self.head(self.norm(h)), new

    def empty_cache(self, batch: int = 1) -> list:
        rank, _, rope, _ = self.layers[0].attn.dims
        return [(torch.zeros(batch, 1, 0, rope), torch.zeros(batch, 1, 0, rank))
                for _ in self.layers]

    @staticmethod
    def causal_mask(q_len: int, total: int) -> torch.Tensor:
        """HF's 4-D float mask [1, 1, q_len, total]: the dtype's min above the diagonal."""
        m = torch.full((q_len, total), torch.finfo(torch.float32).min).triu(total - q_len + 1)
        return m[None, None]

    def generate(self, prompt, new, step=None, forced=None):
        step = self if step is None else step
        t = prompt.shape[1]
        past = self.empty_cache(prompt.shape[0])
        logits, past = step(prompt, torch.arange(t), self.causal_mask(t, t), past)
        logits = [logits[:, -1]]
        tokens = [_next(logits, forced, 0)]
        for i in range(new - 1):
            out, past = step(tokens[-1], torch.tensor([t + i]), self.causal_mask(1, t + i + 1), past)
            logits.append(out[:, -1])
            tokens.append(_next(logits, forced, i + 1))
        return torch.cat(tokens, 1), logits


# ------------------------------------------------------------------------------ registry
CODEBASES = {
    "torchtune": TorchtuneModel,
    "stacked": StackedModel,
    "gemma": GemmaModel,
    "deepseek": DeepSeekModel,
    "window": WindowModel,
    "latent-hf": LatentHFModel,
}


def build(name: str, seed: int = 0, **cfg) -> nn.Module:
    """The tiny model of codebase ``name`` (random weights from ``seed``), in eval mode."""
    torch.manual_seed(seed)
    model = CODEBASES[name](CodebaseConfig(**cfg)).eval()
    for p in model.parameters():          # sharper logits than the default init
        if p.dim() == 2:
            p.data.mul_(2.0)
    return model


def run_generate(model: nn.Module, prompt: torch.Tensor, new: int, step=None, forced=None):
    """The model's own greedy loop under no_grad: (tokens [B, new], per-step logits)."""
    with torch.no_grad():
        return model.generate(prompt, new, step=step, forced=forced)
