"""Device kernels of the kvarn ops, registered against :mod:`.library` with ``register_kernel``.

The one module that decides which kernel runs where:

* ``kvarn::attention`` on **CPU**: the whole decode step (sink, tiles, tail, one online
  softmax, the rotations) is one call of the C++ kernel of ``kernels/cpu/attention.py``
  (``KVARN_CPU_KERNEL=0`` turns it off, ``=require`` makes a failed build an error); more
  than ``CPU_KERNEL_MAX_QUERIES`` queries (a prefill chunk), or queries that need causal
  masking inside the tiles, take its multi-query path (every tile dequantized once per
  block of queries, GEMM micro-kernels), exact for every visibility.
* ``kvarn::attention`` on **CUDA**: one Triton launch (``kernels/triton/attention.py``,
  :func:`kvarn_attention`): split-K over the packed tiles (in-register unpack, dual-scale
  fold, rotated frame), the exact sink and tail ring, and their log-sum-exp merge, with
  causal, window and mask (read in place) applied per position; fp8 scales: the reference.
* ``kvarn::append_`` on **CPU**: the decode step's append (every row continues, no tile
  completes) in one C++ call (``cpu_attention.append_decode``).
* ``kvarn::append_`` (any other write) / ``commit_`` on **CPU**: the reference bookkeeping
  with the C++ tile quantizer of ``kernels/cpu/quantize.py``, bit-identical to the reference
  (key frames and ``clip="mse"`` included; ``KVARN_CPU_KERNEL`` as for attention).
* ``kvarn::append_`` / ``commit_`` on **CUDA**: the reference bookkeeping with the Triton
  tile quantizer for the tiles a write freezes (per-tile key frames included).
* ``kvarn::tile_partials_triton_`` on **CUDA**: the standalone Triton decode kernel.
* ``kvarn::latent_attention`` (absorbed multi-head latent attention over a latent state): on
  **CPU** one call of the C++ latent kernel (``csrc/latent_attention.cpp``: sink, tiles,
  tail, key frames, fp8 scales, every visibility); on **CUDA** the exact region in torch and
  the tiles through ``kernels/triton/latent_attention.py``, merged by log-sum-exp.

A kernel runs only where it computes exactly what the reference computes: the CUDA and
CPU attention paths apply visibility per position and need only non-fp8 scales.
Everything else runs the reference
(:mod:`.reference`), which is also every kernel's test oracle.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading

import torch

from kvarn_compile.kernels.cpu import attention as cpu_attention
from kvarn_compile.ops import context_parallel
from kvarn_compile.ops import append as append_ref, attention as attention_ref, library, regions
from kvarn_compile.quant.rotation import rotation_matrix
from kvarn_compile.state import Geometry, StateFields, unpack

log = logging.getLogger("kvarn_compile.ops")

__all__ = ["kernel_applies", "attention", "attention_cpu", "latent_attention_cpu", "latent_attention_cuda",
           "merge_latent_partials", "freeze_tiles_triton", "freeze_tiles_cpu",
           "cuda_checks_on", "cuda_checks_deferred", "deferred_checks", "prepare_device",
           "raise_device_errors"]


def kernel_applies(q: torch.Tensor, buffers: list[torch.Tensor] | StateFields,
                   mask: torch.Tensor | None) -> bool:
    """True in the decode case: every query sees every packed token, no mask hides one, and
    the scales are not fp8. (The kernels no longer need it: they apply visibility per
    position; tests use it to say which case they cover.)"""
    f = buffers if isinstance(buffers, StateFields) else unpack(buffers)
    if f.layout.fp8_factors:                   # fp8 scales: the kernels read fp16/bf16/fp32
        return False
    s, g = f.sink_k.shape[2], f.k.col_scale.shape[-1]
    tq = q.shape[2]
    # (plain ints: this runs on every decode step, a handful of tiny tensor ops cost more)
    lengths, n_tiles = f.lengths.tolist(), f.n_tiles.tolist()
    # the newest quantized position (s + n*g - 1) must be visible to the oldest query
    # (position length - tq); it may be that query itself (a tile frozen by this step's append)
    if any(n > 0 and s + n * g - 1 > length - tq for length, n in zip(lengths, n_tiles)):
        return False                           # a query would need causal masking inside tiles
    if mask is not None:
        used = max(n_tiles, default=0)
        region = mask[..., s:s + used * g]
        if region.dtype == torch.bool:
            if not bool(region.all()):
                return False
        elif bool((region != 0).any()):
            return False
    return True


# ------------------------------------------------------------------------------ attention
def _cpu_attention(q, buffers, mask, scale, causal, window):
    """The whole step in one C++ call (the decode step's loop up to
    :data:`CPU_KERNEL_MAX_QUERIES` queries, the multi-query kernel beyond: exact for any
    visibility); None where the kernel cannot read this cache (the reference runs).

    ``cpu_attention.attention_state`` reads the members, bit widths and mask from the flat
    buffer list in C++ and does the reference's checks (queries, a mask as long as the
    cache): this runs per layer and token, where the Python around the kernel cost about as
    much as the kernel.
    """
    return cpu_attention.attention_state(q, buffers, mask, scale=scale, causal=causal, window=window,
                                         max_decode_queries=CPU_KERNEL_MAX_QUERIES)


def attention(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None,
              scale: float, causal: bool, window: int, *, kernel: str = "triton") -> torch.Tensor:
    """The attention with the tile part on ``kernel`` where it applies, else the reference.

    ``"cpu"``: the C++ decode step for up to :data:`CPU_KERNEL_MAX_QUERIES` queries, the
    C++ multi-query kernel for more (a prefill chunk); both apply causal, window and mask
    visibility per position (exact wherever they run) and refuse fp8 scales. ``"triton"``:
    the one-launch Triton kernel (:func:`_cuda_step_attention`, exact for every visibility),
    fp8 scales excepted.
    """
    out = None
    if kernel == "cpu":
        out = _cpu_attention(q, buffers, mask, scale, causal, window)
    else:
        f = unpack(buffers)
        attention_ref.check_queries(q, f)
        if not f.layout.fp8_factors:
            out = _cuda_step_attention(q, f, mask, scale, causal, window, checked=True)
    if out is None:
        return attention_ref.attention(q, buffers, mask, scale, causal, window)
    return out if out.dtype == q.dtype else out.to(q.dtype)   # (a no-op .to costs a dispatch)


#: The C++ decode step (``kernels/cpu/attention.py``) runs ``kvarn::attention`` on CPU for up to
#: this many query tokens (exact per position: no :func:`kernel_applies` check); longer query
#: blocks (prefill chunks) run the C++ multi-query kernel (``decode_attention(...,
#: many=True)``). Compiled, both are the one extern call of ``lowering.attention.cpu_kernel_covers``.
CPU_KERNEL_MAX_QUERIES = 16


@library.attention.register_kernel("cpu")
def attention_cpu(q, buffers, mask, scale, causal, window):
    """The CPU kernel of ``kvarn::attention``: the C++ decode step or multi-query kernel
    (:func:`_cpu_attention`, what :func:`attention` runs with ``kernel="cpu"``), else the
    reference. (A compiled decode step calls this per layer: no frames or imports beyond the
    kernel's own call.)"""
    # KVARN_CPU_KERNEL=0: off. The kernel's output is contiguous and in q's dtype.
    out = _cpu_attention(q, buffers, mask, scale, causal, window) if cpu_attention.available() else None
    if out is None:
        out = attention_ref.attention(q, buffers, mask, scale, causal, window)
    return out if out.is_contiguous() else out.contiguous()


@library.latent_attention.register_kernel("cpu")
def latent_attention_cpu(q, q_pe, buffers, mask, scale, causal, window):
    """The CPU kernel of ``kvarn::latent_attention``: the C++ latent kernel
    (``cpu_attention.latent_attention_state``: the reference's checks, then sink, tiles and
    tail in one call, exact for every visibility, fp8 scales and key frames included) where
    it reads the state, else the reference (``KVARN_CPU_KERNEL=0``, a state of other bit
    widths or storage dtypes)."""
    out = None
    if cpu_attention.available():
        out = cpu_attention.latent_attention_state(q, q_pe, buffers, mask, scale=scale,
                                                   causal=causal, window=window)
    if out is None:
        out = attention_ref.latent_attention(q, q_pe, buffers, mask, scale, causal, window)
    return out if out.is_contiguous() else out.contiguous()


def merge_latent_partials(o_part: torch.Tensor, lse_part: torch.Tensor,
                          rot: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out fp32 [B, Hq, Tq, D] in the original frame, lse [B, Hq, Tq]) from the partials of
    ``kernels/triton/latent_attention.latent_tile_partials``: each frame's splits merged by
    lse, the rotated frame's output rotated back (``@ rot.T``; default
    ``rotation_matrix(D)``), the frames merged."""
    from kvarn_compile.kernels.triton.attention import combine_splits

    d = o_part.shape[-1]
    rot = rotation_matrix(d, o_part.device) if rot is None else rot
    out, lse = combine_splits(o_part[:, :, :, 0], lse_part[:, :, :, 0])
    out = out @ rot.T
    if o_part.shape[3] == 2:
        out_p, lse_p = combine_splits(o_part[:, :, :, 1], lse_part[:, :, :, 1])
        out, lse = regions.merge_regions(out, lse, out_p, lse_p)
    return out, lse


def latent_attention_cuda(q: torch.Tensor, q_pe: torch.Tensor, buffers: list[torch.Tensor],
                          mask: torch.Tensor | None = None, scale: float | None = None,
                          causal: bool = True, window: int = 0, *, checked: bool = True,
                          return_lse: bool = False, **kernel_options):
    """``kvarn::latent_attention`` with the packed tiles on the Triton kernel
    (``kernels/triton/latent_attention.py``): the exact region (sink + tail) in torch as the
    reference does it (one attention of [q | q_pe] over [latent | RoPE key],
    ``latent_fields`` + ``regions.exact_region``), the tiles by ``latent_tile_partials`` (fp8
    factors, key frames, causal bounds, window and mask applied in the kernel), merged by
    lse. Returns [B, Hq, Tq, D] in q's dtype, contiguous (with ``return_lse``: (out fp32,
    lse fp32 [B, Hq, Tq])).

    No host sync but ``checked``'s mask-length check (``check_mask``: it reads the row
    lengths); unchecked (inside a CUDA graph capture, a compiled decode step), a mask shorter
    than the cache sets ``ERR_MASK`` in the device's error flags, read after the step
    (:func:`raise_device_errors`), as ``kvarn::attention``'s kernel does. ``kernel_options``
    go to ``latent_tile_partials`` (num_splits, block_m, block_n, num_warps,
    input_precision, prefetch)."""
    from kvarn_compile.kernels.triton import append as triton_append
    from kvarn_compile.kernels.triton.latent_attention import latent_tile_partials

    f = unpack(buffers)
    attention_ref.check_latent_queries(q, q_pe, f)
    if mask is not None and checked:
        attention_ref.check_mask(f, mask)
    elif mask is not None:
        short = (f.lengths.max() > mask.shape[-1]).to(torch.int32) * triton_append.ERR_MASK
        triton_append.error_flags(q.device).bitwise_or_(short)
    geo = Geometry.of(f)
    d, r, bsz, tq = geo.head_dim, geo.value_head_dim, q.shape[0], q.shape[2]
    scale = (d + r) ** -0.5 if scale is None else float(scale)
    out, lse = regions.exact_region(torch.cat([q, q_pe.to(q.dtype)], -1),
                                    attention_ref.latent_fields(f), mask, scale, causal, window)
    if geo.max_tiles:
        dev = q.device
        rot = rotation_matrix(d, dev)
        q32 = q.float().contiguous()
        q_rot = (q32 @ rot).contiguous()
        pe_rot = (q_pe.float() @ rotation_matrix(r, dev)).contiguous()
        kv_lo, kv_hi = regions.tile_bounds(f, tq, causal, window)
        bias = None
        if mask is not None:
            m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
            cols = geo.sink + torch.arange(geo.max_tiles * geo.group, device=dev)
            bias = regions.bias_at(m4, cols[None, :].expand(bsz, -1), (bsz, m4.shape[1], tq))
        factors = None
        if f.layout.fp8_factors:
            factors = (f.k.row_factor, f.k.col_factor, f.v.row_factor, f.v.col_factor)
        o_part, lse_part = latent_tile_partials(
            q_rot, q32 if f.k_plain is not None else None, pe_rot, *f.k.core, *f.v.core,
            f.k_plain, f.n_tiles, kv_lo if window > 0 else None,
            kv_hi if causal and tq > 1 else None, bias, scale, factors=factors, **kernel_options)
        out_t, lse_t = merge_latent_partials(o_part, lse_part, rot)
        out, lse = regions.merge_regions(out, lse, out_t, lse_t)
    if return_lse:
        return out, lse
    return out.to(q.dtype).contiguous()


@library.latent_attention.register_kernel("cuda")
def _latent_attention_cuda(q, q_pe, buffers, mask, scale, causal, window):
    """The CUDA kernel of ``kvarn::latent_attention``: :func:`latent_attention_cuda` where
    Triton is available, else the reference."""
    from kvarn_compile.kernels import triton_available

    if triton_available():
        # (a decode step inside ``deferred_checks`` checks on the device, as kvarn::attention)
        checked = _single_token_checks_on(q.device) if q.shape[2] == 1 else cuda_checks_on()
        return latent_attention_cuda(q, q_pe, buffers, mask, scale, causal, window,
                                     checked=checked)
    return attention_ref.latent_attention(q, q_pe, buffers, mask, scale, causal, window).contiguous()


@library.attention.register_kernel("cuda")
def _attention_cuda(q, buffers, mask, scale, causal, window):
    from kvarn_compile.kernels import triton_available

    if triton_available():
        f = unpack(buffers)
        attention_ref.check_queries(q, f)
        if q.shape[2] == 1 and not _single_token_checks_on(q.device):
            checked = False
        else:
            checked = cuda_checks_on()
        if not f.layout.fp8_factors:
            return _cuda_step_attention(q, f, mask, scale, causal, window, checked)
    return attention_ref.attention(q, buffers, mask, scale, causal, window).contiguous()


# ------------------------------------------------------------------------------ CUDA graphs
#: ``KVARN_CUDA_CHECKS=0``: the CUDA steps never read tensors on the host; what the checked
#: mode raises before writing is recorded in device error flags instead (read them with
#: :func:`raise_device_errors`). Inside a CUDA graph capture this mode is always on.
#: ``KVARN_CUDA_CHECKS=1``: host checks everywhere, also in compiled calls (which otherwise
#: defer their single-token steps' checks, :func:`deferred_checks`): a single-token write
#: before a row's committed tokens (a rollback into packed tiles) needs them.
CUDA_CHECKS_ENV = "KVARN_CUDA_CHECKS"


def _checks_setting() -> str:
    import os

    value = os.environ.get(CUDA_CHECKS_ENV, "auto").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    return "host" if value in ("1", "on", "true", "yes", "host") else "auto"


def cuda_checks_on() -> bool:
    """True when the CUDA steps check on the host (the default outside a graph capture)."""
    if _checks_setting() == "off":
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class _Deferred(threading.local):
    depth = 0
    devices: set | None = None


_DEFERRED = _Deferred()


def _single_token_checks_on(device: torch.device) -> bool:
    """Whether a single-token CUDA step (a decode append, a one-query attention) checks on the
    host: not inside :func:`deferred_checks`, whose end reads its device flags instead."""
    if _DEFERRED.depth:
        _DEFERRED.devices.add(torch.device(device))      # read after the block in any case
    if not cuda_checks_on():
        return False
    return not (_DEFERRED.depth and _checks_setting() == "auto")


def cuda_checks_deferred() -> bool:
    """True when :func:`deferred_checks` blocks run their single-token steps without host
    checks (``KVARN_CUDA_CHECKS`` is "auto" or "0"): what a CUDA graph capture of a compiled
    decode step needs."""
    return _checks_setting() != "host"


@contextlib.contextmanager
def deferred_checks(name: str = "", device: torch.device | None = None):
    """Run the single-token CUDA steps of a block (a compiled decode step: every layer's append
    and attention) without host synchronization, then read their device error flags once
    (one sync per block instead of several per layer) and raise what the checked mode would
    have. Steps over several tokens keep their host checks. Nested blocks read at the outermost
    end; a block that raises clears the flags it may have set (its own error propagates).
    ``device``: read its flags in any case (a replayed CUDA graph runs no Python of the
    steps, so they cannot say which devices they used)."""
    outer = _DEFERRED.depth == 0
    if outer:
        _DEFERRED.devices = {torch.device(device)} if device is not None else set()
    _DEFERRED.depth += 1
    ok = False
    try:
        yield
        ok = True
    finally:
        _DEFERRED.depth -= 1
        if outer:
            devices, _DEFERRED.devices = _DEFERRED.devices, None
            for device in devices:
                if ok:
                    raise_device_errors(device, name)
                else:
                    from kvarn_compile.kernels.triton import append as triton_append
                    triton_append.error_flags(device).zero_()


def prepare_device(device: torch.device | str, head_dims) -> None:
    """Make now the device tensors the CUDA steps keep from call to call (the error flags, the
    rotation of each head dim), outside any CUDA-graph memory pool: made first while CUDA
    graphs warm up or record a step, such a tensor would live in their pool, untracked by
    them, and torch stops the step ("tensor(s) in the cudagraph pool not tracked")."""
    from kvarn_compile.kernels.triton import append as triton_append

    device = torch.device(device)
    triton_append.error_flags(device)
    for d in sorted(set(head_dims)):
        triton_append.rotation(int(d), device)


def raise_device_errors(device: torch.device | str, name: str = "") -> None:
    """Read and clear the device error flags of the unchecked CUDA steps (one host sync;
    call it after a step or a graph replay) and raise what the checked mode would have."""
    from kvarn_compile.kernels.triton import append as triton_append

    flags = triton_append.error_flags(device)
    bits = int(flags)
    flags.zero_()
    if not bits:
        return
    where = f" in {name}" if name else ""
    what = [triton_append.ERROR_BITS[b] for b in triton_append.ERROR_BITS if bits & b]
    if bits & triton_append.ERR_NONFINITE and bits == triton_append.ERR_NONFINITE:
        from kvarn_compile.quant.quantize import NonFiniteError
        raise NonFiniteError(f"KVarN append{where}: NaN/inf in the new keys/values (stored; a tile "
                             "holding one is garbage). Expected finite values.")
    raise ValueError(
        f"KVarN append/attention{where}: a step without host checks found {', '.join(what)} "
        "errors (a row writing at a position other than its length, beyond the cache's capacity "
        "or the tail's slots, |x| beyond float16, or a mask shorter than the cache); those rows "
        f"were left unchanged. {CUDA_CHECKS_ENV}=1 runs every step with host checks, which give "
        "the full message (and which a one-token write into already packed tiles, a rollback "
        "after assisted decoding, needs).")


def _cuda_step_attention(q, f, mask, scale, causal, window, checked: bool):
    """The CUDA attention of any step in one kernel launch and without a host sync
    (``kernels/triton/attention.kvarn_attention``: the exact region, the packed tiles with
    the causal bound, window and mask applied inside, and their log-sum-exp merge). Equal to
    the reference wherever it is defined; the mask-length check is the reference's (a host
    read) in the checked mode and a device flag otherwise."""
    from kvarn_compile.kernels import kvarn_attention
    from kvarn_compile.kernels.triton import append as triton_append

    if mask is not None and checked:
        attention_ref.check_mask(f, mask)
    d, dv = q.shape[-1], f.sink_v.shape[-1]
    rot = triton_append.rotation(d, q.device)
    rot_v = rot if dv == d else triton_append.rotation(dv, q.device)
    exact = [t if t.is_contiguous() else t.contiguous()      # (a state's own: contiguous)
             for t in (f.sink_k, f.sink_v, f.tail_k, f.tail_v)]
    return kvarn_attention(
        q if q.stride(-1) == 1 else q.contiguous(), *exact,
        f.lengths, f.n_tiles, *f.k.core, *f.v.core, rot, rot_v, scale=float(scale),
        causal=causal, window=window, mask=mask, k_plain=f.k_plain,
        error_flags=None if checked or mask is None else triton_append.error_flags(q.device),
        error_bit=triton_append.ERR_MASK)


# ------------------------------------------------------------------------------ append
_UNFIT_LOGGED: set[tuple[int, int, int]] = set()


def tiles_fit(geo: Geometry) -> bool:
    """Whether the Triton tile quantizer fits both tiles of a layer of this geometry
    (``kernels.triton.quantize.tile_fits``). Where it does not, the reference quantizes them
    (the same codes, slower): said once per shape on the ``kvarn_compile.ops`` log."""
    from kvarn_compile.kernels.triton.quantize import tile_fits

    if tile_fits("k", geo.head_dim, geo.group) and tile_fits("v", geo.value_head_dim, geo.group):
        return True
    shape = (geo.head_dim, geo.value_head_dim, geo.group)
    if shape not in _UNFIT_LOGGED:
        _UNFIT_LOGGED.add(shape)
        log.warning("kvarn: the Triton tile quantizer does not fit tiles of head dims %d / %d "
                    "(keys / values) x %d tokens on a GPU; the reference quantizes them (same "
                    "codes, slower)", *shape)
    return False


def freeze_tiles_triton(buffers: list[torch.Tensor], row: int, tokens_k: torch.Tensor,
                        tokens_v: torch.Tensor, first_tile: int, method: str, iters: int) -> bool:
    """Quantize [H, f*G, D] K/V of one row into tile slots with the Triton kernel
    (a :data:`append_ref.TileKernel`).

    Per-tile key frames (``key_frame="auto"``) as in the reference: the frame of each K tile
    is chosen in torch (``choose_key_frame``), then one launch quantizes the rotated tiles
    and one the plain ones (per-channel RTN), each skipping the other's slots. Returns False
    (nothing written) where the kernel does not apply: no usable triton, fp8 scales, tiles
    it does not fit on a GPU (``tile_fits``: logged once per shape), non-finite input (the
    reference handles those).
    """
    from kvarn_compile.kernels import quantize_tiles_into, triton_available
    from kvarn_compile.quant.quantize import choose_key_frame

    f = unpack(buffers)
    if not triton_available() or f.layout.fp8_factors:
        return False
    geo = Geometry.of(f)
    if not tiles_fit(geo):
        return False
    if not bool(torch.isfinite(tokens_k).all() & torch.isfinite(tokens_v).all()):
        return False
    n = tokens_k.shape[1] // geo.group
    dst = torch.arange(first_tile, first_tile + n, device=tokens_k.device)[None, :]
    rotate, normalize = method != "kivi", method == "kvarn"
    plain = None
    if f.k_plain is not None and rotate:
        tiles = tokens_k.float().reshape(tokens_k.shape[0], n, geo.group, geo.head_dim)
        plain = choose_key_frame(tiles)                                  # [H, n] bool
    for kind, bits, x in (("k", geo.key_bits, tokens_k), ("v", geo.value_bits, tokens_v)):
        out = [t[row:row + 1] for t in f.tiles(kind).core]
        if kind == "k" and plain is not None:
            # heads have frames of their own: heads become the kernel's batch rows
            heads = x.shape[0]
            by_head = [t.view(heads, 1, *t.shape[2:]) for t in out]
            for frame, rot in ((plain, False), (~plain, True)):
                sel = torch.where(frame, dst.expand(heads, n), torch.full_like(frame, -1, dtype=dst.dtype))
                if bool((sel >= 0).any()):
                    quantize_tiles_into(x[:, None], *by_head, kind=kind, bits=bits, rotate=rot,
                                        normalize=normalize and rot, iters=iters, dst_tile=sel)
            f.k_plain[row, :, first_tile:first_tile + n] = plain.to(torch.uint8)
            continue
        quantize_tiles_into(x[None], *out, kind=kind, bits=bits, rotate=rotate,
                            normalize=normalize, iters=iters, dst_tile=dst)
    return True


@library.append_.register_kernel("cuda")
def _append_cuda(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name):
    """Without host checks (a CUDA graph, ``KVARN_CUDA_CHECKS=0``) the decode step's append
    runs on the device alone (``kernels/triton/append.py``); else the reference bookkeeping
    with the Triton tile quantizer."""
    from kvarn_compile.kernels import triton_available

    single = k.dim() == 4 and k.shape[2] == 1
    if not (_single_token_checks_on(k.device) if single else cuda_checks_on()) \
            and triton_available():
        from kvarn_compile.kernels.triton import append as triton_append

        append_ref.check_method(method)
        if triton_append.applies(unpack(buffers), k, method, hold, check_finite, v=v):
            triton_append.append_decode(buffers, k, v, start_pos, method=method, iters=iters,
                                        recent=recent)
            return
    append_ref.append_(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name,
                      tile_kernel=freeze_tiles_triton)


@library.cp_append_.register_kernel("cuda")
def _cp_append_cuda(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name,
                    group):
    context_parallel.append_(buffers, k, v, start_pos, method, iters, recent, hold, check_finite,
                             name, group, tile_kernel=freeze_tiles_triton)


@library.commit_.register_kernel("cuda")
def _commit_cuda(buffers, upto, method, iters, recent, check_finite, name):
    append_ref.commit_(buffers, upto, method, iters, recent, check_finite, name,
                      tile_kernel=freeze_tiles_triton)


def freeze_tiles_cpu(buffers: list[torch.Tensor], row: int, tokens_k: torch.Tensor,
                     tokens_v: torch.Tensor, first_tile: int, method: str, iters: int) -> bool:
    """Quantize [H, f*G, D] K/V of one row into tile slots with the C++ CPU quantizer
    (a :data:`append_ref.TileKernel`; ``kernels/cpu/quantize.py``).

    Bit-identical to the reference quantizer: codes, scales, zero points and per-tile key
    frames (``key_frame="auto"``, chosen per K tile in C++ by the reference rule). Takes op
    methods with the clip option too (``"kvarn+clip"``: ``handles_clip``). Returns False
    (nothing written) where it does not apply: kernel off or not built, fp8 scales,
    non-contiguous buffers, a non-finite value, a scale overflowing its dtype (the
    reference handles or reports those).
    """
    from kvarn_compile.kernels.cpu import quantize as cpu_quantize

    base, clip = append_ref.split_method(method)
    f = unpack(buffers)
    if base not in ("kvarn", "hadamard") or clip not in ("none", "mse") \
            or f.layout.fp8_factors or f.k.row_scale.dtype not in cpu_quantize.SCALE_DTYPES \
            or not cpu_quantize.available():
        return False
    geo = Geometry.of(f)
    k_dst = [t[row] for t in f.k.core]
    v_dst = [t[row] for t in f.v.core]
    plain = None if f.k_plain is None else f.k_plain[row]
    if any(not t.is_contiguous() for t in (*k_dst, *v_dst, *(() if plain is None else (plain,)))):
        return False
    return cpu_quantize.freeze(tokens_k, tokens_v, k_dst, v_dst, plain, first_tile,
                               key_bits=geo.key_bits, value_bits=geo.value_bits,
                               group=geo.group, rotate=True, normalize=base == "kvarn",
                               iters=iters, clip=clip == "mse")


freeze_tiles_cpu.handles_clip = True


@functools.lru_cache(maxsize=1)
def _native_append() -> None:
    cpu_attention.register_native_ops(append_ref.OP_METHODS)


@library.append_.register_kernel("cpu")
def _append_cpu(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name):
    """The decode-step append in one C++ call where it applies (``cpu_attention.append_decode``:
    every row continues, no tile completes); else the reference's bookkeeping with the C++ tile
    quantizer (:func:`freeze_tiles_cpu`). Once the C++ kernel is built, the first call also
    registers that append as the ops' native AutogradCPU kernel (``csrc/ops.cpp``): later
    calls that it covers never reach Python."""
    append_ref.check_method(method)
    if cpu_attention.available():
        _native_append()
        if not check_finite and cpu_attention.append_decode(buffers, k, v, start_pos, recent, hold):
            return
    append_ref.append_(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name,
                      tile_kernel=freeze_tiles_cpu)


def _append_from_cpu(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name,
                     cache_k, cache_v, fresh):
    """``append_from_`` with the CPU append called directly (the op's default kernel goes
    through ``torch.ops.kvarn.append_`` again: a second dispatch per layer and step)."""
    append_ref.adopt_(buffers, cache_k, cache_v, start_pos, method, iters, recent, hold,
                     check_finite, name, fresh, append=_append_cpu)
    _append_cpu(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name)


# The compiled decode step calls append_from_ once per layer and token: registered as the
# op's CPU kernel directly, without custom_op's per-device Python wrapper (its aliasing
# check has nothing to check for an op that returns nothing; ~35 us per call).
library.register_plain_kernel("append_from_", _append_from_cpu, "CPU")


@library.cp_append_.register_kernel("cpu")
def _cp_append_cpu(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name, group):
    context_parallel.append_(buffers, k, v, start_pos, method, iters, recent, hold, check_finite,
                             name, group, tile_kernel=freeze_tiles_cpu)


@library.commit_.register_kernel("cpu")
def _commit_cpu(buffers, upto, method, iters, recent, check_finite, name):
    append_ref.commit_(buffers, upto, method, iters, recent, check_finite, name,
                      tile_kernel=freeze_tiles_cpu)


# ------------------------------------------------------------------------------ tile partials
@library.tile_partials_triton_.register_kernel("cuda")
def _tile_partials_triton_cuda(q_rot, q_plain, k_codes, k_row_scale, k_row_zero, k_col_scale,
                               v_codes, v_row_scale, v_row_zero, v_col_scale, k_plain, n_tiles,
                               kv_lo, kv_hi, bias, lse_part, scale, split_max):
    """The standalone split-K Triton kernel behind the ``tile_partials_`` contract.

    Offered (CUDA) only for one query token without a bias: there kv_hi equals the filled
    length (the query is the newest token), so the kernel's kv_start bound is the only
    mask. The kernel merges its own splits; the result goes to split slot 0.
    """
    from kvarn_compile.kernels.triton.attention import kvarn_decode_attention

    out, lse = kvarn_decode_attention(q_rot.contiguous(), k_codes, k_row_scale, k_row_zero,
                                      k_col_scale, v_codes, v_row_scale, v_row_zero,
                                      v_col_scale, n_tiles, scale=scale, kv_start=kv_lo,
                                      q_plain=None if k_plain is None else q_plain.contiguous(),
                                      k_plain=k_plain)
    b, hq, tq = q_rot.shape[:3]
    o_part = out.new_zeros(b, hq, tq, split_max, v_col_scale.shape[-1])
    o_part[:, :, :, 0] = out
    lse_part.fill_(float("-inf"))
    lse_part[..., 0] = lse
    return o_part
