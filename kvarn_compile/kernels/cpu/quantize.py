"""CPU kernel: the KVarN tile quantizer in C++, bit-identical to the reference.

It computes exactly what ``quant/quantize.py`` computes, operation by operation, so
codes, scales, zero points and key-frame flags come out bit for bit the same:

* the rotation is the same ATen matmul on the same tensor (``x.float() @ H`` on the whole
  [..., T, D] token block, as ``quantize_kv`` calls it);
* the variance normalization is the reference's canonical form (``normalize_variance``):
  float64 statistics summed left to right (lanes over the other axis are independent, so
  the loops vectorize without reordering any sum), IEEE division and sqrt, the linear-domain
  update c = clip(c * clip(std, 1e-3, 1e3), e^-0.3, e^10), the fp32 tile scaling
  Y = (X / fp32(c)) / fp32(r), the ``<=`` keep-best rule on the float64 imbalance;
* RTN in fp32 with round-half-to-even (``std::nearbyint``), the MSE clip search with float64
  left-to-right error sums, the fp32 scale folding, the storage casts (fp16/bf16 round to
  nearest even, as torch's) and the little-end-first packing;
* key frames (``key_frame="auto"``): the dominance test of ``choose_key_frame`` in fp32,
  per K tile; plain tiles are per-channel RTN (no rotation, no normalization).

The build uses ``-ffp-contract=off`` (no fused multiply-add: every product is rounded as
torch rounds it) and no fast-math. Work is split over tiles (and heads, K and V) with
``at::parallel_for``; each tile is computed by one thread, so threading never changes bits.

The kernel declines (returns None / False; the reference then runs) where it does not apply:
a non-finite value in the input (the reference isolates bad tokens), fp8 scales, and, for
the runtime op, a scale that overflows its storage dtype (the reference raises there).

The C++ source is ``kernels/csrc/quantize.cpp``; ``kernels/cpu/build.py`` compiles it on
first use with ``torch.utils.cpp_extension.load`` (a C++ compiler and ninja; well under a
minute, then cached), like the attention kernel (``kernels/cpu/attention.py``) and under
the same switch: ``KVARN_CPU_KERNEL=0`` turns it off, ``=require`` makes a failed build an
error (the test suite sets it); otherwise a failed build logs a warning and the ops use the
pure-torch reference.
"""

from __future__ import annotations

import functools
import logging

import torch

from kvarn_compile.kernels.cpu.build import KernelBuildError, build_extension, load, mode, usable

__all__ = ["available", "build", "quantize_kv", "freeze", "SCALE_DTYPES", "KernelBuildError"]

log = logging.getLogger(__name__)

#: Scale storage dtypes the kernel writes (fp8 scales: the reference).
SCALE_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


@functools.lru_cache(maxsize=1)
def _module():
    return load("quantize")


def build():
    """Build (or load the cached build of) the extension; raises :class:`KernelBuildError`
    with the compiler's message when it cannot be built."""
    return build_extension(_module, "tile quantizer")


@functools.lru_cache(maxsize=1)
def _built() -> bool:
    return usable(build, log)


def available() -> bool:
    """True when the C++ quantizer builds (or is already built) here and is not turned off
    (``KVARN_CPU_KERNEL=0``). With ``KVARN_CPU_KERNEL=require`` a failed build raises
    :class:`KernelBuildError` instead of returning False."""
    return mode() != "0" and _built()


@functools.lru_cache(maxsize=1)
def _consts() -> tuple[list[float], list[float]]:
    from kvarn_compile.quant import quantize as q

    return ([q.STD_CLIP[0], q.STD_CLIP[1], q.SCALE_CLIP[0], q.SCALE_CLIP[1], q.IMBALANCE_EPS,
             q.DELTA_MIN, q.DOMINANCE_THRESHOLD, torch.finfo(torch.float32).tiny,
             float(q.CLIP_MAX_BITS)], list(q.CLIP_RATIOS))


def _rotation(d: int) -> torch.Tensor:
    from kvarn_compile.quant.rotation import rotation_matrix

    return rotation_matrix(d, torch.device("cpu"))   # the tensor the reference multiplies by


def _check_bits(bits: int) -> None:
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"Expected bits in (2, 3, 4, 8), but got {bits}.")


def quantize_kv(x: torch.Tensor, kind: str, *, method: str = "kvarn", bits: int = 4,
                group: int = 128, iters: int = 8, scale_dtype: torch.dtype = torch.float16,
                key_frame: str = "rotated", clip: str = "none"):
    """``reference.quantize_kv`` of CPU ``x`` [..., tokens, head_dim] in C++: the same
    :class:`~kvarn_compile.quant.quantize.QuantizedTiles`, bit for bit.

    Returns None where the kernel does not apply (the caller runs the reference): a NaN/inf
    in ``x`` (or in its rotation), fp8 scales. (``check_finite`` has no meaning here: the
    input is finite or the kernel declines.)
    """
    from kvarn_compile.quant.quantize import (
        QuantizedTiles, _check_clip, _check_key_frame, _check_kind, _method_flags,
    )

    _check_kind(kind)
    _check_key_frame(key_frame)
    _check_clip(clip)
    _check_bits(bits)
    rotate, normalize = _method_flags(method)
    if scale_dtype not in SCALE_DTYPES or x.device.type != "cpu" or not x.is_floating_point():
        return None
    *lead, t, d = x.shape
    if t % group:
        raise ValueError(f"Expected the token count to be a multiple of group={group}, but got {t}.")
    consts, ratios = _consts()
    auto = kind == "k" and key_frame == "auto" and rotate
    codes, rs, rz, cs, plain, flags = _module().kvarn_quantize(
        x, _rotation(d) if rotate else None, kind == "k", bits, group, normalize, iters,
        clip == "mse" and kind == "k", auto, SCALE_DTYPES[scale_dtype], consts, ratios)
    if int(flags) & 1:
        return None
    n = t // group

    def shaped(a: torch.Tensor) -> torch.Tensor:
        return a.view(*lead, n, *a.shape[2:])

    return QuantizedTiles(codes=shaped(codes), row_scale=shaped(rs), row_zero=shaped(rz),
                          col_scale=shaped(cs), bits=bits,
                          plain=shaped(plain) if auto else None)


def freeze(tokens_k: torch.Tensor, tokens_v: torch.Tensor, k_dst: list[torch.Tensor],
           v_dst: list[torch.Tensor], plain_dst: torch.Tensor | None, first_tile: int, *,
           key_bits: int, value_bits: int, group: int, rotate: bool, normalize: bool,
           iters: int, clip: bool) -> bool:
    """Quantize K [H, n*G, D] and V [H, n*G, Dv] of one batch row into tile slots
    first_tile.. of the contiguous destinations (k_dst / v_dst: codes, row_scale, row_zero,
    col_scale, each [H, N, ...]; plain_dst [H, N] uint8 for per-tile key frames, else None).
    K rotates with the D-sized Hadamard, V with the Dv-sized one (Dv may differ from D:
    multi-head latent attention decompressed).

    Returns False with nothing written where a value is not finite or a scale overflows its
    storage dtype (the reference then runs: it isolates bad tokens, or raises).
    """
    consts, ratios = _consts()
    rot_k = rot_v = None
    if rotate:
        d, dv = tokens_k.shape[-1], tokens_v.shape[-1]
        rot_k = _rotation(d)
        rot_v = rot_k if dv == d else _rotation(dv)
    return bool(_module().kvarn_freeze(
        tokens_k, tokens_v, rot_k, rot_v, k_dst, v_dst,
        plain_dst, int(first_tile), int(key_bits), int(value_bits), int(group), bool(normalize),
        int(iters), bool(clip), consts, ratios))
