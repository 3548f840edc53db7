"""The C++ CPU kernel of ``kvarn::latent_attention`` (``kernels/cpu/attention.py``:
``latent_attention_state``, ``csrc/latent_attention.cpp``): multi-head latent attention in its
absorbed form over a latent state (the latent packed as the state's keys, the shared RoPE
key as its values, at ``LATENT_ROPE_BITS``).

Checked against the pure-torch reference (``ops.attention.latent_attention``) and the
float64 oracle (``oracle_latent_attention``: plain attention of [q | q_pe] over the
dequantized [latent | RoPE key], the latent as the values), within 1e-5 of the output's
scale for fp32: decode (Tq = 1) and multi-query (Tq = 9, 33) steps; rows of different
lengths (one with fewer tokens than queries); per-tile key frames (plain latent tiles) and
rotated ones; fp8 / bf16 scales; fp16 / bf16 models; bool and additive masks; windows;
queries that see nothing (zeros); 1 and 2 kv heads; DeepSeek's geometry (D 512, Dv 64,
16 query heads) and a small one (D 64, Dv 16); other code widths (3-bit latent, 4-bit
RoPE keys: the packed code orders); 1 and 2 threads (splits merged by log-sum-exp).
Every op-level check asserts that the op ran the kernel (the launcher returned an output),
so a silent fallback to the reference fails the suite (which runs with
``KVARN_CPU_KERNEL=require``: a build failure fails it too).
"""

from __future__ import annotations

import pytest
import torch

import kvarn_compile.ops  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile import get_config
from kvarn_compile.config import LATENT_ROPE_BITS
from kvarn_compile.kernels.cpu import attention as cpu_attention
from kvarn_compile.ops import attention as attention_ref
from kvarn_compile.state import unpack
from kvarn_compile.testing import PackedSequence, latent_sequence, oracle_latent_attention

RANK, ROPE, HEADS = 64, 16, 6               # the small geometry (tests/ops/test_latent_attention.py)
DS_RANK, DS_ROPE, DS_HEADS = 512, 64, 16    # DeepSeek-V2/V3: kv_lora_rank, qk_rope_head_dim, heads
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture
def kernel_calls(monkeypatch):
    """The outputs of every ``latent_attention_state`` call the op makes (None: a fallback)."""
    calls = []
    real = cpu_attention.latent_attention_state
    monkeypatch.setattr(cpu_attention, "latent_attention_state",
                        lambda *a, **kw: calls.append(r := real(*a, **kw)) or r)
    return calls


def queries(seq: PackedSequence, q_heads: int, tq: int, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(seq.k), q_heads, tq, seq.head_dim, generator=gen)
    q_pe = torch.randn(len(seq.k), q_heads, tq, seq.value_head_dim, generator=gen)
    return q.to(dtype), q_pe.to(dtype)


def check(calls, q, q_pe, buffers, mask=None, *, scale=None, causal=True, window=0, oracle=True,
          tol=None):
    """The op (on CPU: the kernel, asserted) equals the reference within ``tol`` of the output's
    scale, and the float64 oracle as closely (or within 1.5x the reference's own error)."""
    tol = TOL[q.dtype] if tol is None else tol
    scale = (q.shape[-1] + q_pe.shape[-1]) ** -0.5 if scale is None else scale
    calls.clear()
    out = torch.ops.kvarn.latent_attention(q, q_pe, buffers, mask, scale, causal, window)
    assert len(calls) == 1 and calls[0] is not None, "the CPU op did not run the C++ latent kernel"
    ref = attention_ref.latent_attention(q, q_pe, buffers, mask, scale, causal, window)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert torch.isfinite(out).all()
    size = max(ref.abs().max().item(), 1e-30)
    torch.testing.assert_close(out.double(), ref.double(), rtol=tol, atol=tol * size)
    if oracle:
        orc = oracle_latent_attention(q.float(), q_pe.float(), buffers, mask, scale=scale,
                                      causal=causal, window=window)
        err = (out.double() - orc).abs().max().item()
        ref_err = (ref.double() - orc).abs().max().item()
        assert err <= max(tol * orc.abs().max().item(), 1.5 * ref_err), (err, ref_err)
    return out


@pytest.mark.parametrize("tq", [1, 9, 33])
@pytest.mark.parametrize("case", ["rotated", "key-frames", "fp8-scales", "bf16-scales-frames"])
def test_kernel_matches_reference_and_oracle(kernel_calls, case, tq):
    """Rows of different lengths (row 0 restarted: 1 tile after the sink, row 1: 5 tiles;
    then each row holds fewer or more tokens than the queries), windows and another scale."""
    extra = {"key-frames": dict(outliers=True), "fp8-scales": dict(scale_dtype="float8_e4m3fn"),
             "bf16-scales-frames": dict(outliers=True, scale_dtype="bfloat16")}.get(case, {})
    seq = latent_sequence(**extra)
    seq.write(75)
    seq.write(88, start=[0, 75])
    seq.write(tq)
    if extra.get("outliers"):
        plain = seq.state.k_plain
        assert plain[:, 0].any() and not plain[:, 0].all()     # both key frames
    assert min(seq.state.n_tiles.tolist()) >= 1
    q, q_pe = queries(seq, HEADS, tq)
    for window in (0, 17, 70):
        check(kernel_calls, q, q_pe, seq.buffers, window=window)
    check(kernel_calls, q, q_pe, seq.buffers, scale=0.05)
    check(kernel_calls, q, q_pe, seq.buffers, causal=False)


@pytest.mark.parametrize("tq", [1, 9])
def test_masks_and_queries_that_see_nothing(kernel_calls, tq):
    """Bool and additive float masks (finite biases and -inf), read at absolute positions in
    the sink, the tiles and the tail; a query whose mask hides everything, and queries
    before a short row's first token, get zeros."""
    seq = latent_sequence(outliers=True)
    seq.write(150)
    seq.write(5, start=[0, 150])                # row 0: 5 tokens, fewer than 9 queries
    q, q_pe = queries(seq, HEADS, tq, seed=1)
    gen = torch.Generator().manual_seed(2)
    keep = torch.rand(2, 1, tq, 256, generator=gen) > 0.3
    keep[1, 0, -1] = False                      # the last query of row 1 sees no key
    bias = torch.randn(2, HEADS, tq, 256, generator=gen)
    bias = bias.masked_fill(torch.rand(2, HEADS, tq, 256, generator=gen) < 0.2, float("-inf"))
    for mask in (keep, bias, bias.half()):
        for window in (0, 40):
            out = check(kernel_calls, q, q_pe, seq.buffers, mask, window=window)
            if mask is keep:
                assert (out[1, :, -1] == 0).all()
    out = check(kernel_calls, q, q_pe, seq.buffers)
    if tq == 9:
        assert (out[0, :, :4] == 0).all() and (out[0, :, 4:] != 0).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_model_dtypes(kernel_calls, dtype):
    """fp16 / bf16 models: the exact region in the model dtype, queries and output too."""
    seq = latent_sequence(outliers=True, dtype=dtype)
    seq.write(140)
    seq.write(60, start=[0, 140])
    assert seq.state.sink_k.dtype == dtype
    for tq in (1, 9):
        seq.write(tq)
        q, q_pe = queries(seq, HEADS, tq, dtype=dtype, seed=tq)
        check(kernel_calls, q, q_pe, seq.buffers, window=30)
    # RoPE queries in another dtype than the latent ones (the exact region reads them in q's)
    q, q_pe = queries(seq, HEADS, 9, dtype=dtype, seed=3)
    check(kernel_calls, q, q_pe.float(), seq.buffers, oracle=False)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_kv_heads(kernel_calls, kv_heads):
    """Two kv heads (head 0 with plain latent tiles, head 1 rotated), 3 query heads each."""
    seq = latent_sequence(heads=kv_heads, outliers=True)
    seq.write(170)
    seq.write(40, start=[0, 170])
    for tq in (1, 9, 33):
        seq.write(tq)
        q, q_pe = queries(seq, 6, tq, seed=tq)
        check(kernel_calls, q, q_pe, seq.buffers, window=0 if tq == 1 else 50)


@pytest.mark.parametrize("group,frame,extra", [(32, "rotated", {}), (128, "auto", {}),
                                               (64, "auto", {"scale_dtype": "float8_e4m3fn"})],
                         ids=["g32", "g128-key-frames", "g64-fp8"])
def test_deepseek_geometry(kernel_calls, group, frame, extra):
    """D = 512 (kv_lora_rank), Dv = 64 (RoPE), 16 query heads over one kv head."""
    seq = latent_sequence(rank=DS_RANK, rope=DS_ROPE, group=group, outliers=frame == "auto",
                          key_frame=frame, max_len=720, **extra)
    seq.write(500)
    seq.write(200, start=[0, 500])
    if frame == "auto":
        assert seq.state.k_plain.any()
    for tq in (1, 9):
        seq.write(tq)
        q, q_pe = queries(seq, DS_HEADS, tq, seed=tq)
        check(kernel_calls, q, q_pe, seq.buffers, window=0 if tq == 1 else 300)
    mask = torch.rand(2, 1, 9, 720, generator=torch.Generator().manual_seed(4)) > 0.25
    check(kernel_calls, q, q_pe, seq.buffers, mask)


@pytest.mark.parametrize("preset,value_bits", [("k2v2", LATENT_ROPE_BITS), ("k4v4", 4),
                                               ("k4v2", 2), ("k4v2", 3)])
def test_code_widths(kernel_calls, preset, value_bits):
    """2- and 3-bit latents, 2-, 3- and 4-bit RoPE keys (the packed code orders of both sides;
    3 bits through the byte-unpack path)."""
    extra = {"key_bits": 3} if value_bits == 3 else {}
    seq = latent_sequence(preset=preset, value_bits=value_bits, outliers=True, **extra)
    seq.write(160)
    for tq in (1, 9):
        seq.write(tq)
        q, q_pe = queries(seq, HEADS, tq, seed=tq)
        check(kernel_calls, q, q_pe, seq.buffers)


def test_splits_and_thread_counts(kernel_calls):
    """Many tiles a row (group 32, 250 and 750 tokens): a decode step splits each row's tiles over
    tasks and merges their partials by log-sum-exp; the result does not depend on the
    thread count beyond rounding."""
    seq = latent_sequence(max_len=800, outliers=True)
    seq.write(500)
    seq.write(250, start=[0, 500])
    assert min(seq.state.n_tiles.tolist()) >= 4
    n = torch.get_num_threads()
    try:
        for tq in (1, 33):
            q, q_pe = queries(seq, HEADS, tq, seed=tq)
            outs = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                outs.append(check(kernel_calls, q, q_pe, seq.buffers, oracle=threads == 1))
            for out in outs[1:]:
                torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-5 * outs[0].abs().max().item())
    finally:
        torch.set_num_threads(n)


def test_refusals_match_the_reference():
    """Queries, RoPE queries or a mask that do not fit the state raise the reference's
    ValueError from the kernel itself."""
    seq = latent_sequence()
    seq.write(40)
    q, q_pe = queries(seq, HEADS, 1)
    cases = [
        ((torch.randn(2, HEADS, 1, 32), q_pe, None),
         r"expected queries \[batch=2, heads=k\*1, tq, head_dim=64\], but got \(2, 6, 1, 32\)\."),
        ((q, torch.randn(2, HEADS, 1, 32), None),
         r"expected RoPE queries \[2, 6, 1, rope_dim=16\] like the latent queries, but got \(2, 6, 1, 32\)\."),
        ((q, q_pe, torch.ones(2, 1, 1, 30, dtype=torch.bool)),
         r"the mask covers 30 key positions, but the cache holds up to 40"),
    ]
    for (qq, pe, mask), match in cases:
        for fn in (lambda: cpu_attention.latent_attention_state(qq, pe, seq.buffers, mask, scale=0.1,
                                                                causal=True, window=0),
                   lambda: attention_ref.latent_attention(qq, pe, seq.buffers, mask, 0.1, True, 0)):
            with pytest.raises(ValueError, match=match):
                fn()


def test_unread_states_fall_back_to_the_reference(kernel_calls):
    """A state the kernel does not read (here: fp64 scales) gets None from the launcher, and
    the op then runs the reference."""
    seq = latent_sequence()
    seq.write(120)
    f = unpack(seq.buffers)
    buffers = list(seq.buffers)
    at = {name: i for i, name in enumerate(f.layout.names)}
    for name in ("k_row_scale", "k_col_scale", "v_row_scale", "v_col_scale"):
        buffers[at[name]] = buffers[at[name]].double()
    q, q_pe = queries(seq, HEADS, 1)
    out = torch.ops.kvarn.latent_attention(q, q_pe, buffers, None, 0.1, True, 0)
    assert kernel_calls == [None]
    torch.testing.assert_close(out, attention_ref.latent_attention(q, q_pe, buffers, None, 0.1, True, 0))
    assert cpu_attention.latent_attention_state(q, q_pe, seq.buffers, None, scale=0.1, causal=True,
                                                window=0) is not None


def test_growable_state(kernel_calls):
    """A growable state (``allocate_layer(grow_from=)``): a sink that holds the whole short
    sequence with no tile or tail slots, then tiles and a tail grown with the sequence."""
    from kvarn_compile.ops.append import append_
    from kvarn_compile.state import allocate_layer

    cfg = get_config("k4v2", group_size=32, value_bits=LATENT_ROPE_BITS)
    st = allocate_layer(cfg, batch=1, kv_heads=1, head_dim=RANK, value_head_dim=ROPE, max_len=400,
                        dtype=torch.float32, grow_from=10)
    gen = torch.Generator().manual_seed(5)
    pos = 0
    for n in (10, 1, 290, 40):
        st.reserve(pos + n)
        append_(st.buffers, torch.randn(1, 1, n, RANK, generator=gen), torch.randn(1, 1, n, ROPE, generator=gen),
                torch.tensor([pos]), method=cfg.op_method, iters=cfg.sinkhorn_iters)
        st.trim()
        pos += n
        if pos <= 11:
            assert st.max_tiles == 0 and st.tail_len == 0
        for tq in sorted({1, min(n, 9)}):
            q = torch.randn(1, HEADS, tq, RANK, generator=gen)
            q_pe = torch.randn(1, HEADS, tq, ROPE, generator=gen)
            check(kernel_calls, q, q_pe, st.buffers)
    assert int(st.n_tiles[0]) >= 8
