"""The pure-torch reference of ``kvarn::attention`` and ``kvarn::tile_partials_``.

``attention(q, buffers, ...)`` attends the queries (the last Tq written tokens of each row)
over [sink, tiles, tail] without materializing dequantized K/V: the exact region (sink +
tail) and the packed tiles are attended apart and merged by log-sum-exp (:mod:`.regions`,
shared with the kernel path and the Inductor decomposition). ``tile_partials(...)`` is the
tile region alone over every tile slot, static shapes, in the flash-decoding convention.
``latent_attention(q, q_pe, buffers, ...)`` is the reference of ``kvarn::latent_attention``:
multi-head latent attention in its absorbed form over a *latent state* (the latent as the
state's keys, the shared RoPE key as its values): scores ``q·latentᵀ + q_pe·ropeᵀ``, output
``p·latent`` - one packed copy of the latent serves the score and the value side.
``latent_tile_partials(...)`` is its tile region alone (the reference of
``kvarn::latent_tile_partials_``): per key frame, over every tile slot, static shapes.
``attention_weights(q, buffers, ...)``, the reference (and only implementation) of
``kvarn::attention_weights``, gives the softmax weights ``attention`` applies, for models
that return them (``output_attentions``), from the keys dequantized whole.

The dual-scale tile math is written once (:func:`tile_scores`, :func:`tile_values`) and
used by both: per tile, the key row scale is folded into q, the key column scale into the
scores, the value row scale into the softmax weights and the value column scale into the
output; the rotation is applied to q on the way in and undone on the output. Pure torch on
any device; never calls a kernel (the kernels' oracle and the benchmarks' baseline).
"""

from __future__ import annotations

import dataclasses

import torch

from kvarn_compile.ops import regions
from kvarn_compile.quant.quantize import unpack_codes
from kvarn_compile.quant.rotation import rotation_matrix
from kvarn_compile.state import Geometry, StateFields, unpack

__all__ = ["attention", "attention_weights", "latent_attention", "tile_region", "latent_tile_region", "tile_partials", "tile_inputs", "tile_scores", "tile_values", "query_frames",
           "tile_key_values", "tile_value_scores", "check_queries", "check_latent_queries", "latent_fields", "check_query_shape", "check_mask", "check_mask_covers", "TILE_ARGS",
           "TILE_CHUNK", "latent_tile_partials", "LATENT_TILE_ARGS"]

#: Tiles processed at once by the reference attention (bounds its scratch memory).
TILE_CHUNK = 64

#: The tensor arguments of ``kvarn::tile_partials_``, in order (``q_plain``, ``k_plain`` and
#: ``bias`` may be None: no per-tile key frames, no mask).
TILE_ARGS = ("q_rot", "q_plain", "k_codes", "k_row_scale", "k_row_zero", "k_col_scale",
             "v_codes", "v_row_scale", "v_row_zero", "v_col_scale", "k_plain", "n_tiles",
             "kv_lo", "kv_hi", "bias")

#: The tensor arguments of ``kvarn::latent_tile_partials_``, in order (None where absent:
#: ``q_plain``, ``tile_ids``, ``tile_count`` without key frames, the factors without fp8
#: scales, ``bias`` without a mask).
LATENT_TILE_ARGS = ("q_rot", "q_plain", "q_pe_rot", "k_codes", "k_row_scale", "k_row_zero",
                    "k_col_scale", "v_codes", "v_row_scale", "v_row_zero", "v_col_scale",
                    "k_row_factor", "k_col_factor", "v_row_factor", "v_col_factor", "tile_ids",
                    "tile_count", "n_tiles", "kv_lo", "kv_hi", "bias")


# ------------------------------------------------------------------------------ tile math
def query_frames(q_rot: torch.Tensor, q_plain: torch.Tensor | None,
                 k_plain: torch.Tensor | None) -> torch.Tensor:
    """Queries [B,H,g,Tq,D] as [B,H,g,Tq,1,D], or [B,H,g,Tq,n,D] with the un-rotated
    ``q_plain`` for the tiles whose ``k_plain`` flag [B,H,n] is set (per-tile key frames)."""
    q_t = q_rot.float().unsqueeze(-2)
    if k_plain is not None:
        plain = k_plain.bool()[:, :, None, None, :, None]                 # [B,H,1,1,n,1]
        q_t = torch.where(plain, q_plain.float().unsqueeze(-2), q_t)
    return q_t


def tile_scores(q_t: torch.Tensor, codes: torch.Tensor, row_scale: torch.Tensor,
                row_zero: torch.Tensor, col_scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Unscaled scores [B,H,g,Tq,n*G] of queries ``q_t`` (:func:`query_frames`) against n
    key tiles (codes [B,H,n,D,G*bits/8], scales with their fp8 factors applied)::

        s[t] = cs[t] * (sum_c (q[c] * rs[c]) * code[c, t] + sum_c q[c] * rz[c])
    """
    codes = unpack_codes(codes, bits).float()                              # [B,H,n,D,G]
    qs = q_t * row_scale.float()[:, :, None, None]                         # [B,H,g,Tq,n,D]
    dot = torch.einsum("bhgqnd,bhndt->bhgqnt", qs, codes)
    zero = (q_t * row_zero.float()[:, :, None, None]).sum(-1, keepdim=True)
    return ((dot + zero) * col_scale.float()[:, :, None, None]).flatten(-2)


def tile_values(p: torch.Tensor, codes: torch.Tensor, row_scale: torch.Tensor,
                row_zero: torch.Tensor, col_scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Rotated-frame output [B,H,g,Tq,D] of weights p [B,H,g,Tq,n*G] over n value tiles::

        o[c] = sum_tiles cs[c] * (sum_t (p[t] * rs[t]) * code[t, c] + sum_t p[t] * rz[t])
    """
    codes = unpack_codes(codes, bits).float()                              # [B,H,n,G,D]
    pt = p.unflatten(-1, (codes.shape[2], codes.shape[3]))                 # [B,H,g,Tq,n,G]
    weighted = torch.einsum("bhgqnt,bhntd->bhgqnd", pt * row_scale.float()[:, :, None, None], codes)
    zsum = (pt * row_zero.float()[:, :, None, None]).sum(-1, keepdim=True)
    return ((weighted + zsum) * col_scale.float()[:, :, None, None]).sum(-2)


def tile_value_scores(q_t: torch.Tensor, codes: torch.Tensor, row_scale: torch.Tensor,
                      row_zero: torch.Tensor, col_scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Unscaled scores [B,H,g,Tq,n*G] of queries ``q_t`` [B,H,g,Tq,1,Dv] (rotated frame)
    against n *value* tiles read as keys (a latent state's RoPE keys)::

        s[t] = rs[t] * sum_c (q[c] * cs[c]) * code[t, c] + rz[t] * sum_c q[c] * cs[c]
    """
    codes = unpack_codes(codes, bits).float()                              # [B,H,n,G,Dv]
    qc = q_t * col_scale.float()[:, :, None, None]                         # [B,H,g,Tq,n,Dv]
    dot = torch.einsum("bhgqnc,bhntc->bhgqnt", qc, codes)
    zero = qc.sum(-1, keepdim=True)
    return (dot * row_scale.float()[:, :, None, None]
            + zero * row_zero.float()[:, :, None, None]).flatten(-2)


def tile_key_values(p: torch.Tensor, codes: torch.Tensor, row_scale: torch.Tensor,
                    row_zero: torch.Tensor, col_scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-tile outputs [B,H,g,Tq,n,D] (each in its tile's key frame) of weights p
    [B,H,g,Tq,n*G] over n *key* tiles read as values (a latent state: the latent is both)::

        o[c] = rs[c] * sum_t (p[t] * cs[t]) * code[c, t] + rz[c] * sum_t p[t] * cs[t]
    """
    codes = unpack_codes(codes, bits).float()                              # [B,H,n,D,G]
    pt = p.unflatten(-1, (codes.shape[2], codes.shape[4])) * col_scale.float()[:, :, None, None]
    weighted = torch.einsum("bhgqnt,bhndt->bhgqnd", pt, codes)
    return (weighted * row_scale.float()[:, :, None, None]
            + pt.sum(-1, keepdim=True) * row_zero.float()[:, :, None, None])


def _tile_tensors(tiles, sl: slice = slice(None)) -> tuple[torch.Tensor, ...]:
    """(codes, row scale, row zero, column scale) of tile slots ``sl``, fp8 factors applied."""
    rs, cs = tiles.row_scale[:, :, sl], tiles.col_scale[:, :, sl]
    if tiles.row_factor is not None:        # fp8 scales: fold their per-vector factor
        rs = rs.float() * tiles.row_factor[:, :, sl].float()
        cs = cs.float() * tiles.col_factor[:, :, sl].float()
    return tiles.codes[:, :, sl], rs, tiles.row_zero[:, :, sl], cs


# ------------------------------------------------------------------------------ attention
def check_queries(q: torch.Tensor, f: StateFields[torch.Tensor]) -> None:
    check_query_shape(q, f.sink_k)


def check_query_shape(q: torch.Tensor, sink_k: torch.Tensor) -> None:
    """Refuse queries that do not match the cache (``sink_k``: [B, H, S, D])."""
    bsz, heads, _, d = sink_k.shape
    if q.dim() != 4 or q.shape[0] != bsz or q.shape[-1] != d or q.shape[1] % heads:
        raise ValueError(f"KVarN attention: expected queries [batch={bsz}, heads=k*{heads}, tq, "
                         f"head_dim={d}], but got {tuple(q.shape)}.")


def check_mask(f: StateFields[torch.Tensor], mask: torch.Tensor | None) -> None:
    """Refuse a mask that does not cover every position the cache holds (mutates nothing)."""
    if mask is not None:
        check_mask_covers(mask, f.lengths)


def check_mask_covers(mask: torch.Tensor, lengths: torch.Tensor) -> None:
    """:func:`check_mask` from the state's ``lengths`` [B]."""
    held = int(lengths.max())
    if mask.shape[-1] < held:
        raise ValueError(f"KVarN attention: the mask covers {mask.shape[-1]} key positions, but the "
                         f"cache holds up to {held}; expected a mask as long as the cache.")


def _tile_weights(scores: torch.Tensor, f: StateFields[torch.Tensor], mask: torch.Tensor | None,
                  causal: bool, window: int, n_used: int, tile_offset: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax weights [B,H,g,Tq,n_used*G] and lse [B,H,g,Tq] of scaled tile scores, with
    per-row fill, causality, window and mask applied."""
    bsz, heads, grp, tq = scores.shape[:4]
    geo = Geometry.of(f)
    g = geo.group
    j = tile_offset * g + torch.arange(n_used * g, device=scores.device)  # sequence token index
    kv_lo, kv_hi = regions.tile_bounds(f, tq, causal, window)
    visible = (j[None, None, :] >= kv_lo[:, :, None]) & (j[None, None, :] < kv_hi[:, :, None])
    bias = regions.bias_at(mask, (geo.sink + j)[None, :].expand(bsz, -1), (bsz, heads * grp, tq))
    if bias is not None:
        scores = scores + bias.reshape(bsz, heads, grp, tq, -1)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    p, denom, m_ref = regions.safe_lse(scores)
    return regions.normalized(p, denom, m_ref)


def _chunks(n_used: int) -> list[slice]:
    return [slice(a, min(a + TILE_CHUNK, n_used)) for a in range(0, n_used, TILE_CHUNK)]


def tile_region(q: torch.Tensor, f: StateFields[torch.Tensor], mask: torch.Tensor | None,
                scale: float, causal: bool, window: int, n_used: int, tile_offset: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the first ``n_used`` tile slots: (out fp32 [B,Hq,Tq,Dv] in the original
    frame, lse [B,Hq,Tq]), with per-row fill, causality, window and mask applied.

    ``tile_offset``: the sequence's tile number of slot 0 (a context-parallel rank holds
    tiles ``tile_offset ..``; the counters of ``f`` count the whole sequence's tiles).
    """
    geo = Geometry.of(f)
    bsz, heads, d, g = geo.batch, geo.kv_heads, geo.head_dim, geo.group
    hq, tq = q.shape[1], q.shape[2]
    grp = hq // heads
    rot = rotation_matrix(d, q.device)
    rot_v = rot if geo.value_head_dim == d else rotation_matrix(geo.value_head_dim, q.device)
    qg = q.float().reshape(bsz, heads, grp, tq, d)
    q_rot = qg @ rot
    chunks = _chunks(n_used)
    plain = f.k_plain
    scores = torch.cat([
        tile_scores(query_frames(q_rot, qg, None if plain is None else plain[:, :, sl]),
                    *_tile_tensors(f.k, sl), geo.key_bits) for sl in chunks], -1) * scale
    p, lse = _tile_weights(scores, f, mask, causal, window, n_used, tile_offset)
    out = sum(tile_values(p[..., sl.start * g:sl.stop * g], *_tile_tensors(f.v, sl), geo.value_bits)
              for sl in chunks)
    return (out @ rot_v.T).reshape(bsz, hq, tq, -1), lse.reshape(bsz, hq, tq)


def latent_tile_region(q: torch.Tensor, q_pe: torch.Tensor, f: StateFields[torch.Tensor],
                       mask: torch.Tensor | None, scale: float, causal: bool, window: int,
                       n_used: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tile_region` of a latent state (:func:`latent_attention`): scores from the key
    tiles (the latent, against ``q``) plus the value tiles (the RoPE keys, against
    ``q_pe``), output from the key tiles, each tile's part rotated back from its own frame."""
    geo = Geometry.of(f)
    bsz, heads, d, g = geo.batch, geo.kv_heads, geo.head_dim, geo.group
    hq, tq = q.shape[1], q.shape[2]
    grp = hq // heads
    rot = rotation_matrix(d, q.device)
    qg = q.float().reshape(bsz, heads, grp, tq, d)
    q_rot = qg @ rot
    pe_rot = (q_pe.float().reshape(bsz, heads, grp, tq, -1)
              @ rotation_matrix(geo.value_head_dim, q.device)).unsqueeze(-2)
    chunks = _chunks(n_used)
    plain = f.k_plain
    scores = torch.cat([
        tile_scores(query_frames(q_rot, qg, None if plain is None else plain[:, :, sl]),
                    *_tile_tensors(f.k, sl), geo.key_bits)
        + tile_value_scores(pe_rot, *_tile_tensors(f.v, sl), geo.value_bits)
        for sl in chunks], -1) * scale
    p, lse = _tile_weights(scores, f, mask, causal, window, n_used, 0)
    rotated = qg.new_zeros(qg.shape)
    unrotated = qg.new_zeros(qg.shape)
    for sl in chunks:
        part = tile_key_values(p[..., sl.start * g:sl.stop * g], *_tile_tensors(f.k, sl),
                               geo.key_bits)                               # [B,H,g,Tq,n,D]
        if plain is None:
            rotated = rotated + part.sum(-2)
            continue
        is_plain = plain[:, :, sl].bool()[:, :, None, None, :, None]
        rotated = rotated + torch.where(is_plain, 0.0, part).sum(-2)
        unrotated = unrotated + torch.where(is_plain, part, 0.0).sum(-2)
    out = rotated @ rot.T + unrotated
    return out.reshape(bsz, hq, tq, d), lse.reshape(bsz, hq, tq)


def attention(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None = None,
              scale: float | None = None, causal: bool = True, window: int = 0, *,
              return_lse: bool = False):
    """Attention of q [B, Hq, Tq, D] (the last Tq written tokens) over the packed cache.

    mask: optional bool (True = attend) or additive float, broadcastable to
    [B, Hq, Tq, M] and indexed by absolute key position (M must exceed every position).
    window > 0 keeps keys with position > query position - window (sliding window).
    Queries that can see no key get a zero output. Returns [B, Hq, Tq, Dv] in q's dtype
    (Dv: the values' head dim, D unless the state was allocated with another);
    with ``return_lse``, (out fp32, lse fp32 [B, Hq, Tq]) so partial results over parts of
    a cache can be merged (:func:`kvarn_compile.ops.regions.merge_regions`).
    """
    f = unpack(buffers)
    check_queries(q, f)
    check_mask(f, mask)
    scale = f.sink_k.shape[-1] ** -0.5 if scale is None else scale
    out, lse = regions.exact_region(q, f, mask, scale, causal, window)
    n_used = int(f.n_tiles.max()) if f.k.codes.shape[2] else 0
    if n_used:
        out_t, lse_t = tile_region(q, f, mask, scale, causal, window, n_used)
        out, lse = regions.merge_regions(out, lse, out_t, lse_t)
    if return_lse:
        return out, lse
    return out.to(q.dtype)


def attention_weights(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None,
                      scale: float | None, causal: bool, window: int, keys: int) -> torch.Tensor:
    """The softmax weights fp32 [B, Hq, Tq, keys] that :func:`attention` (same arguments)
    applies to the values at key positions 0..keys-1: the keys as the attention reads them
    (sink and tail exact, the tiles dequantized), the same causal, window and mask rules, 0
    past each row's length and for a query that sees nothing. For models that return their
    attention weights; it dequantizes every key of the cache."""
    from kvarn_compile.ops.append import materialize

    f = unpack(buffers)
    check_queries(q, f)
    check_mask(f, mask)
    if keys < 0:
        raise ValueError(f"KVarN attention_weights: expected keys >= 0 (the key positions the "
                         f"weights cover), but got {keys}.")
    scale = f.sink_k.shape[-1] ** -0.5 if scale is None else scale
    bsz, heads, _, d = f.sink_k.shape
    hq, tq = q.shape[1], q.shape[2]
    k_all, _ = materialize(buffers, dtype=torch.float32)                    # [B, H, capacity, D]
    n = min(keys, int(f.capacity[0]))
    k_all = k_all[:, :, :n]
    scores = torch.matmul(q.float().reshape(bsz, heads, (hq // heads) * tq, d),
                          k_all.transpose(-1, -2)).reshape(bsz, hq, tq, n) * scale
    pos = torch.arange(n, device=q.device)[None, :].expand(bsz, n)
    q_pos = regions.query_positions(f.lengths, tq)
    allowed = (pos < f.lengths[:, None])[:, None, :].expand(bsz, tq, n)
    if causal:
        allowed = allowed & (pos[:, None, :] <= q_pos[:, :, None])
    if window > 0:
        allowed = allowed & (pos[:, None, :] > q_pos[:, :, None] - window)
    bias = regions.bias_at(mask, pos, (bsz, hq, tq))
    if bias is not None:
        scores = scores + bias
    p, denom, m_ref = regions.safe_lse(scores.masked_fill(~allowed[:, None], regions.NEG_INF))
    p, _ = regions.normalized(p, denom, m_ref)
    return torch.nn.functional.pad(p, (0, keys - n))


def check_latent_queries(q: torch.Tensor, q_pe: torch.Tensor, f: StateFields[torch.Tensor]) -> None:
    """Refuse latent queries that do not match a latent state (latent D, RoPE key Dv)."""
    check_query_shape(q, f.sink_k)
    r = f.sink_v.shape[-1]
    if q_pe.dim() != 4 or tuple(q_pe.shape[:3]) != tuple(q.shape[:3]) or q_pe.shape[-1] != r:
        raise ValueError(f"KVarN latent_attention: expected RoPE queries [{', '.join(map(str, q.shape[:3]))}, "
                         f"rope_dim={r}] like the latent queries, but got {tuple(q_pe.shape)}.")


def latent_fields(f: StateFields[torch.Tensor]) -> StateFields[torch.Tensor]:
    """The exact region of a latent state as one attention reads it: keys [latent | RoPE
    key] (D + Dv channels), values the latent."""
    cat = lambda a, b: torch.cat([a, b.to(a.dtype)], -1)  # noqa: E731
    return dataclasses.replace(f, sink_k=cat(f.sink_k, f.sink_v), sink_v=f.sink_k,
                               tail_k=cat(f.tail_k, f.tail_v), tail_v=f.tail_k)


def latent_attention(q: torch.Tensor, q_pe: torch.Tensor, buffers: list[torch.Tensor],
                     mask: torch.Tensor | None = None, scale: float | None = None,
                     causal: bool = True, window: int = 0, *, return_lse: bool = False):
    """Multi-head latent attention, absorbed form, over a latent state.

    The state holds the normed latent as its keys ([B, H, ., D]: D = kv_lora_rank, H = 1 in
    DeepSeek's layout) and the shared RoPE key as its values (Dv = qk_rope_head_dim). For
    ``q`` [B, Hq, Tq, D] (the no-RoPE queries absorbed into the latent space) and ``q_pe``
    [B, Hq, Tq, Dv]::

        out = softmax(scale * (q · latentᵀ + q_pe · ropeᵀ) + mask) · latent     [B, Hq, Tq, D]

    Masks, causality, window and empty rows as :func:`attention`; ``scale`` defaults to
    (D + Dv) ** -0.5.
    """
    f = unpack(buffers)
    check_latent_queries(q, q_pe, f)
    check_mask(f, mask)
    d, r = f.sink_k.shape[-1], f.sink_v.shape[-1]
    scale = (d + r) ** -0.5 if scale is None else scale
    out, lse = regions.exact_region(torch.cat([q, q_pe.to(q.dtype)], -1), latent_fields(f), mask,
                                    scale, causal, window)
    n_used = int(f.n_tiles.max()) if f.k.codes.shape[2] else 0
    if n_used:
        out_t, lse_t = latent_tile_region(q, q_pe, f, mask, scale, causal, window, n_used)
        out, lse = regions.merge_regions(out, lse, out_t, lse_t)
    if return_lse:
        return out, lse
    return out.to(q.dtype)


# ------------------------------------------------------------------------------ tile partials
def _tile_bias(mask: torch.Tensor | None, s: int, tokens: int, shape: tuple[int, int, int]
               ) -> torch.Tensor | None:
    """The mask over the quantized tokens (absolute positions s .. s + tokens - 1), [B, 1 or
    Hq, Tq, tokens], for the tile kernels (which read any strides, bool masks and float
    dtypes). A mask covering them is read as it is: a view of its own storage, no copy. One
    shorter than the cache becomes an additive fp32 one (``regions.bias_at``). Either way a
    mask shared by the query heads stays one mask (head dim 1), never copied per head."""
    if mask is None:
        return None
    b, hq, tq = shape
    heads = hq if mask.dim() == 4 and mask.shape[1] == hq else 1
    if (mask.is_floating_point() or mask.dtype == torch.bool) and mask.shape[-1] >= s + tokens \
            and mask.stride(-1) == 1:
        return mask.expand(b, heads, tq, mask.shape[-1])[..., s:s + tokens]
    positions = (s + torch.arange(tokens, device=mask.device))[None, :].expand(b, -1)
    return regions.bias_at(mask, positions, (b, heads, tq))


def tile_inputs(q: torch.Tensor, buffers, mask: torch.Tensor | None, causal: bool,
                window: int, rot: torch.Tensor | None = None, matmul=torch.matmul):
    """Everything a tile-partials kernel needs (:data:`TILE_ARGS`), from the attention's
    arguments.

    q_rot fp32 [B,Hq,Tq,D]; q_plain (the un-rotated fp32 queries, only when the state has
    per-tile key frames); the 8 tile tensors (scales with their fp8 factors applied);
    k_plain uint8 [B,H,N] or None; n_tiles [B]; kv_lo, kv_hi [B,Tq]; bias [B,1 or Hq,Tq,N*G]
    (``_tile_bias``: the model's bool or float mask itself where it covers the tiles) or None. Quantized token j of a row sits at absolute position S + j (see
    ``regions.tile_bounds``). Static shapes only: it traces into the Inductor decomposition.
    ``matmul`` rotates q (``regions.small_matmul`` in traced decode graphs).
    """
    f = unpack(buffers)
    bsz, _, s, d = f.sink_k.shape
    n_max, g = f.k.codes.shape[2], f.k.col_scale.shape[-1]
    hq, tq = q.shape[1], q.shape[2]
    kv_lo, kv_hi = regions.tile_bounds(f, tq, causal, window)
    q_plain = q.float()
    q_rot = matmul(q_plain, rotation_matrix(d, q.device) if rot is None else rot)
    tensors = [*_tile_tensors(f.k), *_tile_tensors(f.v)]
    bias = _tile_bias(mask, s, n_max * g, (bsz, hq, tq))
    frames = f.k_plain is not None
    return (q_rot, q_plain if frames else None, *tensors, f.k_plain, f.n_tiles, kv_lo, kv_hi, bias)


def tile_partials(q_rot, q_plain, k_codes, k_row_scale, k_row_zero, k_col_scale,
                  v_codes, v_row_scale, v_row_zero, v_col_scale, k_plain, n_tiles, kv_lo,
                  kv_hi, bias, scale: float, split_max: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-scale attention partials over every packed tile slot, static shapes (one split).

    The reference of ``kvarn::tile_partials_`` and of its Triton templates: returns (o_part
    fp32 [B, Hq, Tq, SPLIT_MAX, Dv], lse_part fp32 [B, Hq, Tq, SPLIT_MAX]); split 0 holds
    the whole region, the others are empty (o = 0, lse = -inf). Scores, in the rotated
    frame (or with the un-rotated ``q_plain`` for a tile whose ``k_plain`` flag is set)::

        s[t] = scale * cs_k[t] * ((q * rs_k) @ code_k[:, t] + q @ rz_k)
        o[c] = cs_v[c] * ((p * rs_v) @ code_v[:, c] + p @ rz_v) / sum(p)
    """
    bsz, hq, tq, d = q_rot.shape
    heads, n_max = k_codes.shape[1], k_codes.shape[2]
    g, dv = k_col_scale.shape[-1], v_col_scale.shape[-1]
    kb, vb = 8 * k_codes.shape[-1] // g, 8 * v_codes.shape[-1] // dv
    grp = hq // heads
    q_t = query_frames(q_rot.reshape(bsz, heads, grp, tq, d),
                       None if q_plain is None else q_plain.reshape(bsz, heads, grp, tq, d), k_plain)
    scores = tile_scores(q_t, k_codes, k_row_scale, k_row_zero, k_col_scale, kb) * scale
    j = torch.arange(n_max * g, device=q_rot.device)
    visible = ((j[None, None, :] >= kv_lo[:, :, None]) & (j[None, None, :] < kv_hi[:, :, None])
               & (j[None, None, :] < (n_tiles * g)[:, None, None]))               # [B,Tq,N*G]
    if bias is not None:
        scores = scores + regions.additive(bias).expand(bsz, hq, tq, n_max * g).reshape(scores.shape)
    scores = scores.masked_fill(~visible[:, None, None], regions.NEG_INF)
    p, denom, m_ref = regions.safe_lse(scores)
    p, lse = regions.normalized(p, denom, m_ref)
    out = tile_values(p, v_codes, v_row_scale, v_row_zero, v_col_scale, vb)   # [B,H,g,Tq,Dv]
    out = out.reshape(bsz, hq, tq, 1, dv)
    lse = lse.reshape(bsz, hq, tq, 1)
    if split_max > 1:
        out = torch.cat([out, out.new_zeros(bsz, hq, tq, split_max - 1, dv)], 3)
        lse = torch.cat([lse, lse.new_full((bsz, hq, tq, split_max - 1), regions.NEG_INF)], 3)
    return out, lse


def _factored(scale: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """A tile scale with its fp8 per-vector factor [.., 1] applied (fp32), or as stored."""
    return scale if factor is None else scale.float() * factor.float()


def latent_tile_partials(q_rot, q_plain, q_pe_rot, k_codes, k_row_scale, k_row_zero, k_col_scale,
                         v_codes, v_row_scale, v_row_zero, v_col_scale, k_row_factor,
                         k_col_factor, v_row_factor, v_col_factor, tile_ids, tile_count, n_tiles,
                         kv_lo, kv_hi, bias, scale: float, split_max: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent attention partials over every packed tile slot of a latent state, per key
    frame, static shapes (one split).

    The reference of ``kvarn::latent_tile_partials_`` and of its Triton template (the
    launcher ``kernels/triton/latent_attention.latent_tile_partials`` computes the same with
    SPLIT splits). Arguments (:data:`LATENT_TILE_ARGS`): q_rot fp32 [B, Hq, Tq, D] (q @ H_D),
    q_plain the un-rotated queries (key frames only), q_pe_rot [B, Hq, Tq, Dv] (q_pe @ H_Dv);
    the latent tiles (the state's K tiles) and the RoPE-key tiles (its V tiles); the fp8
    scales' per-vector factors [B, H, N, 1] or None; tile_ids int [B, H, 2, N] and
    tile_count [B, H, 2] (key frames only: frame f covers the tiles
    ``tile_ids[b, h, f, :tile_count[b, h, f]]``, ``frame_tile_lists`` of the state's
    ``k_plain``; they must be below n_tiles); n_tiles [B]; kv_lo, kv_hi [B, Tq] (query t sees
    tokens kv_lo <= j < kv_hi, ``regions.tile_bounds``); bias [B, Hq or 1, Tq, N * G] or None.

    Returns (o_part fp32 [B, Hq, Tq, NF, SPLIT_MAX, D], lse_part fp32 [B, Hq, Tq, NF,
    SPLIT_MAX]); NF = 2 with key frames (frame 0: the rotated tiles with q_rot, output in
    the rotated frame; frame 1: the plain tiles with q_plain, output un-rotated), else 1
    (every tile with q_rot). Split 0 holds the frame's whole region, the others are empty
    (o = 0, lse = -inf); each frame's partial is normalized by its own softmax sum::

        s[t] = scale * (cs_k[t] * ((q * rs_k) @ code_k[:, t] + q @ rz_k)
                        + rs_v[t] * ((q_pe * cs_v) @ code_v[t, :]) + rz_v[t] * sum(q_pe * cs_v))
        o[c] = sum_t p[t] * (code_k[c, t] * rs_k[c] + rz_k[c]) * cs_k[t] / sum(p)
    """
    bsz, hq, tq, d = q_rot.shape
    heads, n_max = k_codes.shape[1], k_codes.shape[2]
    g, dv = k_col_scale.shape[-1], v_col_scale.shape[-1]
    kb, vb = 8 * k_codes.shape[-1] // g, 8 * v_codes.shape[-1] // dv
    grp = hq // heads
    krs, kcs = _factored(k_row_scale, k_row_factor), _factored(k_col_scale, k_col_factor)
    vrs, vcs = _factored(v_row_scale, v_row_factor), _factored(v_col_scale, v_col_factor)
    pe = q_pe_rot.float().reshape(bsz, heads, grp, tq, 1, dv)
    rope = tile_value_scores(pe, v_codes, vrs, v_row_zero, vcs, vb)               # [B,H,g,Tq,N*G]
    j = torch.arange(n_max * g, device=q_rot.device)
    visible = ((j[None, None, :] >= kv_lo[:, :, None]) & (j[None, None, :] < kv_hi[:, :, None])
               & (j[None, None, :] < (n_tiles * g)[:, None, None]))[:, None, None]  # [B,1,1,Tq,N*G]
    if bias is not None:
        bias = regions.additive(bias).expand(bsz, hq, tq, n_max * g).reshape(rope.shape)
    frames = [q_rot] if tile_ids is None else [q_rot, q_plain]
    member = None
    if tile_ids is not None:      # membership [B, H, 2, N] from the per-frame tile lists
        listed = torch.arange(n_max, device=q_rot.device) < tile_count[..., None]
        member = torch.zeros(bsz, heads, 2, n_max, dtype=torch.int32, device=q_rot.device)
        member = member.scatter_add(-1, tile_ids.long(), listed.int()) > 0
    outs, lses = [], []
    for frame, q_f in enumerate(frames):
        q_t = q_f.float().reshape(bsz, heads, grp, tq, 1, d)
        scores = (tile_scores(q_t, k_codes, krs, k_row_zero, kcs, kb) + rope) * scale
        if bias is not None:
            scores = scores + bias
        seen = visible
        if member is not None:
            seen = seen & member[:, :, frame].repeat_interleave(g, -1)[:, :, None, None, :]
        scores = scores.masked_fill(~seen, regions.NEG_INF)
        p, denom, m_ref = regions.safe_lse(scores)
        p, lse = regions.normalized(p, denom, m_ref)
        out = tile_key_values(p, k_codes, krs, k_row_zero, kcs, kb).sum(-2)      # [B,H,g,Tq,D]
        outs.append(out.reshape(bsz, hq, tq, 1, d))
        lses.append(lse.reshape(bsz, hq, tq, 1))
    out = torch.stack(outs, 3)                                                    # [B,Hq,Tq,NF,1,D]
    lse = torch.stack(lses, 3)
    if split_max > 1:
        nf = len(frames)
        out = torch.cat([out, out.new_zeros(bsz, hq, tq, nf, split_max - 1, d)], 4)
        lse = torch.cat([lse, lse.new_full((bsz, hq, tq, nf, split_max - 1), regions.NEG_INF)], 4)
    return out, lse
