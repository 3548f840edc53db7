"""Attention whose weights are also returned (``output_attentions``, eager attention).

transformers' ``eager_attention_forward`` returns ``(attn_output, attn_weights)``: the softmax
output is read twice, by the ·v product and by the caller. The pass rewrites such a site like
any other (the cache is packed, the output is ``kvarn::attention``) and gives the other
readers ``kvarn::attention_weights``: the weights the attention applies, from the packed
cache. Checked here over a prefill that freezes a tile and two decode steps: the rewritten
decode graph is a golden string, the weights applied to the packed cache's dequantized
values give the output, and both stay within the preset's bound of full precision. Its twin
reads the weights before the output is computed and is left unchanged, with that reason; so
is the site under the Inductor pre-grad pass, which has no keyed form of the op.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

from kvarn_compile import kvarn_backend
from kvarn_compile.ops.append import materialize
from kvarn_compile.testing import record_graphs

pytestmark = pytest.mark.usefixtures("one_thread")

B, H, HQ, D, CAP = 1, 2, 4, 16, 80
STEPS = (66, 1, 1)              # sink 0..31, tile 32..63 frozen by the prefill, then decode


class EagerWeights(nn.Module):
    """transformers' eager attention over a preallocated cache: ``cache[:, :, pos] = k``
    (index_copy_), repeat_kv, ``matmul * scale + mask``, softmax in fp32 cast back, dropout
    (eval), ``matmul(w, v)``; returns the output and the weights. ``early``: the twin, which
    reads the weights (their largest value) before the output is computed."""

    def __init__(self, early: bool = False):
        super().__init__()
        self.early = early
        self.register_buffer("k_cache", torch.zeros(B, H, CAP, D))
        self.register_buffer("v_cache", torch.zeros(B, H, CAP, D))

    def forward(self, q, k, v, pos, mask):
        keys = self.k_cache.index_copy_(2, pos, k).repeat_interleave(HQ // H, 1)
        values = self.v_cache.index_copy_(2, pos, v).repeat_interleave(HQ // H, 1)
        w = torch.matmul(q, keys.transpose(2, 3)) * D ** -0.5 + mask
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        w = F.dropout(w, p=0.0, training=False)
        peak = w.amax() if self.early else None
        out = torch.matmul(w, values)
        return (out, w) if peak is None else (out, w, peak)


def _steps():
    p0 = 0
    for step, t in enumerate(STEPS):
        g = torch.Generator().manual_seed(step)
        q, k, v = (torch.randn(B, n, t, D, generator=g) for n in (HQ, H, H))
        pos = torch.arange(p0, p0 + t)
        mask = torch.full((t, CAP), float("-inf")).triu(p0 + 1)[None, None]
        yield q, k, v, pos, mask
        p0 += t


def _run(early=False):
    torch._dynamo.reset()
    be = record_graphs(kvarn_backend("k4v2", group_size=32, key_bits=8, value_bits=8,
                                     compiler="eager", max_cache_len=CAP))
    module, plain = EagerWeights(early), EagerWeights(early)
    compiled = torch.compile(module, backend=be)
    steps = [(compiled(*args), plain(*args)) for args in _steps()]
    return be, steps


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


class TestReturnedWeights(TestCase):
    maxDiff = None

    def test_returned_weights_come_from_the_packed_cache(self):
        be, steps = _run()
        assert be.report.sites and not be.report.unchanged, str(be.report)
        (state,) = be.all_states()
        assert state.n_tiles.tolist() == [1]
        _, v = materialize(state.buffers, dtype=torch.float32)
        for step, ((out, w), (out_fp, w_fp)) in enumerate(steps):
            assert w.shape == w_fp.shape and w.dtype == w_fp.dtype
            if step:    # the decode steps read the values as they are now (the tile froze at
                # the first one; the prefill held its newest tokens back): the weights the
                # attention applied times those values are its output
                torch.testing.assert_close(w @ v.repeat_interleave(HQ // H, 1), out, rtol=1e-4,
                                           atol=1e-5)
            errors = _rel(w, w_fp), _rel(out, out_fp)      # 8-bit codes: up to ~0.008 here
            assert max(errors) < 0.02, errors
        self.assertExpectedInline(be.graph_log[-1][1], """\
# 7 inputs + 17 kvarn state buffers
v0 = kvarn.positions_start(in1, 1)
v1 = kvarn.append_from_([<17 state buffers>], in2, in4, v0, 'kvarn', 8, 0, 0, False, 'forward', in0, in3, True)
v2 = kvarn.attention(in5, [<17 state buffers>], in6, 0.25, True, 0)
v3 = kvarn.attention_weights(in5, [<17 state buffers>], in6, 0.25, True, 0, 80)
return (v2, v3)""")

    def test_weights_read_before_the_output_leave_the_site_unchanged(self):
        be, steps = _run(early=True)
        assert be.report.unchanged and not any(r.rewritten for r in be.report.sites), str(be.report)
        assert "also read before the attention output is computed" in str(be.report)
        for got, want in steps:
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)


def test_inductor_pass_leaves_returned_weights_unchanged_with_the_reason():
    """The Inductor pre-grad pass (keyed ops) has no ``kvarn::attention_weights``: the site is
    reported with what to use instead, and the model computes what plain eager computes
    (within Inductor's float noise)."""
    from kvarn_compile import inductor_pass

    torch._dynamo.reset()
    kv = inductor_pass("k4v2", group_size=32, max_cache_len=CAP)
    module, plain = EagerWeights(), EagerWeights()
    compiled = torch.compile(module, options={"pre_grad_custom_pass": kv})
    for args in list(_steps())[:2]:
        for got, want in zip(compiled(*args), plain(*args)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert kv.report.sites and not kv.report.rewritten, str(kv.report)
    for site in kv.report.sites:
        assert "which the Inductor pre-grad pass (inductor_pass) does not compute from a packed " \
               "cache; compile with backend=kvarn_backend(...)" in site.reason, site.line()
