"""The decode step's append on a GPU without a host synchronization (CUDA-graph safe).

The reference append (``ops/append.py``) decides in Python, per batch row, where each token
goes and whether a tile completes: it reads the counters on the host (6-8 syncs per layer
and step on a GPU), which a CUDA graph cannot capture. :func:`append_decode` makes the same
decisions with tensor ops on the device, for the decode step's shape (one new token per
row, ``hold == 0``), and always launches the tile quantizer: the program of a row whose
tile does not complete reads its destination index -1 and returns at once.

What the reference checks before writing (position, capacity, tail room, the fp16 range of
an fp32 model's sink/tail) is checked on the device too: a row that fails is left
unchanged and sets a bit of the device's error flags (:func:`error_flags`), which the
caller reads after the step (``ops.dispatch.raise_device_errors``) and turns into the
reference's error. Per-tile key frames (``key_frame="auto"``) are chosen on the device as the
reference chooses them. Not covered (the caller takes the checked path): fp8 scales, clip
methods, several new tokens per row, ``hold > 0``, ``check_finite``. A
non-finite token is stored (the reference stores it as NaN in the tail; a tile holding it
comes out garbage instead of isolating it) and flagged.

Layout and semantics: :mod:`kvarn_compile.state`; math of the tiles:
:mod:`kvarn_compile.kernels.triton.quantize`.
"""

from __future__ import annotations

import functools

import torch

from kvarn_compile.kernels.triton.quantize import quantize_tiles_into
from kvarn_compile.quant.quantize import choose_key_frame
from kvarn_compile.quant.rotation import rotation_matrix
from kvarn_compile.state import Geometry, StateFields, unpack

__all__ = ["append_decode", "error_flags", "rotation", "ERR_POSITION", "ERR_CAPACITY",
           "ERR_TAIL", "ERR_RANGE", "ERR_NONFINITE", "ERR_MASK", "ERR_UNSUPPORTED", "ERROR_BITS"]

#: Bits of the device error flags (an int32 per device, OR-ed by the steps).
ERR_POSITION = 1 << 0      # a row writes at a position other than its length (or 0)
ERR_CAPACITY = 1 << 1      # a row would hold more tokens than the cache was allocated for
ERR_TAIL = 1 << 2          # a row would keep more tokens in the tail ring than it has slots
ERR_RANGE = 1 << 3         # |x| beyond float16 in an fp32 model's fp16 sink/tail
ERR_NONFINITE = 1 << 4     # a NaN/inf key or value was stored
ERR_MASK = 1 << 5          # an attention mask shorter than the cache
ERR_UNSUPPORTED = 1 << 6   # a state the device path cannot continue (several tiles due at once)
ERROR_BITS = {ERR_POSITION: "position", ERR_CAPACITY: "capacity", ERR_TAIL: "tail",
              ERR_RANGE: "range", ERR_NONFINITE: "nonfinite", ERR_MASK: "mask",
              ERR_UNSUPPORTED: "unsupported"}

_FP16_MAX = 65504.0
_FLAGS: dict[torch.device, torch.Tensor] = {}


def error_flags(device: torch.device | str) -> torch.Tensor:
    """The int32 error flags of ``device`` (one per device, allocated once: its address is
    stable, as a CUDA graph needs). Read and cleared by the caller after a step."""
    device = torch.device(device)
    if device not in _FLAGS:
        _FLAGS[device] = torch.zeros((), dtype=torch.int32, device=device)
    return _FLAGS[device]


@functools.lru_cache(maxsize=None)
def rotation(d: int, device: torch.device) -> torch.Tensor:
    """The fp32 rotation for head dim ``d`` on ``device``, built once (a fresh one per call
    is a host-to-device copy, which a CUDA graph cannot capture)."""
    return rotation_matrix(d, device)


def applies(f: StateFields[torch.Tensor], k: torch.Tensor, method: str, hold: int,
            check_finite: bool) -> bool:
    """Static (shape / dtype / option) conditions of :func:`append_decode`: no tensor is read."""
    return (k.dim() == 4 and k.shape[2] == 1 and hold == 0 and not check_finite
            and method in ("kvarn", "hadamard") and not f.layout.fp8_factors
            and f.sink_k.shape[2] + f.tail_k.shape[2] > 0
            and f.tail_k.shape[2] >= f.k.col_scale.shape[-1] - 1 and k.shape[:2] == f.sink_k.shape[:2]
            and k.shape[-1] == f.sink_k.shape[-1] and k.device == f.sink_k.device)


def append_decode(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                  start_pos: torch.Tensor, *, method: str, iters: int, recent: int) -> None:
    """Append one token per row (k, v [B, H, 1, D] at start_pos [B]) with ``hold == 0``.

    Per row b, as the reference: start_pos[b] == 0 restarts the row; otherwise the token
    goes at start_pos[b] in [committed[b], lengths[b]]. It lands in the sink (position < S)
    or the tail ring (slot (p - S) % W); every token is committed; when G committed tokens
    beyond the recent window have gathered past the frozen tiles, they are quantized into
    tile n_tiles[b]. Rows that fail a check set :func:`error_flags` bits and are unchanged.
    Callers check :func:`applies` first.
    """
    f = unpack(buffers)
    geo = Geometry.of(f)
    s, g, n_max, w = geo.sink, geo.group, geo.max_tiles, geo.tail
    bsz, heads, _, d = f.sink_k.shape
    dev = k.device
    flags = error_flags(dev)
    exact = f.tail_k.dtype
    p0 = start_pos.to(torch.int64)
    restart = p0 == 0
    zero = torch.zeros_like(f.lengths)
    length0 = torch.where(restart, zero, f.lengths)
    done0 = torch.where(restart, zero, f.committed)
    tiles0 = torch.where(restart, zero, f.n_tiles)
    end = p0 + 1
    # ---- the reference's checks, as bits (check_append, check_range)
    bad_pos = (p0 < 0) | (p0 > length0) | (p0 < done0)
    bad_cap = end > f.capacity[0]
    frozen_end = s + tiles0 * g
    due = torch.clamp(end - frozen_end - recent, min=0) // g          # tiles the commit allows
    room = n_max - tiles0
    freeze = torch.minimum(due, room).clamp(min=0)                    # 0 or 1 in a decode step
    bad_many = freeze > 1
    freeze = (freeze > 0) & (end > s)
    tiles_after = tiles0 + freeze.to(tiles0.dtype)
    bad_tail = (end - torch.clamp(s + tiles_after * g, min=s)) > w
    kv = torch.cat([k, v], 2)                                         # [B, H, 2, D]
    finite = torch.isfinite(kv).flatten(1).all(1)
    bad_range = torch.zeros_like(bad_pos)
    if exact == torch.float16 and k.dtype != torch.float16:
        peak = torch.nan_to_num(kv.float().abs(), nan=0.0, posinf=0.0).flatten(1).amax(1)
        bad_range = peak > _FP16_MAX
    bad = bad_pos | bad_cap | bad_tail | bad_range | bad_many
    ok = ~bad
    code = (bad_pos.int() * ERR_POSITION | bad_cap.int() * ERR_CAPACITY
            | (bad_tail & ~bad_pos).int() * ERR_TAIL | bad_range.int() * ERR_RANGE
            | (ok & ~finite).int() * ERR_NONFINITE | bad_many.int() * ERR_UNSUPPORTED)
    flags.bitwise_or_(_or_reduce(code))

    k_new, v_new = k[:, :, 0].to(exact), v[:, :, 0].to(exact)         # [B, H, D]
    # ---- the tile that completes: positions frozen_end .. + G - 1, from the ring, the new
    # token from k/v (it is not in the ring yet)
    if n_max > 0:
        pos = frozen_end[:, None] + torch.arange(g, device=dev)[None, :]  # [B, G]
        slot = torch.remainder(pos - s, w)
        idx = slot[:, None, :, None].expand(bsz, heads, g, d)
        is_new = (pos == p0[:, None])[:, None, :, None]
        tile_k = torch.where(is_new, k_new[:, :, None], f.tail_k.gather(2, idx))
        tile_v = torch.where(is_new, v_new[:, :, None], f.tail_v.gather(2, idx))
        dst = torch.where(freeze & ok, tiles0, torch.full_like(tiles0, -1))[:, None]
        normalize = method == "kvarn"
        rot = rotation(d, dev)
        quantize_tiles_into(tile_v, *f.v.core, kind="v", bits=geo.value_bits, rotate=True,
                            normalize=normalize, iters=iters, dst_tile=dst, rotation=rot)
        if f.k_plain is None:
            quantize_tiles_into(tile_k, *f.k.core, kind="k", bits=geo.key_bits, rotate=True,
                                normalize=normalize, iters=iters, dst_tile=dst, rotation=rot)
        else:
            # per-tile key frames: (batch row, head) pairs become the kernel's rows; one launch
            # quantizes the rotated tiles, one the plain ones, each skipping the other's
            rows = bsz * heads
            plain = choose_key_frame(tile_k.float().reshape(rows, 1, g, d))[:, 0]     # [B*H]
            by_head = [t.view(rows, 1, *t.shape[2:]) for t in f.k.core]
            x = tile_k.reshape(rows, 1, g, d)
            dst_h = dst.expand(bsz, heads).reshape(rows)
            none = torch.full_like(dst_h, -1)
            for frame, rotated in ((plain, False), (~plain, True)):
                quantize_tiles_into(x, *by_head, kind="k", bits=geo.key_bits, rotate=rotated,
                                    normalize=normalize and rotated, iters=iters,
                                    dst_tile=torch.where(frame, dst_h, none)[:, None],
                                    rotation=rot if rotated else None)
            at = torch.clamp(tiles0, 0, n_max - 1)[:, None, None].expand(bsz, heads, 1)
            into = (freeze & ok)[:, None, None]
            f.k_plain.scatter_(2, at, torch.where(into, plain.view(bsz, heads, 1).to(torch.uint8),
                                                  f.k_plain.gather(2, at)))
    # ---- the token itself: sink, or its ring slot unless it went into the tile
    if s > 0:
        at = torch.clamp(p0, 0, s - 1)[:, None, None, None].expand(bsz, heads, 1, d)
        into = (ok & (p0 < s))[:, None, None, None]
        for buf, new in ((f.sink_k, k_new), (f.sink_v, v_new)):
            buf.scatter_(2, at, torch.where(into, new[:, :, None], buf.gather(2, at)))
    frozen_new = freeze & (p0 < frozen_end + g)
    at = torch.remainder(p0 - s, w)[:, None, None, None].expand(bsz, heads, 1, d)
    into = (ok & (p0 >= s) & ~frozen_new)[:, None, None, None]
    for buf, new in ((f.tail_k, k_new), (f.tail_v, v_new)):
        buf.scatter_(2, at, torch.where(into, new[:, :, None], buf.gather(2, at)))
    # ---- counters
    f.lengths.copy_(torch.where(ok, end, f.lengths))
    f.committed.copy_(torch.where(ok, end, f.committed))
    f.n_tiles.copy_(torch.where(ok, tiles_after, f.n_tiles))


def _or_reduce(code: torch.Tensor) -> torch.Tensor:
    """OR of the int32 bits of ``code`` [B] as one tensor (no host sync): bit by bit, max."""
    out = torch.zeros((), dtype=torch.int32, device=code.device)
    for bit in ERROR_BITS:
        out = out | ((code & bit).amax() if code.numel() else out)
    return out
