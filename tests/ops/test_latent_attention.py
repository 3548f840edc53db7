"""kvarn::latent_attention: multi-head latent attention in its absorbed form over a latent
state (the normed latent packed as the state's keys, the shared RoPE key as its values).

The fused reference (and every kernel, through the op) equals float64 attention of
[q | q_pe] over the dequantized [latent | RoPE key], with the dequantized latent as the
values: one packed copy of the latent serves both sides."""

from __future__ import annotations

import pytest
import torch

import kvarn_compile.ops  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile.ops import append as append_ref
from kvarn_compile.testing import latent_sequence, oracle_latent_attention

RANK, ROPE, HEADS = 64, 16, 6
CAP = 256


def latent(q, q_pe, buffers, mask=None, *, scale=None, causal=True, window=0):
    scale = (q.shape[-1] + q_pe.shape[-1]) ** -0.5 if scale is None else scale
    return torch.ops.kvarn.latent_attention(q, q_pe, buffers, mask, scale, causal, window)


def assert_latent_matches(q, q_pe, buffers, mask=None, *, tol=1e-5, **kw):
    out = latent(q, q_pe, buffers, mask, **kw)
    ref = oracle_latent_attention(q, q_pe, buffers, mask, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("preset,outliers,extra", [
    ("k4v2", False, {}), ("k4v2", True, {}), ("k2v2", False, {}),
    ("k4v2", False, {"scale_dtype": "float8_e4m3fn"})],
    ids=["k4", "k4-key-frames", "k2", "k4-fp8-scales"])
def test_latent_attention_equals_attention_over_the_dequantized_latent(preset, outliers, extra):
    """Decode and multi-query steps, rows of different lengths, windows and masks; the
    latent read back is the true latent within the preset's rounding (the values are the
    keys' codes, not another copy)."""
    seq = latent_sequence(preset, outliers=outliers, **extra)
    seq.write(75)
    seq.write(58, start=[0, 75])                    # row 0 restarts, row 1: 4 tiles
    if outliers:
        assert seq.state.k_plain[:, 0].any()        # some latent tiles stored un-rotated
    tol = 2e-4 if outliers else 1e-5
    for tq in (1, 1, 9):
        seq.write(tq)
        q, q_pe = torch.randn(2, HEADS, tq, RANK), torch.randn(2, HEADS, tq, ROPE)
        assert_latent_matches(q, q_pe, seq.buffers, tol=tol)
        assert_latent_matches(q, q_pe, seq.buffers, tol=tol, window=17)
        assert_latent_matches(q, q_pe, seq.buffers, tol=tol, scale=0.05)
    mask = torch.rand(2, 1, 9, CAP) > 0.3
    q, q_pe = torch.randn(2, HEADS, 9, RANK), torch.randn(2, HEADS, 9, ROPE)
    assert_latent_matches(q, q_pe, seq.buffers, mask, tol=tol)
    lat, pe = append_ref.materialize(seq.buffers, dtype=torch.float32)
    n = seq.lengths()[1]
    # (8-bit RoPE keys: the rounding of fp8 scales, ~2^-4, bounds them there)
    for got, true, most in ((lat, seq.k, 0.5), (pe, seq.v, 0.1 if extra else 0.02)):
        rel = ((got[1, :, :n] - true[1]).norm() / true[1].norm()).item()
        assert 0 < rel < most, rel


def test_latent_attention_is_not_attention_over_the_latent_alone():
    """The RoPE part moves the scores (a kernel that dropped it, or read the values as the
    output, would not pass the test above by accident)."""
    seq = latent_sequence("k4v2")
    seq.write(100)
    q, q_pe = torch.randn(2, HEADS, 1, RANK), torch.randn(2, HEADS, 1, ROPE)
    a = latent(q, q_pe, seq.buffers)
    b = latent(q, torch.zeros_like(q_pe), seq.buffers)
    assert (a - b).abs().max() > 1e-2


def test_latent_attention_refuses_queries_that_do_not_fit():
    seq = latent_sequence("k4v2")
    seq.write(40)
    q = torch.randn(2, HEADS, 1, RANK)
    with pytest.raises(ValueError, match=r"expected RoPE queries \[2, 6, 1, rope_dim=16\]"):
        latent(q, torch.randn(2, HEADS, 1, 32), seq.buffers)
    with pytest.raises(ValueError, match=r"expected queries \[batch=2, heads=k\*1, tq, head_dim=64\]"):
        latent(torch.randn(2, HEADS, 1, 32), torch.randn(2, HEADS, 1, ROPE), seq.buffers)
