"""Pure-torch implementations of the KVarN runtime ops over a packed layer state.

These functions are the eager CPU kernels of ``torch.ops.kvarn.*`` (see ``library.py``),
the oracle of the Triton kernels and the baseline of the benchmarks. They operate on the
flat buffer list described in :mod:`kvarn_compile.state`.

Semantics in one place:

* ``append_(buffers, k, v, start_pos)`` writes T new K/V rows per batch row at positions
  start_pos[b] .. start_pos[b]+T-1. start_pos[b] == 0 starts a new sequence in that row;
  otherwise start_pos[b] must lie in [committed[b], lengths[b]] (rewriting uncommitted
  tokens is a rollback; committed tokens are final). Writing at p accepts (commits) every
  token before p; of the new tokens all but the newest ``hold`` are committed at once
  (hold=0: commit everything, the plain decoding case; hold=k: keep k draft tokens
  revisable for speculative decoding). Complete committed tiles beyond the sink and the
  recent window are then rotated, normalized, quantized and packed in place. Every check
  runs before any write, so a rejected call leaves the state unchanged.
* ``commit_(buffers, upto)`` marks tokens < upto[b] committed and freezes what it can.
* ``attention(q, buffers, ...)`` attends the queries (the last Tq written tokens of each
  row) over [sink, tiles, tail] without materializing dequantized K/V: per tile, the key
  row scale is folded into q, the key column scale into the scores, the value row scale
  into the softmax weights and the value column scale into the output, and the rotation
  is applied to q on the way in and undone on the output.
"""

from __future__ import annotations

import torch

from kvarn_compile.reference.quantize import NonFiniteError, quantize_kv, unpack_codes
from kvarn_compile.reference.rotation import rotation_matrix
from kvarn_compile.state import BUF, has_fp8_factors, key_plain

__all__ = ["append_", "commit_", "crop_", "attention", "materialize", "check_append",
           "check_method", "check_range", "split_method", "TILE_CHUNK"]

#: Tiles processed at once by the reference attention (bounds its scratch memory).
TILE_CHUNK = 64


def _b(buffers: list[torch.Tensor], name: str) -> torch.Tensor:
    return buffers[BUF[name]]


def _bits(buffers: list[torch.Tensor]) -> tuple[int, int]:
    g = _b(buffers, "k_col_scale").shape[-1]
    d = _b(buffers, "sink_k").shape[-1]
    return 8 * _b(buffers, "k_codes").shape[-1] // g, 8 * _b(buffers, "v_codes").shape[-1] // d


def _geometry(buffers: list[torch.Tensor]) -> tuple[int, int, int, int]:
    """(S, G, n_max, W)."""
    return (_b(buffers, "sink_k").shape[2], _b(buffers, "k_col_scale").shape[-1],
            _b(buffers, "k_codes").shape[2], _b(buffers, "tail_k").shape[2])


# ------------------------------------------------------------------------------ append
def split_method(method: str) -> tuple[str, str]:
    """(quantizer method, clip) from an op method string such as ``"kvarn+clip"``
    (:attr:`KVarNConfig.op_method`)."""
    base, _, option = method.partition("+")
    return base, ("mse" if option == "clip" else "none" if option == "" else option)


def check_method(method: str) -> None:
    """Raise unless ``method`` fills tiles the runtime ops can read.

    ``attention`` and ``materialize`` read values in the rotated frame (they un-rotate the
    output). ``kivi`` values are quantized in the original frame, so the packed cache would
    silently decode them wrong; the buffers carry no method to tell.
    """
    base, clip = split_method(method)
    if clip not in ("none", "mse"):
        raise ValueError(f"KVarN runtime cache: expected a method such as 'kvarn' or 'kvarn+clip', "
                         f"but got {method!r}.")
    if base not in ("kvarn", "hadamard"):
        raise ValueError(
            f"KVarN runtime cache: expected method 'kvarn' or 'hadamard', but got {method!r}. The "
            "packed cache reads every tile in the rotated frame; evaluate KIVI with "
            "kvarn_compile.reference.quantize_cache or fake_quantize instead.")


def check_append(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                 start_pos: torch.Tensor, recent: int, hold: int, name: str = "") -> None:
    """Raise a ValueError describing the first problem with an append; mutate nothing."""
    where = f" in {name}" if name else ""
    sink_k = _b(buffers, "sink_k")
    bsz, heads, _, d = sink_k.shape
    s, g, n_max, w = _geometry(buffers)
    expected = (bsz, heads, k.shape[2] if k.dim() == 4 else -1, d)
    for label, x in (("keys", k), ("values", v)):
        if x.dim() != 4 or tuple(x.shape) != expected or x.shape[2] < 1:
            raise ValueError(f"KVarN append{where}: expected {label} shaped [batch={bsz}, "
                             f"kv_heads={heads}, tokens>=1, head_dim={d}], but got {tuple(x.shape)}.")
        if not x.is_floating_point():
            raise ValueError(f"KVarN append{where}: expected floating-point {label}, but got {x.dtype}.")
        if x.device != sink_k.device:
            raise ValueError(f"KVarN append{where}: expected {label} on {sink_k.device} like the "
                             f"cache, but got {x.device}. Move the cache or the model.")
    if tuple(start_pos.shape) != (bsz,) or start_pos.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"KVarN append{where}: expected start_pos as an int tensor of shape "
                         f"[{bsz}], but got {start_pos.dtype} {tuple(start_pos.shape)}.")
    t = k.shape[2]
    capacity = int(_b(buffers, "capacity")[0])
    lengths, committed, n_tiles = (_b(buffers, n).tolist() for n in ("lengths", "committed", "n_tiles"))
    for row, p0 in enumerate(start_pos.tolist()):
        length, done = (0, 0) if p0 == 0 else (lengths[row], committed[row])
        tiles = 0 if p0 == 0 else n_tiles[row]
        if p0 < 0 or p0 > length:
            raise ValueError(f"KVarN append{where}: batch row {row} writes at position {p0}, but it "
                             f"holds {lengths[row]} tokens; positions must follow on without gaps "
                             "(or be 0 to start a new sequence).")
        if p0 < done:
            raise ValueError(f"KVarN append{where}: batch row {row} writes at position {p0}, but "
                             f"tokens < {done} are committed and cannot be written twice. Write at "
                             f"position {length} to continue, or 0 to start a new sequence.")
        end = p0 + t
        if end > capacity:
            raise ValueError(f"KVarN append{where}: batch row {row} would hold {end} tokens, but the "
                             f"cache was allocated for {capacity}. Allocate it with a larger max_len "
                             "(KVarNCache: max_cache_len).")
        committed_after = max(done, p0, end - max(hold, 0))
        frozen_end = s + tiles * g
        tiles_after = tiles + max(committed_after - frozen_end - recent, 0) // g if end > s else tiles
        tiles_after = min(tiles_after, n_max)
        in_tail = end - max(s + tiles_after * g, s)
        if in_tail > w:
            raise ValueError(f"KVarN append{where}: batch row {row} would keep {in_tail} tokens in the "
                             f"{w}-slot high-precision tail (only committed tokens are quantized). "
                             "Commit tokens, or allocate the cache with more spec_tokens.")


_FP16_MAX = 65504.0


def check_range(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                start_pos: torch.Tensor, name: str = "") -> None:
    """Raise a ValueError when new K/V would overflow a float16 high-precision sink/tail.

    fp32 models keep sink and tail in float16 by default (exact_dtype="auto"), so a finite
    fp32 value beyond 65504 would silently become inf there. (Tile scales that overflow
    float16 are caught when the tile is quantized, see ``_freeze``.) Non-finite values
    are the NaN/inf policy's business, not this check's.
    """
    if _b(buffers, "tail_k").dtype != torch.float16 or k.dtype == torch.float16:
        return
    peak = torch.maximum(torch.nan_to_num(k.float().abs(), nan=0.0, posinf=0.0).amax(-1),
                         torch.nan_to_num(v.float().abs(), nan=0.0, posinf=0.0).amax(-1))
    over = peak > _FP16_MAX
    if bool(over.any()):
        row, head, t = over.nonzero()[0].tolist()
        where = f" in {name}" if name else ""
        raise ValueError(
            f"KVarN append{where}: batch row {row}, kv head {head}, position "
            f"{int(start_pos[row]) + t} holds |x| = {float(peak[row, head, t]):.3g}, beyond the "
            "float16 high-precision sink/tail (exact_dtype='auto' keeps fp32 models' sink and "
            "tail in fp16). Expected smaller keys/values, or allocate the cache with "
            "KVarNConfig(exact_dtype='float32', scale_dtype='float32'). The cache was left unchanged.")


def _use_triton() -> bool:
    from kvarn_compile.kernels import triton_available

    return triton_available()


def _freeze(buffers: list[torch.Tensor], row: int, tokens_k: torch.Tensor,
            tokens_v: torch.Tensor, first_tile: int, method: str, iters: int,
            check: bool, name: str) -> None:
    """Quantize [H, f*G, D] token-major K/V of one batch row into tile slots first_tile.."""
    g = _b(buffers, "k_col_scale").shape[-1]
    kb, vb = _bits(buffers)
    f = tokens_k.shape[1] // g
    scale_dtype = _b(buffers, "k_row_scale").dtype
    if _b(buffers, "k_row_scale").dtype == torch.float8_e4m3fn:
        scale_dtype = torch.float8_e4m3fn
    frames = key_plain(buffers)
    method, clip = split_method(method)
    sl = slice(first_tile, first_tile + f)
    s_len = _b(buffers, "sink_k").shape[2]
    s_pos = lambda tile: s_len + tile * g  # noqa: E731
    quantized = {}
    if tokens_k.is_cuda and not check and clip == "none" and _use_triton():
        from kvarn_compile.ops.kernel_impl import freeze_tiles

        if freeze_tiles(buffers, row, tokens_k, tokens_v, first_tile, method, iters):
            return
    for kind, bits, x in (("k", kb, tokens_k), ("v", vb, tokens_v)):
        try:
            q = quantize_kv(x, kind, method=method, bits=bits, group=g, iters=iters,
                            scale_dtype=scale_dtype, check_finite=check,
                            key_frame="auto" if frames is not None else "rotated", clip=clip)
        except NonFiniteError as err:
            raise NonFiniteError(f"{name or 'KVarN cache'}, batch row {row}, tokens of tiles "
                                 f"{first_tile}..{first_tile + f - 1}: {err}") from None
        # Non-finite tokens are stored as NaN, never inf: an inf scale is an overflow of
        # the scale dtype (e.g. |x| ~ 1e10 with float16 scales).
        if any(bool(torch.isinf(t.float()).any()) for t in q.tensors()[1:] if t.is_floating_point()):
            raise ValueError(
                f"KVarN append{' in ' + name if name else ''}: batch row {row}, tiles "
                f"{first_tile}..{first_tile + f - 1} (positions {s_pos(first_tile)}..."
                f"{s_pos(first_tile + f) - 1}): the {kind.upper()} scales overflow "
                f"{scale_dtype} (largest |x| {float(x.float().abs().nan_to_num(0, 0, 0).max()):.3g}). "
                "Expected smaller keys/values, or allocate the cache with "
                "KVarNConfig(scale_dtype='bfloat16') or 'float32'. The cache was left unchanged.")
        quantized[kind] = q
    for kind in ("k", "v"):
        q = quantized[kind]
        _b(buffers, f"{kind}_codes")[row, :, sl] = q.codes
        _b(buffers, f"{kind}_row_scale")[row, :, sl] = q.row_scale
        _b(buffers, f"{kind}_row_zero")[row, :, sl] = q.row_zero
        _b(buffers, f"{kind}_col_scale")[row, :, sl] = q.col_scale
        if has_fp8_factors(buffers):
            _b(buffers, f"{kind}_row_factor")[row, :, sl] = q.row_scale_factor
            _b(buffers, f"{kind}_col_factor")[row, :, sl] = q.col_scale_factor
        if kind == "k" and frames is not None:
            frames[row, :, sl] = q.plain


def _tail_tokens(buffers: list[torch.Tensor], row: int, start: int, end: int, which: str) -> torch.Tensor:
    """Tokens [start, end) of a row read from the tail ring: [H, end-start, D]."""
    s, _, _, w = _geometry(buffers)
    slots = (torch.arange(start, end, device=_b(buffers, "tail_k").device) - s) % w
    return _b(buffers, which)[row][:, slots]


def _place(buffers: list[torch.Tensor], row: int, k_new: torch.Tensor, v_new: torch.Tensor,
           p0: int, recent: int, commit_to: int, method: str, iters: int, check: bool,
           name: str) -> None:
    """Write one row's new tokens, update its counters and freeze complete tiles."""
    s, g, n_max, w = _geometry(buffers)
    lengths, committed, n_tiles = (_b(buffers, n) for n in ("lengths", "committed", "n_tiles"))
    t = k_new.shape[1]
    if p0 == 0 and t > 0:
        lengths[row] = committed[row] = n_tiles[row] = 0
    end = p0 + t
    tiles = int(n_tiles[row])
    frozen_end = s + tiles * g
    # tokens that belong after the frozen region: old tail tokens [frozen_end, p0) + new ones
    new_from = max(p0, s)
    # New tokens are rounded to the tail's (high-precision) dtype before anything else, so a
    # token quantizes to the same codes whether it reached its tile through the tail ring
    # (decode) or straight from a prefill chunk: the packed state does not depend on chunking.
    exact = _b(buffers, "tail_k").dtype
    old_k = _tail_tokens(buffers, row, frozen_end, max(new_from, frozen_end), "tail_k") \
        if new_from > frozen_end else k_new[:, :0].to(exact)
    old_v = _tail_tokens(buffers, row, frozen_end, max(new_from, frozen_end), "tail_v") \
        if new_from > frozen_end else v_new[:, :0].to(exact)
    seg_k = torch.cat([old_k, k_new[:, new_from - p0:].to(exact)], 1)
    seg_v = torch.cat([old_v, v_new[:, new_from - p0:].to(exact)], 1)
    done = min(max(int(committed[row]), commit_to), end)
    freeze = min(max(done - frozen_end - recent, 0) // g, n_max - tiles) if end > s else 0
    if freeze:   # first: it may raise (scale overflow) before anything of this row is written
        _freeze(buffers, row, seg_k[:, :freeze * g], seg_v[:, :freeze * g], tiles, method,
                iters, check, name)
    if p0 < s:   # sink part
        stop = min(end, s)
        _b(buffers, "sink_k")[row, :, p0:stop] = k_new[:, :stop - p0]
        _b(buffers, "sink_v")[row, :, p0:stop] = v_new[:, :stop - p0]
    keep_from = frozen_end + freeze * g
    keep_k, keep_v = seg_k[:, freeze * g:], seg_v[:, freeze * g:]
    if keep_k.shape[1]:
        slots = (torch.arange(keep_from, end, device=keep_k.device) - s) % w
        _b(buffers, "tail_k")[row][:, slots] = keep_k
        _b(buffers, "tail_v")[row][:, slots] = keep_v
    lengths[row] = end
    committed[row] = done
    n_tiles[row] = tiles + freeze


def append_(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
            start_pos: torch.Tensor, method: str = "kvarn", iters: int = 8, recent: int = 0,
            hold: int = 0, check_finite: bool = False, name: str = "") -> None:
    """Write new K/V [B, H, T, D] at start_pos [B]; freeze complete committed tiles."""
    check_method(method)
    check_append(buffers, k, v, start_pos, recent, hold, name)
    check_range(buffers, k, v, start_pos, name)
    # validate every value before writing anything (check mode): nothing lost on error
    if check_finite and not bool(torch.isfinite(k).all() & torch.isfinite(v).all()):
        bad = (~torch.isfinite(k).all(-1) | ~torch.isfinite(v).all(-1)).nonzero()[0].tolist()
        raise NonFiniteError(
            f"{name or 'KVarN cache'}: NaN/inf in the new keys/values at batch row {bad[0]}, "
            f"kv head {bad[1]}, token position {int(start_pos[bad[0]]) + bad[2]}. Expected finite "
            "values; the cache was left unchanged. Disable check_finite to store such tokens as NaN.")
    counters = [_b(buffers, n).clone() for n in ("lengths", "committed", "n_tiles")]
    try:
        for row, p0 in enumerate(start_pos.tolist()):
            commit_to = max(p0, p0 + k.shape[2] - max(hold, 0))
            _place(buffers, row, k[row], v[row], p0, recent, commit_to, method, iters,
                   check_finite, name)
    except ValueError:
        # A tile of a later row could not be stored (its scales overflow): earlier rows are
        # rolled back by their counters (what they wrote lies past their lengths/tiles).
        for n, before in zip(("lengths", "committed", "n_tiles"), counters):
            _b(buffers, n).copy_(before)
        raise


def commit_(buffers: list[torch.Tensor], upto: torch.Tensor, method: str = "kvarn",
            iters: int = 8, recent: int = 0, check_finite: bool = False, name: str = "") -> None:
    """Commit tokens < upto[b] of every row (clamped to what is written) and freeze tiles."""
    check_method(method)
    lengths = _b(buffers, "lengths")
    if tuple(upto.shape) != tuple(lengths.shape):
        raise ValueError(f"KVarN commit: expected upto shaped {tuple(lengths.shape)}, but got "
                         f"{tuple(upto.shape)}.")
    _, _, _, d = _b(buffers, "sink_k").shape
    empty = _b(buffers, "tail_k")[0, :, :0]
    for row, p in enumerate(upto.tolist()):
        length = int(lengths[row])
        p = min(p, length)
        if p <= int(_b(buffers, "committed")[row]):
            continue
        # re-place nothing new: a zero-token write at the row's end with a new commit point
        _place(buffers, row, empty, empty, length, recent, p, method, iters, check_finite, name)


def crop_(buffers: list[torch.Tensor], new_lengths: torch.Tensor) -> None:
    """Roll rows back to new_lengths[b] tokens (tokens in quantized tiles cannot go back)."""
    s, g, _, _ = _geometry(buffers)
    lengths, committed, n_tiles = (_b(buffers, n) for n in ("lengths", "committed", "n_tiles"))
    frozen_end = torch.where(n_tiles > 0, s + n_tiles * g, torch.zeros_like(n_tiles))
    if bool((new_lengths < frozen_end).any()) or bool((new_lengths < 0).any()):
        row = int((new_lengths < frozen_end).nonzero()[0]) if bool((new_lengths < frozen_end).any()) else 0
        raise ValueError(
            f"KVarN crop: batch row {row} would go back to {int(new_lengths[row])} tokens, but tokens "
            f"< {int(frozen_end[row])} are already quantized into tiles. Expected a length >= "
            f"{int(frozen_end[row])}; keep speculative tokens uncommitted (hold / spec_tokens) or "
            "use recent_window so rollbacks stay in the high-precision tail.")
    new = torch.minimum(new_lengths.to(lengths), lengths)
    lengths.copy_(new)
    committed.copy_(torch.minimum(committed, new))


def materialize(buffers: list[torch.Tensor], rotated_tiles: bool = False,
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized K/V [B, H, max_len, D] (zeros past each row's length). Test oracle only.

    This is exactly what the runtime never builds; tests compare the fused attention
    against plain attention over these tensors.
    """
    from kvarn_compile.reference.quantize import QuantizedTiles, dequantize_kv

    s, g, n_max, w = _geometry(buffers)
    sink_k = _b(buffers, "sink_k")
    bsz, heads, _, d = sink_k.shape
    cap = int(_b(buffers, "capacity")[0])
    pos, ok, _ = _positions(buffers)
    out = []
    fp8 = has_fp8_factors(buffers)
    kb, vb = _bits(buffers)
    for kind, bits in (("k", kb), ("v", vb)):
        full = torch.zeros(bsz, heads, cap + w, d, device=sink_k.device)
        parts = [_b(buffers, f"sink_{kind}").float()]
        if n_max:
            tiles = QuantizedTiles(
                codes=_b(buffers, f"{kind}_codes"), row_scale=_b(buffers, f"{kind}_row_scale"),
                row_zero=_b(buffers, f"{kind}_row_zero"), col_scale=_b(buffers, f"{kind}_col_scale"),
                bits=bits, row_scale_factor=_b(buffers, f"{kind}_row_factor") if fp8 else None,
                col_scale_factor=_b(buffers, f"{kind}_col_factor") if fp8 else None,
                plain=key_plain(buffers) if kind == "k" else None)
            parts.append(dequantize_kv(tiles, kind, rotated=not rotated_tiles))
        parts.append(_b(buffers, f"tail_{kind}").float())
        vals = torch.cat(parts, 2)                                          # [B,H,L,D]
        idx = torch.where(ok, pos, torch.full_like(pos, cap + w - 1))
        full.scatter_(2, idx[:, None, :, None].expand(bsz, heads, -1, d),
                      torch.where(ok[:, None, :, None], vals, torch.zeros_like(vals)))
        out.append(full[:, :, :cap].to(dtype or sink_k.dtype))
    return out[0], out[1]


# ------------------------------------------------------------------------------ attention
def _positions(buffers: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Absolute positions [B, L] and validity [B, L] of every key slot, and slot kinds.

    Slots are ordered sink (S), tiles (n_max * G), tail (W).
    """
    s, g, n_max, w = _geometry(buffers)
    lengths, n_tiles = _b(buffers, "lengths"), _b(buffers, "n_tiles")
    dev = lengths.device
    sink_pos = torch.arange(s, device=dev).expand(lengths.shape[0], s)
    sink_ok = sink_pos < lengths[:, None]
    tile_pos = (s + torch.arange(n_max * g, device=dev)).expand(lengths.shape[0], n_max * g)
    tile_ok = torch.arange(n_max * g, device=dev)[None, :] < (n_tiles * g)[:, None]
    base = s + n_tiles * g                                        # first tail position [B]
    slot = torch.arange(w, device=dev)[None, :]
    tail_pos = base[:, None] + (slot - (base[:, None] - s)) % w
    tail_ok = (tail_pos < lengths[:, None]) & (lengths[:, None] > s)
    return (torch.cat([sink_pos, tile_pos, tail_pos], 1), torch.cat([sink_ok, tile_ok, tail_ok], 1),
            torch.tensor([s, n_max * g, w]))


def _scales(buffers: list[torch.Tensor], kind: str, sl: slice) -> tuple[torch.Tensor, ...]:
    rs = _b(buffers, f"{kind}_row_scale")[:, :, sl].float()
    cs = _b(buffers, f"{kind}_col_scale")[:, :, sl].float()
    if has_fp8_factors(buffers):
        rs = rs * _b(buffers, f"{kind}_row_factor")[:, :, sl].float()
        cs = cs * _b(buffers, f"{kind}_col_factor")[:, :, sl].float()
    return rs, _b(buffers, f"{kind}_row_zero")[:, :, sl].float(), cs


def _tile_scores(buffers: list[torch.Tensor], q_rot: torch.Tensor, sl: slice, kb: int,
                 q_plain: torch.Tensor) -> torch.Tensor:
    """Scores of rotated queries [B,H,g,Tq,D] against tiles sl: [B,H,g,Tq,n*G].

    s[t] = col_scale[t] * (sum_c (q[c] * row_scale[c]) * code[c, t] + sum_c q[c] * row_zero[c])
    with q the rotated query, or the un-rotated ``q_plain`` for tiles stored plain.
    """
    codes = unpack_codes(_b(buffers, "k_codes")[:, :, sl], kb).float()    # [B,H,n,D,G]
    rs, rz, cs = _scales(buffers, "k", sl)                                # [B,H,n,D] x2, [B,H,n,G]
    q_t = q_rot.unsqueeze(-2)                                             # [B,H,g,Tq,1,D]
    frames = key_plain(buffers)
    if frames is not None:                                                # per-tile frame
        plain = frames[:, :, sl].bool()[:, :, None, None, :, None]        # [B,H,1,1,n,1]
        q_t = torch.where(plain, q_plain.unsqueeze(-2), q_t)              # [B,H,g,Tq,n,D]
    qs = q_t * rs[:, :, None, None]                                       # [B,H,g,Tq,n,D]
    dot = torch.einsum("bhgqnd,bhndt->bhgqnt", qs, codes)
    bias = torch.einsum("bhgqnd,bhnd->bhgqn", q_t.expand_as(qs), rz).unsqueeze(-1)
    out = (dot + bias) * cs[:, :, None, None]
    return out.flatten(-2)


def _tile_values(buffers: list[torch.Tensor], p: torch.Tensor, sl: slice, vb: int) -> torch.Tensor:
    """Rotated-frame output of weights p [B,H,g,Tq,n*G] over value tiles sl: [B,H,g,Tq,D].

    o[c] = sum_tiles col_scale[c] * (sum_t (p[t] * row_scale[t]) * code[t, c] + sum_t p[t] * row_zero[t])
    """
    codes = unpack_codes(_b(buffers, "v_codes")[:, :, sl], vb).float()    # [B,H,n,G,D]
    rs, rz, cs = _scales(buffers, "v", sl)                                # [B,H,n,G] x2, [B,H,n,D]
    p = p.unflatten(-1, (codes.shape[2], codes.shape[3]))                 # [B,H,g,Tq,n,G]
    weighted = torch.einsum("bhgqnt,bhntd->bhgqnd", p * rs[:, :, None, None], codes)
    bias = (p * rz[:, :, None, None]).sum(-1, keepdim=True)
    return ((weighted + bias) * cs[:, :, None, None]).sum(-2)


def attention(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None = None,
              scale: float | None = None, causal: bool = True, window: int = 0, *,
              tiles: bool = True, return_lse: bool = False):
    """Attention of q [B, Hq, Tq, D] (the last Tq written tokens) over the packed cache.

    mask: optional bool (True = attend) or additive float, broadcastable to
    [B, Hq, Tq, M] and indexed by absolute key position (M must exceed every position).
    window > 0 keeps keys with position > query position - window (sliding window).
    Queries that can see no key get a zero output. Returns [B, Hq, Tq, D] in q's dtype.

    ``tiles=False`` attends the exact regions (sink and tail) only and, with
    ``return_lse``, also returns the fp32 log-sum-exp [B, Hq, Tq] of the scaled scores, so
    a kernel over the packed tiles can be merged in (see ``ops/kernel_impl.py``).
    """
    sink_k = _b(buffers, "sink_k")
    bsz, heads, _, d = sink_k.shape
    if q.dim() != 4 or q.shape[0] != bsz or q.shape[-1] != d or q.shape[1] % heads:
        raise ValueError(f"KVarN attention: expected queries [batch={bsz}, heads=k*{heads}, tq, "
                         f"head_dim={d}], but got {tuple(q.shape)}.")
    hq, tq = q.shape[1], q.shape[2]
    grp = hq // heads
    s, g, n_max, w = _geometry(buffers)
    kb, vb = _bits(buffers)
    scale = d ** -0.5 if scale is None else scale
    lengths = _b(buffers, "lengths")
    n_used = int(_b(buffers, "n_tiles").max()) if n_max and tiles else 0

    qg = q.float().reshape(bsz, heads, grp, tq, d)
    q_rot = qg @ rotation_matrix(d, q.device)
    pos, ok, _ = _positions(buffers)
    keep = n_used * g
    pos = torch.cat([pos[:, :s], pos[:, s:s + keep], pos[:, s + n_max * g:]], 1)
    ok = torch.cat([ok[:, :s], ok[:, s:s + keep], ok[:, s + n_max * g:]], 1)

    scores = [qg @ sink_k.float().unsqueeze(2).transpose(-1, -2)]
    for start in range(0, n_used, TILE_CHUNK):
        scores.append(_tile_scores(buffers, q_rot, slice(start, min(start + TILE_CHUNK, n_used)), kb, qg))
    scores.append(qg @ _b(buffers, "tail_k").float().unsqueeze(2).transpose(-1, -2))
    scores = torch.cat(scores, -1) * scale                                 # [B,H,g,Tq,L]

    q_pos = lengths[:, None] - tq + torch.arange(tq, device=q.device)[None, :]   # [B,Tq]
    allowed = ok[:, None, :].expand(bsz, tq, -1)
    if causal:
        allowed = allowed & (pos[:, None, :] <= q_pos[:, :, None])
    if window > 0:
        allowed = allowed & (pos[:, None, :] > q_pos[:, :, None] - window)
    allowed = allowed[:, None, None]                                        # [B,1,1,Tq,L]
    if mask is not None:
        m = mask.expand(bsz, hq, tq, mask.shape[-1]).reshape(bsz, heads, grp, tq, -1)
        if int(pos.masked_fill(~ok, 0).max()) >= m.shape[-1]:
            raise ValueError(f"KVarN attention: the mask covers {m.shape[-1]} key positions, but the "
                             f"cache holds up to {int(lengths.max())}; expected a mask as long as the cache.")
        idx = pos.clamp(max=m.shape[-1] - 1)[:, None, None, None, :].expand(bsz, heads, grp, tq, -1)
        picked = m.gather(-1, idx)
        if picked.dtype == torch.bool:
            allowed = allowed & picked
        else:
            scores = scores + picked.float()
    scores = scores.masked_fill(~allowed, float("-inf"))
    peak = scores.amax(-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    p = torch.exp(scores - peak)
    denom = p.sum(-1, keepdim=True)
    lse = (torch.log(denom) + peak).squeeze(-1)                            # -inf where nothing is seen
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))

    p_sink, p_tiles, p_tail = p.split([s, keep, w], -1)
    out = p_sink @ _b(buffers, "sink_v").float().unsqueeze(2) + p_tail @ _b(buffers, "tail_v").float().unsqueeze(2)
    if keep:
        rot = sum(_tile_values(buffers, p_tiles[..., start * g:min(start + TILE_CHUNK, n_used) * g],
                               slice(start, min(start + TILE_CHUNK, n_used)), vb)
                  for start in range(0, n_used, TILE_CHUNK))
        out = out + rot @ rotation_matrix(d, q.device).T
    out = out.reshape(bsz, hq, tq, d)
    if return_lse:
        return out, lse.reshape(bsz, hq, tq)
    return out.to(q.dtype)
