"""The float64 attention oracle (over dense K/V or a packed cache), SQNR, and the numerics
check of a rewritten attention against the true K/V within the quantization bound."""

from __future__ import annotations

import torch

def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(|ref| / |ref - actual|)."""
    ref, act = reference.double(), actual.double()
    return (20 * torch.log10(ref.norm() / (ref - act).norm().clamp_min(1e-30))).item()


def oracle_attention(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None = None,
                     *, scale: float | None = None, causal: bool = True, window: int = 0
                     ) -> torch.Tensor:
    """Plain float64 softmax attention of ``q`` [B, Hq, Tq, D] over a packed cache's
    dequantized K/V (:func:`kvarn_compile.ops.append.materialize`): [B, Hq, Tq, D].

    The queries are the cache's newest Tq tokens. ``mask`` is a bool (True = attend) or an
    additive float mask broadcastable to [B, 1 or Hq, Tq, >= capacity]; ``window`` > 0 keeps
    the newest ``window`` keys of each query. A query that sees no key gets zeros. This is
    the oracle the fused ``kvarn::attention`` is tested against; it builds exactly what the
    runtime never does.
    """
    from kvarn_compile.ops.append import materialize
    from kvarn_compile.state import unpack

    k, v = materialize(buffers, dtype=torch.float64)           # [B, H, cap, D]
    return reference_attention(q, k, v, lengths=unpack(buffers).lengths, mask=mask, scale=scale,
                               causal=causal, window=window)


def oracle_latent_attention(q: torch.Tensor, q_pe: torch.Tensor, buffers: list[torch.Tensor],
                            mask: torch.Tensor | None = None, *, scale: float | None = None,
                            causal: bool = True, window: int = 0) -> torch.Tensor:
    """:func:`oracle_attention` of ``kvarn::latent_attention``: float64 attention of
    [q | q_pe] over the dequantized [latent | RoPE key], with the latent as the values."""
    from kvarn_compile.ops.append import materialize
    from kvarn_compile.state import unpack

    lat, pe = materialize(buffers, dtype=torch.float64)
    scale = (q.shape[-1] + q_pe.shape[-1]) ** -0.5 if scale is None else scale
    return reference_attention(torch.cat([q, q_pe], -1), torch.cat([lat, pe], -1), lat,
                               lengths=unpack(buffers).lengths, mask=mask, scale=scale,
                               causal=causal, window=window)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        lengths: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                        scale: float | None = None, causal: bool = True, window: int = 0,
                        kv_start: torch.Tensor | None = None, return_lse: bool = False):
    """Plain float64 softmax attention of ``q`` [B, Hq, Tq, D] over dense K/V [B, H, L, D]
    (Hq a multiple of H: GQA by repeating each kv head): the one attention oracle of the tests.

    Key ``j`` is seen by query ``i`` of row ``b`` when ``j < lengths[b]`` (default L) and, with
    ``causal``, ``j`` is at most the query's position ``lengths[b] - Tq + i`` (the queries are
    the newest Tq tokens); ``window`` > 0 keeps the newest ``window`` keys of each query;
    ``kv_start`` [B, Tq] hides the keys before ``kv_start[b, i]``; ``mask`` is a bool
    (True = attend) or an additive float mask (-inf hides the key) broadcastable to
    [B, 1 or Hq, Tq, >= L]. A query that sees no key gets zeros (and lse -inf); non-finite
    K/V are not cleaned (they poison the queries whose sums they enter, as in full precision).

    Returns the output [B, Hq, Tq, D] in float64, and with ``return_lse`` also the
    log-sum-exp of each query's scaled scores [B, Hq, Tq].
    """
    bsz, hq, tq, d = q.shape
    grp = hq // k.shape[1]
    k = k.double().repeat_interleave(grp, 1)
    v = v.double().repeat_interleave(grp, 1)
    n, dev = k.shape[2], k.device
    lengths = torch.full((bsz,), n, device=dev) if lengths is None else lengths.to(dev)
    kpos = torch.arange(n, device=dev)
    qpos = lengths[:, None] - tq + torch.arange(tq, device=dev)[None]      # [B, Tq]
    allowed = (kpos[None, None] < lengths[:, None, None]).expand(bsz, tq, n)
    if causal:
        allowed = allowed & (kpos[None, None] <= qpos[..., None])
    if window:
        allowed = allowed & (kpos[None, None] > qpos[..., None] - window)
    if kv_start is not None:
        allowed = allowed & (kpos[None, None] >= kv_start.to(dev)[..., None])
    allowed = allowed[:, None]                                             # [B, 1, Tq, L]
    scores = (q.double().to(dev) @ k.transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = allowed & mask[..., :n].to(dev)
        else:
            add = mask[..., :n].double().to(dev)
            scores = scores + add
            allowed = allowed & (add > float("-inf"))
    scores = scores.masked_fill(~allowed, float("-inf"))
    seen = allowed.any(-1, keepdim=True)
    p = torch.softmax(scores, -1)
    p = torch.where(seen, p, torch.zeros_like(p))                          # rows seeing no key -> 0
    out = p @ v
    if return_lse:
        return out, torch.logsumexp(scores, -1)
    return out


# ============================================================================ K/V generators


def kvarn_ops_reference(config, history, q, mask, scale, *, causal=True, cap: int):
    """The eager KVarN ops on the true K/V, independent of any rewrite: a fresh state of
    ``cap`` tokens, ``append_`` of every step's K/V [B, H, T, D] of ``history`` (a list of
    (k, v)) at its position, then ``kvarn::attention``. Returns (output, state)."""
    from kvarn_compile.ops.append import append_
    from kvarn_compile.state import allocate_layer

    k0 = history[0][0]
    ref = allocate_layer(config, batch=k0.shape[0], kv_heads=k0.shape[1], head_dim=k0.shape[3],
                         value_head_dim=history[0][1].shape[3], max_len=cap, dtype=k0.dtype)
    pos = 0
    for k, v in history:
        append_(ref.buffers, k, v, torch.full((k.shape[0],), pos), method=config.op_method,
                iters=config.sinkhorn_iters, recent=config.recent_window)
        pos += k.shape[2]
    return torch.ops.kvarn.attention(q, ref.buffers, mask, scale, causal, 0), ref


def _seen(n, tq, mask, causal):
    """[.., Tq, n] bool: the keys each of the newest Tq queries attends to."""
    import math

    allowed = torch.ones(tq, n, dtype=torch.bool)
    if causal:
        allowed = torch.arange(n)[None, :] <= (n - tq + torch.arange(tq))[:, None]
    allowed = allowed[None, None]
    if mask is not None and mask.dtype == torch.bool:
        allowed = allowed & mask[..., :n]
    elif mask is not None:
        allowed = allowed & (mask[..., :n] > -math.inf)
    return allowed


def quantization_bound(ref, history, q, scale, mask=None, *, causal=True):
    """How far attention over KVarN's dequantized K/V may be from full precision, from the
    preset's actual rounding of these K/V (``ref``: the eager ops' state), per query row and
    channel: with score errors |q_i·(k̂_j - k_j)|·scale <= Δ_i over the keys row i sees and
    value errors |v̂ - v| <= ε, the softmax weights move by at most e^{2Δ_i} - 1 in l1 (half
    of it up, half down), so output channel c moves by at most
    (e^{2Δ_i} - 1) / 2 · (max_j v_jc - min_j v_jc) + ε."""
    import math

    from kvarn_compile.ops.append import materialize

    k = torch.cat([kv[0] for kv in history], 2).double()
    v = torch.cat([kv[1] for kv in history], 2).double()
    n, tq = k.shape[2], q.shape[2]
    k_hat, v_hat = (x[:, :, :n].double() for x in materialize(ref.buffers, dtype=torch.float64))
    grp = q.shape[1] // k.shape[1]
    dk = (k_hat - k).repeat_interleave(grp, 1)
    v = v.repeat_interleave(grp, 1)
    seen = _seen(n, tq, mask, causal)                                   # [.., Tq, n]
    err = (q.double() @ dk.transpose(-1, -2)).abs() * scale
    delta = err.masked_fill(~seen, 0).amax(-1, keepdim=True)          # [B, Hq, Tq, 1]
    vmax = v[:, :, None].masked_fill(~seen[..., None], -math.inf).amax(-2)
    vmin = v[:, :, None].masked_fill(~seen[..., None], math.inf).amin(-2)
    eps = (v_hat - v[:, ::grp]).abs().max().item()
    return torch.expm1(2 * delta) / 2 * (vmax - vmin) + eps + 1e-6


def check_numerics(config, out, history, q, mask, scale, *, causal=True, cap: int) -> None:
    """Three checks of a compiled attention output ``out`` of queries ``q`` (the newest
    positions) against the true K/V of every step (``history``: a list of (k, v)), never
    against the state the compiled graph wrote, so a K/V swap or a wrong position fails:

    1. it equals the eager KVarN ops on the true K/V (:func:`kvarn_ops_reference`);
    2. it equals float64 attention (:func:`reference_attention`) over the K/V an independent
       eager state dequantizes to (``materialize``: another code path than
       ``kvarn::attention``), up to float32 noise;
    3. it is within the preset's quantization bound (:func:`quantization_bound`) of float64
       attention over the true K/V.
    """
    from kvarn_compile.ops.append import materialize

    want, ref = kvarn_ops_reference(config, history, q, mask, scale, causal=causal, cap=cap)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    n = sum(kv[0].shape[2] for kv in history)
    k_hat, v_hat = (x[:, :, :n] for x in materialize(ref.buffers, dtype=torch.float64))
    k_true = torch.cat([kv[0] for kv in history], 2)
    v_true = torch.cat([kv[1] for kv in history], 2)
    exact = reference_attention(q, k_true, v_true, mask=mask, scale=scale, causal=causal)
    dequant = reference_attention(q, k_hat, v_hat, mask=mask, scale=scale, causal=causal)
    noise = 1e-5 * (1 + exact.abs())
    if out.dtype not in (torch.float32, torch.float64):      # the output's own rounding
        noise = noise + torch.finfo(out.dtype).eps * exact.abs()
    err = (out.double() - dequant).abs()
    assert bool((err <= noise).all()), f"{err.max():.3g} from attention over the dequantized K/V"
    bound = quantization_bound(ref, history, q, scale, mask, causal=causal) + noise
    vmax = max(kv[1].abs().max().item() for kv in history)
    assert bound.mean() < 0.1 * vmax, f"vacuous bound {bound.mean():.3g} for values up to {vmax:.3g}"
    err = (out.double() - exact).abs()
    worst = (err - bound).argmax()
    assert bool((err <= bound).all()), (
        f"{err.flatten()[worst]:.3g} from full precision at {worst}, beyond the quantization "
        f"bound {bound.flatten()[worst]:.3g} there")


# ============================================================================ lowering
