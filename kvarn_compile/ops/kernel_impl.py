"""Kernel implementations of the kvarn ops: Triton on CUDA, C++ on CPU.

``attention`` on CUDA: the exact regions (sink and tail) are attended in torch with their
log-sum-exp; the packed tiles go through the split-K Triton decode kernel (in-register
unpack, dual-scale fold, rotated frame); the two parts are merged by log-sum-exp and the
tile part is rotated back once. On CPU the whole step (sink, tiles, tail, one online
softmax, the rotations) is one call of the C++ kernel of ``kernels/cpu_attention.py``.
The kernel path is taken only where it is exact: every quantized token is visible to every
query (always true in decoding, including the step whose append froze the query's own
tile), no mask hides any position of the quantized region, and the scales are not fp8.
Anything else runs the reference.

``freeze``: tile quantization (rotation, normalization, RTN, packing) in one kernel per
(tile, head), written in place into the packed buffers.
"""

from __future__ import annotations

import torch

from kvarn_compile.ops import reference
from kvarn_compile.reference.rotation import rotation_matrix
from kvarn_compile.state import BUF, N_BASE_BUFFERS, has_fp8_factors, key_plain

__all__ = ["attention", "kernel_applies", "freeze_tiles"]


def kernel_applies(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None) -> bool:
    """True when the tile kernel computes exactly what the reference computes."""
    if has_fp8_factors(buffers):               # fp8 scales: the kernel reads fp16/bf16/fp32
        return False
    s = buffers[BUF["sink_k"]].shape[2]
    g = buffers[BUF["k_col_scale"]].shape[-1]
    tq = q.shape[2]
    # (plain ints: this runs on every decode step, a handful of tiny tensor ops cost more)
    lengths, n_tiles = buffers[BUF["lengths"]].tolist(), buffers[BUF["n_tiles"]].tolist()
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


def _triton_tiles(q_rot, buffers, scale, kv_start, q_plain=None):
    from kvarn_compile.kernels import kvarn_decode_attention

    frames = key_plain(buffers)              # key_frame="auto": per-tile key frames
    return kvarn_decode_attention(
        q_rot, *(buffers[BUF[n]] for n in (
            "k_codes", "k_row_scale", "k_row_zero", "k_col_scale",
            "v_codes", "v_row_scale", "v_row_zero", "v_col_scale")),
        buffers[BUF["n_tiles"]], scale=float(scale), kv_start=kv_start,
        q_plain=None if frames is None else q_plain, k_plain=frames)


def _cpu_attention(q, buffers, mask, scale, causal, window, k_plain=None):
    """The whole step in one C++ call; None where the kernel cannot read this cache."""
    from kvarn_compile.kernels import cpu_attention

    sink_k = buffers[BUF["sink_k"]]
    bsz, heads, _, d = sink_k.shape
    if q.dim() != 4 or q.shape[0] != bsz or q.shape[-1] != d or q.shape[1] % heads:
        return None                            # the reference raises the descriptive error
    kb = 8 * buffers[BUF["k_codes"]].shape[-1] // buffers[BUF["k_col_scale"]].shape[-1]
    vb = 8 * buffers[BUF["v_codes"]].shape[-1] // d
    if not cpu_attention.supports(d, buffers[BUF["k_row_scale"]].dtype, sink_k.dtype) \
            or (kb, vb) not in cpu_attention.SUPPORTED_BITS:
        return None
    lengths = buffers[BUF["lengths"]]
    if mask is not None and mask.shape[-1] < int(lengths.max()):
        raise ValueError(f"KVarN attention: the mask covers {mask.shape[-1]} key positions, but the "
                         f"cache holds up to {int(lengths.max())}; expected a mask as long as the cache.")
    names = ("codes", "row_scale", "row_zero", "col_scale")
    return cpu_attention.decode_attention(
        q, (buffers[BUF["sink_k"]], buffers[BUF["sink_v"]]),
        [buffers[BUF[f"k_{n}"]] for n in names], [buffers[BUF[f"v_{n}"]] for n in names],
        (buffers[BUF["tail_k"]], buffers[BUF["tail_v"]]), lengths, buffers[BUF["n_tiles"]],
        scale=float(scale), causal=causal, window=window, mask=mask, k_plain=k_plain)


def attention(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None,
              scale: float, causal: bool, window: int, *, kernel: str = "triton") -> torch.Tensor:
    """Fused attention with the tile part on ``kernel`` ("triton" or "cpu")."""
    if not kernel_applies(q, buffers, mask):
        return reference.attention(q, buffers, mask, scale, causal, window)
    if kernel == "cpu":
        out = _cpu_attention(q, buffers, mask, scale, causal, window, k_plain=key_plain(buffers))
        if out is None:
            return reference.attention(q, buffers, mask, scale, causal, window)
        return out.to(q.dtype)
    out_e, lse_e = reference.attention(q, buffers, mask, scale, causal, window, tiles=False,
                                       return_lse=True)
    d = q.shape[-1]
    rot = rotation_matrix(d, q.device)
    s = buffers[BUF["sink_k"]].shape[2]
    kv_start = None
    if window > 0:     # quantized token index i (position s + i) is visible if > q_pos - window
        lengths = buffers[BUF["lengths"]]
        q_pos = lengths[:, None] - q.shape[2] + torch.arange(q.shape[2], device=q.device)[None, :]
        kv_start = (q_pos - window + 1 - s).clamp(min=0)
    q32 = q.float().contiguous()
    out_t, lse_t = _triton_tiles((q32 @ rot).contiguous(), buffers, scale, kv_start, q32)
    peak = torch.maximum(lse_e, lse_t)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    w_e, w_t = torch.exp(lse_e - peak), torch.exp(lse_t - peak)
    denom = (w_e + w_t).clamp_min(torch.finfo(torch.float32).tiny)
    out = (w_e[..., None] * out_e + w_t[..., None] * (out_t @ rot.T)) / denom[..., None]
    return out.to(q.dtype)


def freeze_tiles(buffers: list[torch.Tensor], row: int, tokens_k: torch.Tensor,
                 tokens_v: torch.Tensor, first_tile: int, method: str, iters: int) -> bool:
    """Quantize [H, f*G, D] K/V of one row into tile slots with the Triton kernel.

    Returns False (nothing written) where the kernel does not apply: fp8 scales or
    non-finite input (the reference handles those).
    """
    from kvarn_compile.kernels import quantize_tiles_into

    # fp8 scales and per-tile key frames (key_frame="auto") are quantized by the reference
    if len(buffers) != N_BASE_BUFFERS or not bool(torch.isfinite(tokens_k).all() & torch.isfinite(tokens_v).all()):
        return False
    g = buffers[BUF["k_col_scale"]].shape[-1]
    f = tokens_k.shape[1] // g
    dst = torch.arange(first_tile, first_tile + f, device=tokens_k.device)[None, :]
    kb = 8 * buffers[BUF["k_codes"]].shape[-1] // g
    vb = 8 * buffers[BUF["v_codes"]].shape[-1] // tokens_k.shape[-1]
    for kind, bits, x in (("k", kb, tokens_k), ("v", vb, tokens_v)):
        names = [f"{kind}_codes", f"{kind}_row_scale", f"{kind}_row_zero", f"{kind}_col_scale"]
        quantize_tiles_into(x[None], *(buffers[BUF[n]][row:row + 1] for n in names), kind=kind,
                            bits=bits, rotate=method != "kivi", normalize=method == "kvarn",
                            iters=iters, dst_tile=dst)
    return True
