"""The pure-torch reference of the cache-writing ops: ``kvarn::append_``, ``commit_``,
``adopt_``, ``reorder_``, ``positions_start`` (and ``crop_``, ``materialize`` for tests).

These functions are the default implementation of their ``torch.ops.kvarn.*`` op (see
``library.py``; device kernels override them in ``dispatch.py``), the oracle of every
kernel and the baseline of the benchmarks. They are pure torch on any device and never
call a kernel. They operate on the flat buffer list of :mod:`kvarn_compile.state`, read
through :func:`~kvarn_compile.state.unpack`. The attention side is :mod:`.attention`.

Semantics in one place:

* ``append_(buffers, k, v, start_pos)`` writes T new K/V rows per batch row at positions
  start_pos[b] .. start_pos[b]+T-1. start_pos[b] == 0 starts a new sequence in that row;
  otherwise start_pos[b] must lie in [1, lengths[b]]: a write before the end rolls the row
  back to start_pos[b] first (uncommitted tokens just go; committed ones are revised by
  :func:`crop_`: their tile goes back to the tail, dequantized). Writing at p accepts (commits) every
  token before p; of the new tokens all but the newest ``hold`` are committed at once
  (hold=0: commit everything, the plain decoding case; hold=k: keep k draft tokens
  revisable for speculative decoding). Complete committed tiles beyond the sink and the
  recent window are then rotated, normalized, quantized and packed in place
  (:func:`freeze_tiles`). Every check runs before any write, so a rejected call leaves the
  state unchanged.
* ``commit_(buffers, upto)`` marks tokens < upto[b] committed and freezes what it can.
"""

from __future__ import annotations

import torch

from collections.abc import Callable

from kvarn_compile.quant.quantize import NonFiniteError, quantize_kv
from kvarn_compile.state import Geometry, StateFields, unpack

__all__ = ["append_", "commit_", "crop_", "materialize", "check_append", "check_method", "check_range",
           "split_method", "freeze_tiles", "adopt_", "reorder_", "row_order", "positions_start",
           "TileKernel", "OP_METHODS"]

#: A device kernel for tile quantization: ``fn(buffers, row, tokens_k, tokens_v,
#: first_tile, method, iters) -> bool`` quantizes [H, f*G, D] token-major K/V of one batch
#: row into tile slots first_tile.. and returns True, or returns False (nothing written)
#: where it does not apply; the reference quantizer then runs. ``method`` is the quantizer
#: method ("kvarn"); a kernel with a true ``handles_clip`` attribute is also called for op
#: methods with a clip option, and gets the op method ("kvarn+clip").
TileKernel = Callable[[list, int, torch.Tensor, torch.Tensor, int, str, int], bool]


def _geometry(buffers: list[torch.Tensor]) -> tuple[int, int, int, int]:
    """(S, G, n_max, W)."""
    g = Geometry.of(buffers)
    return g.sink, g.group, g.max_tiles, g.tail


# ------------------------------------------------------------------------------ append
def split_method(method: str) -> tuple[str, str]:
    """(quantizer method, clip) from an op method string such as ``"kvarn+clip"``
    (:attr:`KVarNConfig.op_method`)."""
    base, _, option = method.partition("+")
    return base, ("mse" if option == "clip" else "none" if option == "" else option)


#: Every op method :func:`check_method` accepts (the base quantizer, then an optional clip
#: option; the native append kernel takes exactly these and sends anything else to Python).
OP_METHODS = tuple(f"{base}{option}" for base in ("kvarn", "hadamard")
                   for option in ("", "+clip", "+mse", "+none"))


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
            "kvarn_compile.quant.quantize_cache or fake_quantize instead.")


def check_append(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                 start_pos: torch.Tensor, recent: int, hold: int, name: str = "") -> None:
    """Raise a ValueError describing the first problem with an append; mutate nothing."""
    where = f" in {name}" if name else ""
    f = unpack(buffers)
    bsz, heads, _, d = f.sink_k.shape
    s, g, n_max, w = _geometry(buffers)
    t = k.shape[2] if k.dim() == 4 else -1
    for label, x, dim in (("keys", k, d), ("values", v, f.sink_v.shape[-1])):
        if x.dim() != 4 or tuple(x.shape) != (bsz, heads, t, dim) or x.shape[2] < 1:
            raise ValueError(f"KVarN append{where}: expected {label} shaped [batch={bsz}, "
                             f"kv_heads={heads}, tokens>=1 (as the keys), head_dim={dim}], but got "
                             f"{tuple(x.shape)}.")
        if not x.is_floating_point():
            raise ValueError(f"KVarN append{where}: expected floating-point {label}, but got {x.dtype}.")
        if x.device != f.sink_k.device:
            raise ValueError(f"KVarN append{where}: expected {label} on {f.sink_k.device} like the "
                             f"cache, but got {x.device}. Move the cache or the model.")
    if tuple(start_pos.shape) != (bsz,) or start_pos.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"KVarN append{where}: expected start_pos as an int tensor of shape "
                         f"[{bsz}], but got {start_pos.dtype} {tuple(start_pos.shape)}.")
    t = k.shape[2]
    capacity = int(f.capacity[0])
    lengths, committed, n_tiles = f.lengths.tolist(), f.committed.tolist(), f.n_tiles.tolist()
    for row, p0 in enumerate(start_pos.tolist()):
        length, done = (0, 0) if p0 == 0 else (lengths[row], committed[row])
        tiles = 0 if p0 == 0 else n_tiles[row]
        if p0 < 0 or p0 > length:
            raise ValueError(f"KVarN append{where}: batch row {row} writes at position {p0}, but it "
                             f"holds {lengths[row]} tokens; positions must follow on without gaps "
                             "(or be 0 to start a new sequence).")
        if p0 < done:
            # a rewrite of committed tokens (a static cache cropped, then written again): the
            # append first revises the tiles back to p0 (crop_)
            done, tiles = p0, min(tiles, max(p0 - s, 0) // g)
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
    float16 are caught when the tile is quantized, see ``freeze_tiles``.) Non-finite values
    are the NaN/inf policy's business, not this check's.
    """
    if unpack(buffers).tail_k.dtype != torch.float16 or k.dtype == torch.float16:
        return
    # one reduction per tensor first (max |x|, no temporaries); NaN or inf anywhere, or a
    # peak beyond the range, takes the full check below, which sets non-finite values aside
    if all(float(torch.linalg.vector_norm(x, float("inf"))) <= _FP16_MAX for x in (k, v)):
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


def freeze_tiles(buffers: list[torch.Tensor], row: int, tokens_k: torch.Tensor,
            tokens_v: torch.Tensor, first_tile: int, method: str, iters: int,
            check: bool, name: str, tile_kernel: TileKernel | None = None) -> None:
    """Quantize [H, f*G, D] token-major K/V of one batch row into tile slots first_tile..

    ``tile_kernel`` (a device kernel, see :data:`TileKernel`) runs first where given; the
    reference quantizer does the work wherever it declines.
    """
    f = unpack(buffers)
    geo = Geometry.of(f)
    g, kb, vb = geo.group, geo.key_bits, geo.value_bits
    n = tokens_k.shape[1] // g
    scale_dtype = f.k.row_scale.dtype
    op_method, (method, clip) = method, split_method(method)
    sl = slice(first_tile, first_tile + n)
    s_pos = lambda tile: geo.sink + tile * g  # noqa: E731
    if tile_kernel is not None and not check \
            and (clip == "none" or getattr(tile_kernel, "handles_clip", False)) \
            and tile_kernel(buffers, row, tokens_k, tokens_v, first_tile,
                            method if clip == "none" else op_method, iters):
        return
    quantized = {}
    for kind, bits, x in (("k", kb, tokens_k), ("v", vb, tokens_v)):
        try:
            q = quantize_kv(x, kind, method=method, bits=bits, group=g, iters=iters,
                            scale_dtype=scale_dtype, check_finite=check,
                            key_frame="auto" if f.k_plain is not None else "rotated", clip=clip)
        except NonFiniteError as err:
            raise NonFiniteError(f"{name or 'KVarN cache'}, batch row {row}, tokens of tiles "
                                 f"{first_tile}..{first_tile + n - 1}: {err}") from None
        # Non-finite tokens are stored as NaN, never inf: an inf scale is an overflow of
        # the scale dtype (e.g. |x| ~ 1e10 with float16 scales).
        if any(bool(torch.isinf(t.float()).any()) for t in q.tensors()[1:] if t.is_floating_point()):
            raise ValueError(
                f"KVarN append{' in ' + name if name else ''}: batch row {row}, tiles "
                f"{first_tile}..{first_tile + n - 1} (positions {s_pos(first_tile)}..."
                f"{s_pos(first_tile + n) - 1}): the {kind.upper()} scales overflow "
                f"{scale_dtype} (largest |x| {float(x.float().abs().nan_to_num(0, 0, 0).max()):.3g}). "
                "Expected smaller keys/values, or allocate the cache with "
                "KVarNConfig(scale_dtype='bfloat16') or 'float32'. The cache was left unchanged.")
        quantized[kind] = q
    for kind in ("k", "v"):
        q, tiles = quantized[kind], f.tiles(kind)
        tiles.codes[row, :, sl] = q.codes
        tiles.row_scale[row, :, sl] = q.row_scale
        tiles.row_zero[row, :, sl] = q.row_zero
        tiles.col_scale[row, :, sl] = q.col_scale
        if tiles.row_factor is not None:
            tiles.row_factor[row, :, sl] = q.row_scale_factor
            tiles.col_factor[row, :, sl] = q.col_scale_factor
    if f.k_plain is not None:
        f.k_plain[row, :, sl] = quantized["k"].plain


def _tail_tokens(f: StateFields[torch.Tensor], row: int, start: int, end: int,
                 tail: torch.Tensor) -> torch.Tensor:
    """Tokens [start, end) of a row read from a tail ring (``f.tail_k``/``f.tail_v``): [H, end-start, D]."""
    s, w = f.sink_k.shape[2], f.tail_k.shape[2]
    slots = (torch.arange(start, end, device=tail.device) - s) % w
    return tail[row][:, slots]


def _place(buffers: list[torch.Tensor], row: int, k_new: torch.Tensor, v_new: torch.Tensor,
           p0: int, recent: int, commit_to: int, method: str, iters: int, check: bool,
           name: str, tile_kernel: TileKernel | None = None,
           freeze_fn: Callable[..., None] | None = None) -> None:
    """Write one row's new tokens, update its counters and freeze complete tiles.

    ``freeze_fn`` (default :func:`freeze_tiles`, same arguments) stores the tiles that freeze: a
    context-parallel rank stores only the tiles it owns (``kvarn_compile.ops.context_parallel``).
    """
    f = unpack(buffers)
    s, g, n_max, w = _geometry(buffers)
    lengths, committed, n_tiles = f.lengths, f.committed, f.n_tiles
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
    exact = f.tail_k.dtype
    if new_from > frozen_end:
        old_k = _tail_tokens(f, row, frozen_end, new_from, f.tail_k)
        old_v = _tail_tokens(f, row, frozen_end, new_from, f.tail_v)
    else:
        old_k, old_v = k_new[:, :0].to(exact), v_new[:, :0].to(exact)
    seg_k = torch.cat([old_k, k_new[:, new_from - p0:].to(exact)], 1)
    seg_v = torch.cat([old_v, v_new[:, new_from - p0:].to(exact)], 1)
    done = min(max(int(committed[row]), commit_to), end)
    freeze = min(max(done - frozen_end - recent, 0) // g, n_max - tiles) if end > s else 0
    if freeze:   # first: it may raise (scale overflow) before anything of this row is written
        (freeze_fn or freeze_tiles)(buffers, row, seg_k[:, :freeze * g], seg_v[:, :freeze * g], tiles,
                               method, iters, check, name, tile_kernel)
    if p0 < s:   # sink part
        stop = min(end, s)
        f.sink_k[row, :, p0:stop] = k_new[:, :stop - p0]
        f.sink_v[row, :, p0:stop] = v_new[:, :stop - p0]
    keep_from = frozen_end + freeze * g
    keep_k, keep_v = seg_k[:, freeze * g:], seg_v[:, freeze * g:]
    if keep_k.shape[1]:
        slots = (torch.arange(keep_from, end, device=keep_k.device) - s) % w
        f.tail_k[row][:, slots] = keep_k
        f.tail_v[row][:, slots] = keep_v
    lengths[row] = end
    committed[row] = done
    n_tiles[row] = tiles + freeze


def append_(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
            start_pos: torch.Tensor, method: str = "kvarn", iters: int = 8, recent: int = 0,
            hold: int = 0, check_finite: bool = False, name: str = "", *,
            tile_kernel: TileKernel | None = None,
            freeze_fn: Callable[..., None] | None = None) -> None:
    """Write new K/V [B, H, T, D] at start_pos [B]; freeze complete committed tiles.

    ``tile_kernel``: a device kernel that quantizes the tiles this append freezes (the
    CUDA registration passes the Triton quantizer); None: the reference quantizer.
    ``freeze_fn``: what stores frozen tiles (see :func:`_place`).
    """
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
    f = unpack(buffers)
    back = (start_pos > 0) & (start_pos < f.committed)
    if bool(back.any()):     # writing over committed tokens discards them first
        crop_(buffers, torch.where(back, start_pos.to(f.lengths), f.lengths))
    counters = [c.clone() for c in (f.lengths, f.committed, f.n_tiles)]
    try:
        for row, p0 in enumerate(start_pos.tolist()):
            commit_to = max(p0, p0 + k.shape[2] - max(hold, 0))
            _place(buffers, row, k[row], v[row], p0, recent, commit_to, method, iters,
                   check_finite, name, tile_kernel, freeze_fn)
    except ValueError:
        # A tile of a later row could not be stored (its scales overflow): earlier rows are
        # rolled back by their counters (what they wrote lies past their lengths/tiles).
        for live, before in zip((f.lengths, f.committed, f.n_tiles), counters):
            live.copy_(before)
        raise


def commit_(buffers: list[torch.Tensor], upto: torch.Tensor, method: str = "kvarn",
            iters: int = 8, recent: int = 0, check_finite: bool = False, name: str = "", *,
            tile_kernel: TileKernel | None = None,
            freeze_fn: Callable[..., None] | None = None) -> None:
    """Commit tokens < upto[b] of every row (clamped to what is written) and freeze tiles."""
    check_method(method)
    f = unpack(buffers)
    if tuple(upto.shape) != tuple(f.lengths.shape):
        raise ValueError(f"KVarN commit: expected upto shaped {tuple(f.lengths.shape)}, but got "
                         f"{tuple(upto.shape)}.")
    empty = f.tail_k[0, :, :0]
    for row, p in enumerate(upto.tolist()):
        length = int(f.lengths[row])
        p = min(p, length)
        if p <= int(f.committed[row]):
            continue
        # re-place nothing new: a zero-token write at the row's end with a new commit point
        _place(buffers, row, empty, empty, length, recent, p, method, iters, check_finite, name,
               tile_kernel, freeze_fn)


def crop_(buffers: list[torch.Tensor], new_lengths: torch.Tensor) -> None:
    """Roll rows back to new_lengths[b] tokens (at most what they hold).

    Tokens in the uncommitted tail just go. A crop into the packed tiles *revises* them: the
    tiles wholly past the new length are dropped, and the tokens of the tile the new length
    falls in go back to the high-precision tail dequantized (the values attention already
    read), to be quantized again when that tile fills anew. The ring must hold a tile's worth
    of tokens (``_tail_slots``: always, unless a growable state trimmed it; see
    ``LayerState.crop``).
    """
    f = unpack(buffers)
    s, g, _, w = _geometry(buffers)
    lengths, committed, n_tiles = f.lengths, f.committed, f.n_tiles
    new = torch.minimum(new_lengths.to(lengths), lengths)
    if bool((new < 0).any()):
        row = int((new < 0).nonzero()[0])
        raise ValueError(f"KVarN crop: expected lengths >= 0, but batch row {row} would go back "
                         f"to {int(new[row])} tokens.")
    keep_tiles = torch.clamp(new - s, min=0) // g
    for row in (n_tiles > keep_tiles).nonzero().flatten().tolist():
        n, end = int(keep_tiles[row]), int(new[row])
        first = s + n * g
        if end > first:
            if end - first > w:
                raise ValueError(
                    f"KVarN crop: batch row {row} would move {end - first} tokens of a packed tile "
                    f"back into its {w}-slot tail. Expected a state whose tail holds a whole tile "
                    "(LayerState.crop makes room in a growable one).")
            k, v = _dequantized_tile(f, row, n)
            slots = (torch.arange(first, end, device=k.device) - s) % w
            f.tail_k[row][:, slots] = k[:, :end - first].to(f.tail_k.dtype)
            f.tail_v[row][:, slots] = v[:, :end - first].to(f.tail_v.dtype)
        n_tiles[row] = n
    lengths.copy_(new)
    committed.copy_(torch.minimum(committed, new))


def _dequantized_tile(f: StateFields[torch.Tensor], row: int, tile: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major K/V [H, G, D] (fp32, original frame) of one packed tile of one row."""
    from kvarn_compile.quant.quantize import QuantizedTiles, dequantize_kv

    geo = Geometry.of(f)
    pick = lambda t: None if t is None else t[row, :, tile:tile + 1]  # noqa: E731
    out = []
    for kind, bits in (("k", geo.key_bits), ("v", geo.value_bits)):
        t = f.tiles(kind)
        q = QuantizedTiles(codes=pick(t.codes), row_scale=pick(t.row_scale), row_zero=pick(t.row_zero),
                           col_scale=pick(t.col_scale), bits=bits, row_scale_factor=pick(t.row_factor),
                           col_scale_factor=pick(t.col_factor),
                           plain=pick(f.k_plain) if kind == "k" else None)
        out.append(dequantize_kv(q, kind, rotated=True))
    return out[0], out[1]


def materialize(buffers: list[torch.Tensor], rotated_tiles: bool = False,
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized K [B, H, max_len, D] and V [B, H, max_len, Dv] (zeros past each row's
    length).

    This is what the attention never builds; tests compare the fused attention against
    plain attention over these tensors. At run time only the attention weights a model
    returns (``kvarn::attention_weights``) and a cache handed back to a full-precision
    graph read it.
    """
    from kvarn_compile.quant.quantize import QuantizedTiles, dequantize_kv

    f = unpack(buffers)
    geo = Geometry.of(f)
    bsz, heads, w = geo.batch, geo.kv_heads, geo.tail
    cap = int(f.capacity[0])
    pos, ok = _slot_positions(f)
    out = []
    for kind, bits, d in (("k", geo.key_bits, geo.head_dim), ("v", geo.value_bits, geo.value_head_dim)):
        full = torch.zeros(bsz, heads, cap + w, d, device=f.sink_k.device)
        parts = [getattr(f, f"sink_{kind}").float()]
        if geo.max_tiles:
            t = f.tiles(kind)
            tiles = QuantizedTiles(
                codes=t.codes, row_scale=t.row_scale, row_zero=t.row_zero, col_scale=t.col_scale,
                bits=bits, row_scale_factor=t.row_factor, col_scale_factor=t.col_factor,
                plain=f.k_plain if kind == "k" else None)
            parts.append(dequantize_kv(tiles, kind, rotated=not rotated_tiles))
        parts.append(getattr(f, f"tail_{kind}").float())
        vals = torch.cat(parts, 2)                                          # [B,H,L,D]
        idx = torch.where(ok, pos, torch.full_like(pos, cap + w - 1))
        full.scatter_(2, idx[:, None, :, None].expand(bsz, heads, -1, d),
                      torch.where(ok[:, None, :, None], vals, torch.zeros_like(vals)))
        out.append(full[:, :, :cap].to(dtype or f.sink_k.dtype))
    return out[0], out[1]


def _slot_positions(f: StateFields[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute positions [B, L] and validity [B, L] of every key slot, ordered sink (S),
    tiles (n_max * G), tail (W)."""
    geo = Geometry.of(f)
    s, g, n_max, w = geo.sink, geo.group, geo.max_tiles, geo.tail
    lengths, n_tiles = f.lengths, f.n_tiles
    dev = lengths.device
    sink_pos = torch.arange(s, device=dev).expand(lengths.shape[0], s)
    sink_ok = sink_pos < lengths[:, None]
    tile_pos = (s + torch.arange(n_max * g, device=dev)).expand(lengths.shape[0], n_max * g)
    tile_ok = torch.arange(n_max * g, device=dev)[None, :] < (n_tiles * g)[:, None]
    base = s + n_tiles * g                                        # first tail position [B]
    slot = torch.arange(w, device=dev)[None, :]
    tail_pos = base[:, None] + (slot - (base[:, None] - s)) % w
    tail_ok = (tail_pos < lengths[:, None]) & (lengths[:, None] > s)
    return torch.cat([sink_pos, tile_pos, tail_pos], 1), torch.cat([sink_ok, tile_ok, tail_ok], 1)


# ------------------------------------------------------------------------------ adoption
def adopt_(buffers: list[torch.Tensor], cache_k: torch.Tensor, cache_v: torch.Tensor,
           start_pos: torch.Tensor, method: str, iters: int, recent: int, hold: int,
           check_finite: bool, name: str, fresh: bool, *,
           append: Callable[..., None] | None = None) -> None:
    """Restart the packed sequence with the tokens [0, p) of the model's own cache.

    Runs when the model's cache tensors still hold storage (the graph never writes them;
    a forward that was not compiled did, e.g. transformers' eager prefill under
    ``generate(compile_config=...)``) and this write starts at p > 0. ``fresh``: the
    caller frees the cache after this call, so stored data always belongs to a new
    sequence; otherwise (or for a view the caller cannot free) only a state that does not
    continue at p is restarted. ``append``: the append to use (default :func:`append_`).
    """
    from kvarn_compile.ops.buffers import managed, unchanged_since_seen, unwritten_since_release

    if unwritten_since_release(cache_k) and unwritten_since_release(cache_v):
        return                                       # released, nothing written since (fast path)
    if unchanged_since_seen(cache_k) and unchanged_since_seen(cache_v):
        return                                       # kept, not written since the last call took it in
    starts = start_pos.tolist()
    p = starts[0]
    if p <= 0 or any(s != p for s in starts) or p > cache_k.shape[2]:
        return                                       # a new sequence, or the append refuses it
    if not (fresh and managed(cache_k) and managed(cache_v)):
        if all(n == p for n in unpack(buffers).lengths.tolist()):
            return                                   # the packed state continues at p
    # a row whose positions [0, p) all read zero holds no prompt: a copy of a cache a compiled
    # model keeps packed (its own buffers read zeros) or one never filled. Only the whole
    # range says so: a left-padded row's pad keys can be exactly zero (a zero pad embedding)
    written = cache_k[:, :, :p].flatten(1).any(1) | cache_v[:, :, :p].flatten(1).any(1)
    if not bool(written.all()):
        raise ValueError(
            f"KVarN {name or 'cache'}: this call continues a sequence at position {p}, but the "
            f"cache passed holds only zeros in positions 0..{p - 1} (batch row "
            f"{int((~written).nonzero()[0])}), where the prompt was written: it was copied from "
            "a cache a compiled model keeps packed (whose own buffers read zeros) or never "
            "filled. Copy a packed cache with copy.deepcopy (it copies the packed state too), or "
            "start the sequence at position 0.")
    (append or append_)(buffers, cache_k[:, :, :p], cache_v[:, :, :p], torch.zeros_like(start_pos),
                        method, iters, recent, hold, check_finite, name)


# ------------------------------------------------------------------------------ beam reorder
def row_order(rows: torch.Tensor, batch: int, name: str) -> torch.Tensor | None:
    """The batch-row order ``rows`` [B] (row tags of a cat-cache handle, see
    passes/rewrite.py) asks for, or None when it is the identity."""
    tags = rows.detach().float().reshape(-1).cpu()
    idx = tags.round().long()
    if tags.numel() != batch or not bool(torch.isfinite(tags).all()) \
            or not torch.equal(idx.float(), tags) or bool((idx < 0).any()) or bool((idx >= batch).any()):
        raise ValueError(
            f"KVarN {name}: the past keys passed to the compiled model are not the handle its "
            f"previous call returned (expected {batch} batch-row tags in [0, {batch}), got "
            f"{tags[:8].tolist()}). Pass the cache the compiled model returned, reordered along "
            "the batch only (beam search), or start a new cache.")
    if torch.equal(idx, torch.arange(batch)):
        return None
    return idx


def reorder_(buffers: list[torch.Tensor], rows: torch.Tensor, name: str) -> None:
    """Reorder the state's batch rows: row i becomes old row ``rows[i]`` (beam search)."""
    idx = row_order(rows, buffers[0].shape[0], name)
    if idx is None:
        return
    for buf in buffers:
        buf.copy_(buf.index_select(0, idx.to(buf.device)))


# ------------------------------------------------------------------------------ positions
def positions_start(positions: torch.Tensor, batch: int) -> torch.Tensor:
    """int64 [batch] filled with positions[0], after checking the positions are contiguous."""
    flat = positions.reshape(-1) if positions.dim() <= 1 else positions[0]
    if flat.numel() == 0:
        raise ValueError("KVarN: expected at least one cache position, but got an empty positions tensor.")
    first = flat[:1].to(torch.int64)
    expected = first + torch.arange(flat.numel(), device=flat.device)
    if positions.dim() > 1 and not bool((positions == positions[:1]).all()):
        raise ValueError("KVarN: expected every batch row to write the same cache positions, but got "
                         f"{positions.tolist()}. Rows at different positions need per-row caches.")
    if not torch.equal(flat.to(torch.int64), expected):
        raise ValueError(f"KVarN: expected the cache positions to be one contiguous run p, p+1, ..., "
                         f"but got {flat.tolist()}. Non-contiguous cache writes (e.g. tree attention) "
                         "are not supported by the packed cache.")
    return first.expand(batch).clone()
