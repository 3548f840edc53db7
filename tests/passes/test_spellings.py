"""Spellings of KV caches and attention from public model code, each with a must-not-match twin.

Every subject is a small module written the way a public codebase writes its attention
(named in its docstring). A subject is compiled with ``kvarn_backend`` over a prefill that
freezes a quantized tile and two decode steps, and must be rewritten with every step equal
to the eager KVarN ops on the true K/V and within the preset's quantization bound of
full-precision attention (``kvarn_compile.testing.check_numerics``); the rewritten decode graph
is a golden string (``EXPECTTEST_ACCEPT=1 python -m pytest tests/passes/test_spellings.py``
updates it).
Its twin changes one thing that changes the meaning (or leaves the pass no proof of it):
it must be left exactly as Dynamo produced it, reported with the reason, and compute what
plain eager computes.

    subject             spelling                                                 twin (refused)
    LlamaReference      [B, S, H, D] cache, cache_k[:bsz, a:b] = xk, keys =       every second position
                        cache_k[:bsz, :start + T], repeat_kv on [B, S, H, D],
                        transpose(1, 2), matmul / sqrt(d), 2-D additive mask,
                        softmax(scores.float()).type_as(xq), self.cache_k.to(xq)
    LitGPT              k = self.k[:bs, ...].index_copy_(-2, pos, k) (return     no mask
                        value of the in-place op on a batch slice), k[..., :maxp1,
                        :], repeat_interleave(n, dim=1), sdpa(mask[..., :maxp1])
    TorchChat           k_out = aten.index_put_(cache, [None, None, pos], k),     index_put_(accumulate=True)
                        unsqueeze(2).expand(...).flatten(1, 2) and
                        [:, :, None].expand(...).reshape(...) GQA, bool sdpa mask
    SeqMajorSdpa        [B, S, H, D]: k_cache[:, pos] = k, index_put_([None,      GQA by .repeat (tiled heads):
                        pos]), transpose(1, 2) -> sdpa(enable_gqa=True)           the reason names .repeat()
    EinsumMaskedFill    einsum("bhqd,bhkd->bhqk"), masked_fill(mask == 0, -inf),  a fill value computed at
                        F.softmax(s, -1), repeat_interleave(repeats=n) and a      run time
                        0-d tensor count, einsum("bhqk,bhkd->bhqd")
    WhereMT (bf16)      0.25 * (q @ k.mT), torch.where(mask, s, -inf),            scores cast down to fp16
                        torch.softmax(s.float(), dim=-1).type_as(q)
    CatSeqMajor         torch.cat([past, k], dim=1) on [B, S, H, D], transpose,   reads the newest 4 positions
                        mask-free sdpa(enable_gqa=True)
    ShiftedValueDim     MiMo-V2-Flash eager: values of another head dim (DV),     the max taken over the
                        repeat_kv, (q @ kᵀ) * scale + mask, w - w.max(dim=-1,     queries axis (dim=-2)
                        keepdim=True).values, softmax(dtype=w.dtype), @ v
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

from kvarn_compile.testing import check_numerics, record_graphs
from kvarn_compile import kvarn_backend
from kvarn_compile.ops.buffers import is_freed

pytestmark = pytest.mark.usefixtures("one_thread")

B_MAX, B, H, HQ, D = 2, 1, 2, 4, 16
DV = 32                 # ShiftedValueDim's values: another head dim than the keys' D
G = 32
CAP = 80
PREFILL = 66            # sink 0..31, tile 32..63 frozen (quantized) by the prefill, tail 64..
STEPS = (PREFILL, 1, 1)


def _backend(**kw):
    torch._dynamo.reset()
    return record_graphs(kvarn_backend("k4v2", group_size=G, key_bits=8, value_bits=8, compiler="eager",
                                       **kw))


def _qkv(t, seed, *, seq_major=False, dtype=torch.float32, dv=D):
    """q [B, HQ, t, D], k [B, H, t, D], v [B, H, t, dv] (seq_major: [B, t, heads, D])."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, t, D, generator=g)
    k = torch.randn(B, H, t, D, generator=g) * (1 + torch.arange(D) / 8)   # uneven channels
    v = torch.randn(B, H, t, dv, generator=g)
    if seq_major:
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _causal(p0, t, length):
    return (torch.arange(length)[None, :] <= torch.arange(p0, p0 + t)[:, None])[None, None]


# ----------------------------------------------------------------------------- subjects
class LlamaReference(nn.Module):
    """llama's reference Attention: plain-attribute caches [max_batch, max_seq, kv_heads,
    head_dim], written and read through a batch slice, keys read up to start_pos + seqlen;
    ``step=2`` (the twin) reads every second position instead (a window from position 1,
    ``cache_k[:bsz, 1:start_pos + seqlen]``, is rewritten: see test_codebases)."""

    def __init__(self, step: int = 1):
        super().__init__()
        self.cache_k = torch.zeros(B_MAX, CAP, H, D)
        self.cache_v = torch.zeros(B_MAX, CAP, H, D)
        self.step = step

    def forward(self, xq, xk, xv, start_pos: int, mask):
        bsz, seqlen, _, _ = xq.shape
        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)
        self.cache_k[:bsz, start_pos:start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos:start_pos + seqlen] = xv
        keys = self.cache_k[:bsz, :start_pos + seqlen:self.step]
        values = self.cache_v[:bsz, :start_pos + seqlen:self.step]
        bs, slen, n_kv, hd = keys.shape
        keys = keys[:, :, :, None, :].expand(bs, slen, n_kv, HQ // H, hd).reshape(bs, slen, HQ, hd)
        values = values[:, :, :, None, :].expand(bs, slen, n_kv, HQ // H, hd).reshape(bs, slen, HQ, hd)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(D)
        if mask is not None:
            scores = scores + mask[:, ::self.step]
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        return torch.matmul(scores, values).transpose(1, 2)


class LitGPT(nn.Module):
    """litgpt KVCache + CausalSelfAttention: buffers [max_batch, kv_heads, max_seq, head_dim];
    ``index_copy_`` on a batch slice, its return value read up to input_pos_maxp1;
    ``masked=False`` (the twin) drops the mask."""

    def __init__(self, masked: bool = True):
        super().__init__()
        self.register_buffer("k", torch.zeros(B_MAX, H, CAP, D), persistent=False)
        self.register_buffer("v", torch.zeros(B_MAX, H, CAP, D), persistent=False)
        self.masked = masked

    def forward(self, q, k, v, input_pos, input_pos_maxp1: int, mask):
        bs = k.size(0)
        k = self.k[:bs, ...].index_copy_(-2, input_pos, k)
        v = self.v[:bs, ...].index_copy_(-2, input_pos, v)
        k = k[..., :input_pos_maxp1, :]
        v = v[..., :input_pos_maxp1, :]
        k = k.repeat_interleave(HQ // H, dim=1)
        v = v.repeat_interleave(HQ // H, dim=1)
        mask = mask[..., :input_pos_maxp1] if self.masked else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=0.25,
                                           is_causal=False)
        return y.transpose(1, 2)


class TorchChat(nn.Module):
    """torchchat / ExecuTorch KVCache: ``k_out = aten.index_put_(k_cache, [None, None,
    input_pos], k_val)``, GQA spelled with views; ``accumulate=True`` for the twin."""

    def __init__(self, accumulate: bool = False):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(B, H, CAP, D))
        self.register_buffer("v_cache", torch.zeros(B, H, CAP, D))
        self.accumulate = accumulate

    def forward(self, q, k, v, input_pos, mask):
        k_out = torch.ops.aten.index_put_(self.k_cache, [None, None, input_pos], k, self.accumulate)
        v_out = torch.ops.aten.index_put_(self.v_cache, [None, None, input_pos], v, self.accumulate)
        b, h, s, d = k_out.shape
        keys = k_out.unsqueeze(2).expand(b, h, HQ // H, s, d).flatten(1, 2)
        values = v_out[:, :, None, :, :].expand(b, h, HQ // H, s, d).reshape(b, HQ, s, d)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class SeqMajorSdpa(nn.Module):
    """A [B, S, H, D] cache written on dim 1 (``k_cache[:, input_pos] = k``, ExecuTorch's
    ``index_put_(cache, [None, input_pos], v)``), transposed for sdpa; the twin expands the
    KV heads with ``.repeat`` (tiles: query head i reads KV head i % H, another model)."""

    def __init__(self, tiled: bool = False):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(B, CAP, H, D))
        self.register_buffer("v_cache", torch.zeros(B, CAP, H, D))
        self.tiled = tiled

    def forward(self, q, k, v, input_pos, mask):
        self.k_cache[:, input_pos] = k
        torch.ops.aten.index_put_(self.v_cache, [None, input_pos], v)
        keys, values = self.k_cache.transpose(1, 2), self.v_cache.transpose(1, 2)
        if self.tiled:
            keys, values = keys.repeat(1, HQ // H, 1, 1), values.repeat(1, HQ // H, 1, 1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                             enable_gqa=not self.tiled)
        return out.transpose(1, 2)


class EinsumMaskedFill(nn.Module):
    """einsum attention with a nanoGPT-style ``masked_fill(mask == 0, -inf)``; the twin fills
    with a value computed at run time."""

    def __init__(self, runtime_fill: bool = False):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(B, H, CAP, D))
        self.register_buffer("v_cache", torch.zeros(B, H, CAP, D))
        self.runtime_fill = runtime_fill

    def forward(self, q, k, v, input_pos, mask):
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        keys = self.k_cache.repeat_interleave(repeats=HQ // H, dim=1)
        values = torch.repeat_interleave(self.v_cache, torch.tensor(HQ // H), dim=1, output_size=HQ)
        s = torch.einsum("bhqd,bhkd->bhqk", q, keys) * (1.0 / math.sqrt(D))
        fill = q.new_tensor(-1e9) if self.runtime_fill else float("-inf")
        s = s.masked_fill(mask == 0, fill)
        return torch.einsum("bhqk,bhkd->bhqd", F.softmax(s, -1), values)


class WhereMT(nn.Module):
    """A bf16 model: ``0.25 * (q @ k.mT)``, ``torch.where(mask, s, -inf)``, softmax in fp32 and
    back with ``type_as``; the twin casts the scores down to fp16 before the softmax."""

    def __init__(self, fp16_scores: bool = False):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(B, H, CAP, D, dtype=torch.bfloat16))
        self.register_buffer("v_cache", torch.zeros(B, H, CAP, D, dtype=torch.bfloat16))
        self.fp16_scores = fp16_scores

    def forward(self, q, k, v, input_pos, mask):
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        b, h, s, d = self.k_cache.shape
        keys = self.k_cache[:, :, None, :, :].expand(b, h, HQ // H, s, d).reshape(b, HQ, s, d)
        values = self.v_cache[:, :, None, :, :].expand(b, h, HQ // H, s, d).reshape(b, HQ, s, d)
        scores = torch.where(mask, 0.25 * (q @ keys.mT), float("-inf"))
        scores = scores.half() if self.fp16_scores else scores.float()
        return torch.softmax(scores, dim=-1).type_as(q) @ values


class CatSeqMajor(nn.Module):
    """A dynamic [B, S, H, D] cache: ``torch.cat([past, k], dim=1)``, mask-free decode; the
    twin attends only the newest 4 positions (a window)."""

    def __init__(self, window: bool = False):
        super().__init__()
        self.window = window

    def forward(self, q, k, v, past_k, past_v):
        keys, values = torch.cat([past_k, k], dim=1), torch.cat([past_v, v], dim=1)
        kk, vv = keys.transpose(1, 2), values.transpose(1, 2)
        if self.window:
            kk, vv = kk[:, :, -4:], vv[:, :, -4:]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, enable_gqa=True)
        return out.transpose(1, 2), keys, values


class ShiftedValueDim(nn.Module):
    """MiMo-V2-Flash's eager attention: values of another head dim than the keys ([B, H, S,
    DV] cache), and the softmax's own shift written out, ``w - w.max(dim=-1, keepdim=True)
    .values``; the twin takes that max over the queries axis (which changes the softmax)."""

    def __init__(self, query_axis: bool = False):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(B, H, CAP, D))
        self.register_buffer("v_cache", torch.zeros(B, H, CAP, DV))
        self.dim = -2 if query_axis else -1

    def forward(self, q, k, v, input_pos, mask):
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        keys = self.k_cache.repeat_interleave(HQ // H, dim=1)
        values = self.v_cache.repeat_interleave(HQ // H, dim=1)
        w = torch.matmul(q, keys.transpose(2, 3)) * D ** -0.5 + mask
        w = w - w.max(dim=self.dim, keepdim=True).values
        return torch.matmul(F.softmax(w, dim=-1, dtype=w.dtype), values)


# ----------------------------------------------------------------------------- steps
def _steps(kind):
    """Per step: (model args builder, oracle q [B, HQ, T, D], k, v [B, H, T, D], oracle
    mask, oracle causal, scale). The model args builder takes the caches (cat) or nothing."""
    p0, out = 0, []
    dtype = torch.bfloat16 if kind == "WhereMT" else torch.float32
    for step, t in enumerate(STEPS):
        seq_major = kind in ("LlamaReference", "SeqMajorSdpa", "CatSeqMajor")
        q, k, v = _qkv(t, step, seq_major=seq_major, dtype=dtype,
                       dv=DV if kind == "ShiftedValueDim" else D)
        qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v)) if seq_major else (q, k, v)
        pos = torch.arange(p0, p0 + t)
        full = _causal(p0, t, CAP)
        if kind == "LlamaReference":
            mask = None
            if t > 1:
                mask = torch.full((t, t), float("-inf")).triu(1)
                mask = torch.hstack([torch.zeros(t, p0), mask])
            out.append(((q, k, v, p0, mask), qs, ks, vs, mask, False, D ** -0.5))
        elif kind == "LitGPT":
            out.append(((q, k, v, pos, p0 + t, full), qs, ks, vs, full, True, 0.25))
        elif kind in ("TorchChat", "SeqMajorSdpa", "WhereMT"):
            out.append(((q, k, v, pos, full), qs, ks, vs, full, True, D ** -0.5
                        if kind != "WhereMT" else 0.25))
        elif kind == "ShiftedValueDim":
            additive = torch.zeros(full.shape).masked_fill(~full, float("-inf"))
            out.append(((q, k, v, pos, additive), qs, ks, vs, additive, True, D ** -0.5))
        elif kind == "EinsumMaskedFill":
            out.append(((q, k, v, pos, full.int()), qs, ks, vs, full, True, D ** -0.5))
        else:
            out.append(((q, k, v), qs, ks, vs, None, False, D ** -0.5))
        p0 += t
    return out


SUBJECTS = {"LlamaReference": LlamaReference, "LitGPT": LitGPT, "TorchChat": TorchChat,
            "SeqMajorSdpa": SeqMajorSdpa, "EinsumMaskedFill": EinsumMaskedFill,
            "WhereMT": WhereMT, "CatSeqMajor": CatSeqMajor, "ShiftedValueDim": ShiftedValueDim}
TWINS = {"LlamaReference": dict(step=2), "LitGPT": dict(masked=False),
         "TorchChat": dict(accumulate=True), "SeqMajorSdpa": dict(tiled=True),
         "EinsumMaskedFill": dict(runtime_fill=True), "WhereMT": dict(fp16_scores=True),
         "CatSeqMajor": dict(window=True), "ShiftedValueDim": dict(query_axis=True)}


def _call(module, compiled, args, caches):
    if caches is None:
        return compiled(*args)
    out, keys, values = compiled(*args, *caches)
    caches[:] = [keys, values]
    return out


def _run(kind, **twin):
    """(backend, per-step (compiled output, plain eager output, oracle inputs), module)."""
    be = _backend(max_cache_len=CAP)
    module, plain = SUBJECTS[kind](**twin), SUBJECTS[kind](**twin)
    compiled = torch.compile(module, backend=be)
    cat = kind == "CatSeqMajor"
    caches = [torch.zeros(B, 0, H, D)] * 2 if cat else None
    plain_caches = [torch.zeros(B, 0, H, D)] * 2 if cat else None
    results = []
    for args, *oracle in _steps(kind):
        got = _call(module, compiled, args, caches)
        want = _call(plain, plain, args, plain_caches)
        results.append((got, want, oracle))
    return be, results, module


def _std(out, kind):
    """The attention output as [B, HQ, T, D]."""
    return out.transpose(1, 2) if kind in ("LlamaReference", "LitGPT", "SeqMajorSdpa", "CatSeqMajor") else out


class TestSpellings(TestCase):
    maxDiff = None

    def _check_rewritten(self, kind):
        be, results, module = _run(kind)
        self.assertTrue(be.report.sites and not be.report.unchanged, str(be.report))
        history = []
        for got, _, (q, k, v, mask, causal, scale) in results:
            history.append((k, v))
            check_numerics(be.config, _std(got, kind), history, q, mask, scale, causal=causal,
                           cap=CAP)
        buffers = [t for t in vars(module).values() if isinstance(t, torch.Tensor)]
        buffers += [b for _, b in module.named_buffers()]
        self.assertTrue(all(is_freed(b) for b in buffers), "model-owned buffers not released")
        return be.graph_log[-1][1]

    def test_llama_reference(self):
        self.assertExpectedInline(self._check_rewritten("LlamaReference"), """\
# 6 inputs + 17 kvarn state buffers
v0 = full((1,), in3, dtype=int64, device='cpu')
v1 = .transpose(in4, 1, 2)
v2 = .transpose(in5, 1, 2)
v3 = operator.getitem(in1, (:1, :, :, :))
v4 = .transpose(v3, 1, 2)
v5 = operator.getitem(in2, (:1, :, :, :))
v6 = .transpose(v5, 1, 2)
v7 = kvarn.append_from_([<17 state buffers>], v1, v2, v0, 'kvarn', 8, 0, 0, False, 'forward', v4, v6, True)
v8 = .transpose(in0, 1, 2)
v9 = kvarn.attention(v8, [<17 state buffers>], None, 0.25, False, 0)
v10 = .transpose(v9, 1, 2)
return (v10, in2, in1)""")

    def test_litgpt(self):
        self.assertExpectedInline(self._check_rewritten("LitGPT"), """\
# 8 inputs + 17 kvarn state buffers
v0 = kvarn.positions_start(in2, 1)
v1 = operator.getitem(in1, (:1, :, :, :))
v2 = operator.getitem(in3, (:1, :, :, :))
v3 = kvarn.append_from_([<17 state buffers>], in0, in4, v0, 'kvarn', 8, 0, 0, False, 'forward', v1, v2, True)
v4 = operator.getitem(in6, (Ellipsis, :in5))
v5 = kvarn.attention(in7, [<17 state buffers>], v4, 0.25, True, 0)
v6 = .transpose(v5, 1, 2)
return (v6,)""")

    def test_torchchat(self):
        self.assertExpectedInline(self._check_rewritten("TorchChat"), """\
# 7 inputs + 17 kvarn state buffers
v0 = kvarn.positions_start(in2, 1)
v1 = kvarn.append_from_([<17 state buffers>], in1, in4, v0, 'kvarn', 8, 0, 0, False, 'forward', in0, in3, True)
v2 = kvarn.attention(in5, [<17 state buffers>], in6, 0.25, True, 0)
return (v2,)""")

    def test_seq_major_sdpa(self):
        self.assertExpectedInline(self._check_rewritten("SeqMajorSdpa"), """\
# 7 inputs + 17 kvarn state buffers
v0 = kvarn.positions_start(in2, 1)
v1 = .transpose(in1, 1, 2)
v2 = .transpose(in4, 1, 2)
v3 = .transpose(in0, 1, 2)
v4 = .transpose(in3, 1, 2)
v5 = kvarn.append_from_([<17 state buffers>], v1, v2, v0, 'kvarn', 8, 0, 0, False, 'forward', v3, v4, True)
v6 = .transpose(in5, 1, 2)
v7 = kvarn.attention(v6, [<17 state buffers>], in6, 0.25, True, 0)
v8 = .transpose(v7, 1, 2)
return (v8,)""")

    def test_einsum_masked_fill(self):
        self.assertExpectedInline(self._check_rewritten("EinsumMaskedFill"), """\
# 7 inputs + 17 kvarn state buffers
v0 = kvarn.positions_start(in2, 1)
v1 = kvarn.append_from_([<17 state buffers>], in1, in4, v0, 'kvarn', 8, 0, 0, False, 'forward', in0, in3, True)
v2 = operator.eq(in6, 0)
v3 = operator.invert(v2)
v4 = kvarn.attention(in5, [<17 state buffers>], v3, 0.25, True, 0)
return (v4,)""")

    def test_where_mt_bf16(self):
        self.assertExpectedInline(self._check_rewritten("WhereMT"), """\
# 7 inputs + 17 kvarn state buffers
v0 = kvarn.positions_start(in1, 1)
v1 = kvarn.append_from_([<17 state buffers>], in2, in4, v0, 'kvarn', 8, 0, 0, False, 'forward', in0, in3, True)
v2 = kvarn.attention(in5, [<17 state buffers>], in6, 0.25, True, 0)
return (v2,)""")

    def test_shifted_value_dim(self):
        self.assertExpectedInline(self._check_rewritten("ShiftedValueDim"), """\
# 7 inputs + 17 kvarn state buffers
v0 = kvarn.positions_start(in1, 1)
v1 = kvarn.append_from_([<17 state buffers>], in2, in4, v0, 'kvarn', 8, 0, 0, False, 'forward', in0, in3, True)
v2 = kvarn.attention(in5, [<17 state buffers>], in6, 0.25, True, 0)
return (v2,)""")

    def test_cat_seq_major(self):
        self.assertExpectedInline(self._check_rewritten("CatSeqMajor"), """\
# 7 inputs + 17 kvarn state buffers
v0 = .numel(in1)
v1 = operator.floordiv(v0, 32)
v2 = full((1,), v1, dtype=int64, device='cpu')
v3 = .transpose(in2, 1, 2)
v4 = .transpose(in5, 1, 2)
v5 = kvarn.append_([<17 state buffers>], v3, v4, v2, 'kvarn', 8, 0, 0, False, 'forward')
v6 = arange(1, dtype=float32, device='cpu')
v7 = .view(v6, 1, 1, 1, 1)
v8 = .numel(in1)
v9 = operator.floordiv(v8, 32)
v10 = .size(in2, 1)
v11 = operator.add(v9, v10)
v12 = .expand(v7, 1, v11, 2, 16)
v13 = arange(1, dtype=float32, device='cpu')
v14 = .view(v13, 1, 1, 1, 1)
v15 = .numel(in4)
v16 = operator.floordiv(v15, 32)
v17 = .size(in5, 1)
v18 = operator.add(v16, v17)
v19 = .expand(v14, 1, v18, 2, 16)
v20 = .transpose(in6, 1, 2)
v21 = kvarn.attention(v20, [<17 state buffers>], None, 0.25, False, 0)
v22 = .transpose(v21, 1, 2)
return (v22, v12, v19)""")


TWIN_REASONS = {
    "LlamaReference": r"its keys come from the KV cache written by x\[\.\.\.\] = \.\.\. "
                      r"\(test_spellings\.py:\d+\), but reach the attention through x\[\.\.\.\] "
                      r"\(test_spellings\.py:\d+\), which reads the entries :\w+:2 of an axis \(a step "
                      r"of 2\), not a run of positions",
    "LitGPT": r"reads positions \[0, \w+\) of the cache without a mask",
    "TorchChat": r"its key cache is written by index_put_ \(test_spellings\.py:\d+\), which the pass "
                 r"does not recognize as a KV-cache update",
    "SeqMajorSdpa": r"its keys come from the KV cache written by x\[\.\.\.\] = \.\.\. "
                    r"\(test_spellings\.py:\d+\), but reach the attention through \.repeat\(\) "
                    r"\(test_spellings\.py:\d+\), which is not a view the pass follows",
    "EinsumMaskedFill": r"not recognized: softmax over a q·kᵀ product \(einsum -> mul -> masked_fill -> "
                        r"softmax\): the masked_fill value \(\.masked_fill\(\) \(test_spellings\.py:\d+\)\) "
                        r"is computed at run time, not a constant; ",
    "WhereMT": r"not recognized: softmax over a q·kᵀ product \(matmul -> mul -> where -> half -> softmax\): "
               r"the scores are cast down to torch\.float16 \(\.half\(\) \(test_spellings\.py:\d+\)\) "
               r"before the softmax; ",
    "CatSeqMajor": r"reach the attention through x\[\.\.\.\] \(test_spellings\.py:\d+\), which reads "
                   r"the newest positions \(-4:\) of an axis, not a prefix",
    "ShiftedValueDim": r"not recognized: softmax over a q·kᵀ product \(matmul -> mul -> add -> sub -> "
                       r"softmax\): sub \(test_spellings\.py:\d+\) subtracts from the scores something "
                       r"other than their own max over the keys",
}


@pytest.mark.parametrize("kind", list(TWINS))
def test_twin_left_unchanged(kind):
    be, results, _ = _run(kind, **TWINS[kind])
    for before, after in be.graph_log:
        assert before == after
    assert be.report.sites and not be.report.rewritten and not be.states, str(be.report)
    for site in be.report.sites:
        assert site.reason and re.search(TWIN_REASONS[kind], site.reason), site.reason
    for got, want, _ in results:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
