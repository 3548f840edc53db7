"""The decode step's append on a GPU without a host synchronization (CUDA-graph safe).

The reference append (``ops/append.py``) decides in Python, per batch row, where each token
goes and whether a tile completes: it reads the counters on the host (6-8 syncs per layer
and step on a GPU), which a CUDA graph cannot capture. :func:`append_decode` makes the same
decisions on the device, for the decode step's shape (one new token per row, ``hold == 0``),
in one Triton kernel (``_append_decode_kernel``: one program per row), and always launches
the tile quantizer: the program of a row whose tile does not complete reads its
destination index -1 and returns at once. Three launches a step, where the same decisions
as tensor ops were about a hundred small kernels (each a few microseconds, graph or not).

What the reference checks before writing (position, capacity, tail room, the fp16 range of
an fp32 model's sink/tail) is checked on the device too: a row that fails is left
unchanged and sets a bit of the device's error flags (:func:`error_flags`), which the
caller reads after the step (``ops.dispatch.raise_device_errors``) and turns into the
reference's error. Per-tile key frames (``key_frame="auto"``) are chosen on the device as the
reference chooses them. Not covered (the caller takes the checked path): fp8 scales, clip
methods, several new tokens per row, ``hold > 0``, ``check_finite``. A
non-finite token is stored (the reference stores it as NaN in the tail; a tile holding it
comes out garbage instead of isolating it) and flagged.

Keys and values may differ in head dim (``allocate_layer(..., value_head_dim=Dv)``, MLA
decompressed: D = 192, Dv = 128): the kernel reads and writes the values over Dv, and the V
tiles are quantized in the frame of ``rotation_matrix(Dv)``, the K tiles in that of
``rotation_matrix(D)``.

Layout and semantics: :mod:`kvarn_compile.state`; math of the tiles:
:mod:`kvarn_compile.kernels.triton.quantize`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvarn_compile.kernels.triton.quantize import quantize_tiles_into, tile_fits
from kvarn_compile.quant.quantize import DOMINANCE_THRESHOLD
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

_FP16_MAX = tl.constexpr(65504.0)   # the largest finite float16
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
            check_finite: bool, v: torch.Tensor | None = None) -> bool:
    """Static (shape / dtype / option) conditions of :func:`append_decode`: no tensor is read.
    ``v`` (optional, for callers that have it): the values, [B, H, 1, Dv] like the keys but
    for the state's value head dim."""
    return (k.dim() == 4 and k.shape[2] == 1 and hold == 0 and not check_finite
            and method in ("kvarn", "hadamard") and not f.layout.fp8_factors
            and f.sink_k.shape[2] + f.tail_k.shape[2] > 0
            and f.tail_k.shape[2] >= f.k.col_scale.shape[-1] - 1 and k.shape[:2] == f.sink_k.shape[:2]
            and k.shape[-1] == f.sink_k.shape[-1] and k.device == f.sink_k.device
            and (v is None or (v.dim() == 4 and v.shape[:3] == k.shape[:3]
                               and v.shape[-1] == f.sink_v.shape[-1] and v.device == k.device))
            and all(t.is_contiguous() for t in (f.sink_k, f.sink_v, f.tail_k, f.tail_v))
            and tile_fits("k", k.shape[-1], f.k.col_scale.shape[-1])
            and tile_fits("v", f.sink_v.shape[-1], f.k.col_scale.shape[-1]))


def append_decode(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                  start_pos: torch.Tensor, *, method: str, iters: int, recent: int) -> None:
    """Append one token per row (k [B, H, 1, D], v [B, H, 1, Dv] at start_pos [B]) with
    ``hold == 0``.

    Per row b, as the reference: start_pos[b] == 0 restarts the row; otherwise the token
    goes at start_pos[b] in [committed[b], lengths[b]]. It lands in the sink (position < S)
    or the tail ring (slot (p - S) % W); every token is committed; when G committed tokens
    beyond the recent window have gathered past the frozen tiles, they are quantized into
    tile n_tiles[b]. Rows that fail a check set :func:`error_flags` bits and are unchanged.
    Callers check :func:`applies` first.

    Three launches a step (a CUDA graph replays them as they are): ``_append_decode_kernel``
    (every decision, check and write of the step, and a copy of the completing tile's
    tokens, read from the ring before the new token is written into it) and the tile
    quantizer for V and for K, whose programs return at once in a row without a complete
    tile (destination -1). With per-tile key frames (``key_frame="auto"``) the kernel also
    chooses each completing K tile's frame, and K takes two quantizer launches (plain,
    rotated), each writing the tiles of its frame.
    """
    f = unpack(buffers)
    geo = Geometry.of(f)
    s, g, n_max, w = geo.sink, geo.group, geo.max_tiles, geo.tail
    bsz, heads, _, d = f.sink_k.shape
    dv = geo.value_head_dim
    dev = k.device
    exact = f.tail_k.dtype
    stage_k = torch.empty(bsz, heads, g if n_max else 1, d, dtype=exact, device=dev)
    stage_v = torch.empty(bsz, heads, g if n_max else 1, dv, dtype=exact, device=dev)
    dst = torch.empty(bsz, 1, dtype=torch.int64, device=dev)
    frames = f.k_plain is not None and n_max > 0
    # per-tile key frames: the kernel chooses each completing K tile's frame (the reference's
    # rule, choose_key_frame) and gives every (row, head) a destination for the plain and
    # one for the rotated quantizer launch (-1 in the other)
    dst_plain = torch.empty(bsz * heads if frames else 1, 1, dtype=torch.int64, device=dev)
    dst_rot = torch.empty_like(dst_plain)
    if bsz:
        _append_decode_kernel[(bsz,)](
            k, v, k.stride(0), k.stride(1), k.stride(3), v.stride(0), v.stride(1), v.stride(3),
            start_pos, f.sink_k, f.sink_v, f.tail_k, f.tail_v, f.lengths, f.committed,
            f.n_tiles, f.capacity, stage_k, stage_v, dst, error_flags(dev), int(recent),
            f.k_plain if frames else dst, dst_plain, dst_rot,
            heads, H_P2=triton.next_power_of_2(heads), D=d, BLOCK_D=triton.next_power_of_2(d),
            DV=dv, BLOCK_DV=triton.next_power_of_2(dv), S=s, W=w, G=g, N_MAX=n_max,
            BLOCK_T=min(g, 32),
            CHECK_RANGE=exact == torch.float16 and k.dtype != torch.float16, FRAMES=frames,
            DOMINANCE=DOMINANCE_THRESHOLD, ERR_POS=ERR_POSITION, ERR_CAP=ERR_CAPACITY,
            ERR_TL=ERR_TAIL, ERR_RNG=ERR_RANGE, ERR_NF=ERR_NONFINITE, ERR_MANY=ERR_UNSUPPORTED)
    if n_max == 0:
        return
    normalize = method == "kvarn"
    rot = rotation(d, dev)
    quantize_tiles_into(stage_v, *f.v.core, kind="v", bits=geo.value_bits, rotate=True,
                        normalize=normalize, iters=iters, dst_tile=dst,
                        rotation=rot if dv == d else rotation(dv, dev))
    if not frames:
        quantize_tiles_into(stage_k, *f.k.core, kind="k", bits=geo.key_bits, rotate=True,
                            normalize=normalize, iters=iters, dst_tile=dst, rotation=rot)
        return
    # (batch row, head) pairs become the quantizer's rows: one launch quantizes the plain
    # tiles, one the rotated ones, each skipping the other's
    rows = bsz * heads
    by_head = [t.view(rows, 1, *t.shape[2:]) for t in f.k.core]
    x = stage_k.reshape(rows, 1, g, d)
    quantize_tiles_into(x, *by_head, kind="k", bits=geo.key_bits, rotate=False,
                        normalize=False, iters=iters, dst_tile=dst_plain)
    quantize_tiles_into(x, *by_head, kind="k", bits=geo.key_bits, rotate=True,
                        normalize=normalize, iters=iters, dst_tile=dst_rot, rotation=rot)


@triton.jit
def _dominant(hi, lo, peak, d_ok, D: tl.constexpr, BLOCK_D: tl.constexpr,
              DOMINANCE: tl.constexpr):
    """``choose_key_frame`` of one K tile from its per-channel max ``hi``, min ``lo`` and
    max |k| ``peak`` [BLOCK_D] (channels d_ok): peak / median range >= DOMINANCE, the median
    the (D // 2)-th smallest range (the reference's sorted range at D // 2; the padding's
    +inf sorts last)."""
    rng = tl.sort(tl.where(d_ok, hi - lo, float("inf")))
    median = tl.sum(tl.where(tl.arange(0, BLOCK_D) == D // 2, rng, 0.0), axis=0)
    top = tl.max(tl.where(d_ok, peak, 0.0), axis=0)
    return tl.div_rn(top, tl.maximum(median, 1.1754943508222875e-38)) >= DOMINANCE


@triton.jit
def _where_also(mask, cond):
    """mask & the scalar cond, broadcast through an int (Triton's interpreter refuses a store
    mask made by and-ing a bool tensor with a bool scalar)."""
    return mask & ((mask.to(tl.int32) * 0 + cond.to(tl.int32)) != 0)


@triton.jit
def _append_decode_kernel(
    k_ptr, v_ptr, s_kb, s_kh, s_kd, s_vb, s_vh, s_vd,   # new tokens [B, H, 1, D | DV], any strides
    start_ptr,                        # int32/int64 [B]: the position each row writes at
    sink_k, sink_v, tail_k, tail_v,   # [B, H, S, D | DV], [B, H, W, D | DV], contiguous, exact dtype
    len_ptr, done_ptr, tiles_ptr, cap_ptr,   # int64 [B] counters (lengths, committed, n_tiles, capacity)
    stage_k, stage_v,                 # [B, H, G, D | DV] exact dtype: the completing tile's tokens (out)
    dst_ptr,                          # int64 [B]: the tile slot it goes to, -1 if none (out)
    flags_ptr,                        # int32 []: error bits, OR-ed
    recent,                           # tokens kept exact past the last complete tile
    k_plain_ptr,                      # uint8 [B, H, N]: per-tile key frames (FRAMES)
    dst_plain_ptr, dst_rot_ptr,       # int64 [B * H]: the tile slot per (row, head) for the
                                      # plain / rotated K quantizer, -1 if none (FRAMES, out)
    H,                                # kv heads
    H_P2: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, S: tl.constexpr,
    W: tl.constexpr, G: tl.constexpr, N_MAX: tl.constexpr, BLOCK_T: tl.constexpr,
    CHECK_RANGE: tl.constexpr, FRAMES: tl.constexpr, DOMINANCE: tl.constexpr,
    ERR_POS: tl.constexpr, ERR_CAP: tl.constexpr,
    ERR_TL: tl.constexpr, ERR_RNG: tl.constexpr, ERR_NF: tl.constexpr, ERR_MANY: tl.constexpr,
):
    """The decode append of one batch row (program b), every head at once: the reference's
    decisions (``append_decode``) on the row's counters, its checks as error bits, the
    token stored in the sink or its ring slot, the counters bumped. When a tile completes,
    its G tokens (the ring's and the new one) are copied to ``stage_*`` first, and the
    ring slot is written after a barrier: with a ring of G - 1 slots the new token's slot
    is the tile's first token's. FRAMES: each head's copy also gives its K tile's frame by
    the reference's rule (``quant.quantize.choose_key_frame``: max |k| >= DOMINANCE x the
    median over channels of the per-channel range), stored in k_plain and as the
    destinations of the plain / rotated quantizer launches. D / BLOCK_D: the keys' head dim
    (padded to a power of two); DV / BLOCK_DV: the values' (DV = D but for MLA-style caches)."""
    b = tl.program_id(0).to(tl.int64)
    p0 = tl.load(start_ptr + b).to(tl.int64)
    restart = p0 == 0
    length = tl.load(len_ptr + b)
    length0 = tl.where(restart, 0, length)
    done = tl.load(done_ptr + b)
    done0 = tl.where(restart, 0, done)
    tiles = tl.load(tiles_ptr + b)
    tiles0 = tl.where(restart, 0, tiles)
    end = p0 + 1
    bad_pos = (p0 < 0) | (p0 > length0) | (p0 < done0)
    bad_cap = end > tl.load(cap_ptr)
    frozen_end = S + tiles0 * G
    due = tl.maximum(end - frozen_end - recent, 0) // G
    n_freeze = tl.maximum(tl.minimum(due, N_MAX - tiles0), 0)
    bad_many = n_freeze > 1
    freeze = (n_freeze > 0) & (end > S)
    tiles_after = tiles0 + freeze.to(tl.int64)
    bad_tail = (end - tl.maximum(S + tiles_after * G, S)) > W

    offs_h = tl.arange(0, H_P2)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    hd = (offs_h < H)[:, None] & (offs_d < D)[None, :]
    hdv = (offs_h < H)[:, None] & (offs_dv < DV)[None, :]
    kx = tl.load(k_ptr + b * s_kb + offs_h[:, None] * s_kh + offs_d[None, :] * s_kd, mask=hd,
                 other=0.0).to(tl.float32)
    vx = tl.load(v_ptr + b * s_vb + offs_h[:, None] * s_vh + offs_dv[None, :] * s_vd, mask=hdv,
                 other=0.0).to(tl.float32)
    ka, va = tl.abs(kx), tl.abs(vx)
    k_fin = ka < float("inf")          # False for NaN and +-inf (padding loads 0)
    v_fin = va < float("inf")
    if BLOCK_DV == BLOCK_D:
        finite = tl.sum(tl.sum((~k_fin | ~v_fin).to(tl.int32), axis=1), axis=0) == 0
    else:                              # [H, BLOCK_D] and [H, BLOCK_DV]: reduced one by one
        finite = (tl.sum(tl.sum((~k_fin).to(tl.int32), axis=1), axis=0)
                  + tl.sum(tl.sum((~v_fin).to(tl.int32), axis=1), axis=0)) == 0
    bad_range = p0 < p0                # False
    if CHECK_RANGE:
        peak = tl.maximum(tl.max(tl.max(tl.where(k_fin, ka, 0.0), axis=1), axis=0),
                          tl.max(tl.max(tl.where(v_fin, va, 0.0), axis=1), axis=0))
        bad_range = peak > _FP16_MAX
    bad = bad_pos | bad_cap | bad_tail | bad_range | bad_many
    ok = ~bad
    code = tl.where(bad_pos, ERR_POS, 0) | tl.where(bad_cap, ERR_CAP, 0) \
        | tl.where(bad_tail & ~bad_pos, ERR_TL, 0) | tl.where(bad_range, ERR_RNG, 0) \
        | tl.where(ok & ~finite, ERR_NF, 0) | tl.where(bad_many, ERR_MANY, 0)
    tl.atomic_or(flags_ptr, code.to(tl.int32))

    k_new = kx.to(tail_k.dtype.element_ty)
    v_new = vx.to(tail_v.dtype.element_ty)
    row = b * H + offs_h                                               # [H_P2] (b, h) rows
    if N_MAX > 0:
        stage = freeze & ok
        tl.store(dst_ptr + b, tl.where(stage, tiles0, -1))
        if FRAMES:
            none = tl.full([H_P2], -1, tl.int64)
            tl.store(dst_plain_ptr + row, none, mask=offs_h < H)
            tl.store(dst_rot_ptr + row, none, mask=offs_h < H)
        if stage:
            offs_t = tl.arange(0, BLOCK_T)
            d_ok = offs_d < D
            dv_ok = offs_dv < DV
            for h in range(H):
                kh = tl.load(k_ptr + b * s_kb + h * s_kh + offs_d * s_kd, mask=d_ok,
                             other=0.0).to(tail_k.dtype.element_ty)
                vh = tl.load(v_ptr + b * s_vb + h * s_vh + offs_dv * s_vd, mask=dv_ok,
                             other=0.0).to(tail_v.dtype.element_ty)
                hi = tl.full([BLOCK_D], float("-inf"), tl.float32)    # per-channel max, min
                lo = tl.full([BLOCK_D], float("inf"), tl.float32)
                k_abs = tl.zeros([BLOCK_D], tl.float32)                # per-channel max |k|
                for t0 in range(0, G, BLOCK_T):
                    pos = frozen_end + t0 + offs_t                     # >= S
                    slot = (pos - S) % W
                    m = d_ok[None, :] & (offs_t < BLOCK_T)[:, None]
                    src = ((b * H + h) * W + slot)[:, None] * D + offs_d[None, :]
                    out = ((b * H + h) * G + t0 + offs_t)[:, None] * D + offs_d[None, :]
                    # the values' addresses (the same as the keys' when DV == D)
                    mv = dv_ok[None, :] & (offs_t < BLOCK_T)[:, None]
                    src_v = ((b * H + h) * W + slot)[:, None] * DV + offs_dv[None, :]
                    out_v = ((b * H + h) * G + t0 + offs_t)[:, None] * DV + offs_dv[None, :]
                    is_new = (pos == p0)[:, None]
                    tk = tl.where(is_new, kh[None, :], tl.load(tail_k + src, mask=m, other=0.0))
                    tv = tl.load(tail_v + src_v, mask=mv, other=0.0)
                    tl.store(stage_k + out, tk, mask=m)
                    tl.store(stage_v + out_v, tl.where(is_new, vh[None, :], tv), mask=mv)
                    if FRAMES:
                        x = tk.to(tl.float32)
                        hi = tl.maximum(hi, tl.max(x, axis=0))
                        lo = tl.minimum(lo, tl.min(x, axis=0))
                        k_abs = tl.maximum(k_abs, tl.max(tl.abs(x), axis=0))
                if FRAMES:
                    plain = _dominant(hi, lo, k_abs, d_ok, D, BLOCK_D, DOMINANCE)
                    tl.store(k_plain_ptr + (b * H + h) * N_MAX + tiles0, plain.to(tl.uint8))
                    tl.store(dst_plain_ptr + b * H + h, tl.where(plain, tiles0, -1))
                    tl.store(dst_rot_ptr + b * H + h, tl.where(plain, -1, tiles0))
            tl.debug_barrier()         # the ring is read before the new token goes into it
        frozen_new = stage & (p0 < frozen_end + G)
    else:
        frozen_new = p0 < p0
    if S > 0:
        at = tl.minimum(tl.maximum(p0, 0), S - 1)
        into = ok & (p0 < S)
        ptrs = (row * S + at)[:, None] * D + offs_d[None, :]
        tl.store(sink_k + ptrs, k_new, mask=_where_also(hd, into))
        ptrs_v = (row * S + at)[:, None] * DV + offs_dv[None, :]
        tl.store(sink_v + ptrs_v, v_new, mask=_where_also(hdv, into))
    at = (p0 - S) % W
    at = tl.where(at < 0, at + W, at)
    into = ok & (p0 >= S) & ~frozen_new
    ptrs = (row * W + at)[:, None] * D + offs_d[None, :]
    tl.store(tail_k + ptrs, k_new, mask=_where_also(hd, into))
    ptrs_v = (row * W + at)[:, None] * DV + offs_dv[None, :]
    tl.store(tail_v + ptrs_v, v_new, mask=_where_also(hdv, into))
    tl.store(len_ptr + b, tl.where(ok, end, length))
    tl.store(done_ptr + b, tl.where(ok, end, done))
    tl.store(tiles_ptr + b, tl.where(ok, tiles_after, tiles))
