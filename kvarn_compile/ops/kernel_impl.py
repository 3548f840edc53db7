"""Kernel implementations of the kvarn ops: Triton on CUDA, C++ on CPU.

``attention``: the exact regions (sink and tail) are attended in torch with their
log-sum-exp; the packed tiles go through a tile kernel (the split-K Triton decode kernel
on CUDA, the C++ kernel of ``kernels/cpu_attention.py`` on CPU: in-register unpack,
dual-scale fold, rotated frame); the two parts are merged by log-sum-exp and the tile part
is rotated back once. The kernel path is taken only where it is exact: every quantized
token is older than every query (always true in decoding), no mask hides any position of
the quantized region, and the scales are not fp8. Anything else runs the reference.

``freeze``: tile quantization (rotation, normalization, RTN, packing) in one kernel per
(tile, head), written in place into the packed buffers.
"""

from __future__ import annotations

import torch

from kvarn_compile.ops import reference
from kvarn_compile.reference.rotation import rotation_matrix
from kvarn_compile.state import BUF, N_BASE_BUFFERS

__all__ = ["attention", "kernel_applies", "freeze_tiles"]


def kernel_applies(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None) -> bool:
    """True when the tile kernel computes exactly what the reference computes."""
    if len(buffers) > N_BASE_BUFFERS:          # fp8 scales: the kernel reads fp16/bf16/fp32
        return False
    s = buffers[BUF["sink_k"]].shape[2]
    g = buffers[BUF["k_col_scale"]].shape[-1]
    lengths, n_tiles = buffers[BUF["lengths"]], buffers[BUF["n_tiles"]]
    tq = q.shape[2]
    if bool((((s + n_tiles * g) > (lengths - tq)) & (n_tiles > 0)).any()):
        return False                           # a query would need causal masking inside tiles
    if mask is not None:
        used = int(n_tiles.max())
        region = mask[..., s:s + used * g]
        if region.dtype == torch.bool:
            if not bool(region.all()):
                return False
        elif bool((region != 0).any()):
            return False
    return True


def _triton_tiles(q_rot, buffers, scale, kv_start):
    from kvarn_compile.kernels import kvarn_decode_attention

    return kvarn_decode_attention(
        q_rot, *(buffers[BUF[n]] for n in (
            "k_codes", "k_row_scale", "k_row_zero", "k_col_scale",
            "v_codes", "v_row_scale", "v_row_zero", "v_col_scale")),
        buffers[BUF["n_tiles"]], scale=float(scale), kv_start=kv_start)


def _cpu_tiles(q_rot, buffers, scale, kv_start):
    from kvarn_compile.kernels.cpu_attention import tile_attention

    names = ("codes", "row_scale", "row_zero", "col_scale")
    return tile_attention(q_rot, [buffers[BUF[f"k_{n}"]] for n in names],
                          [buffers[BUF[f"v_{n}"]] for n in names], buffers[BUF["n_tiles"]],
                          scale=float(scale), kv_start=kv_start)


def attention(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None,
              scale: float, causal: bool, window: int, *, kernel: str = "triton") -> torch.Tensor:
    """Fused attention with the tile part on ``kernel`` ("triton" or "cpu")."""
    if not kernel_applies(q, buffers, mask):
        return reference.attention(q, buffers, mask, scale, causal, window)
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
    tiles = _triton_tiles if kernel == "triton" else _cpu_tiles
    out_t, lse_t = tiles((q.float() @ rot).contiguous(), buffers, scale, kv_start)
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

    if len(buffers) > N_BASE_BUFFERS or not bool(torch.isfinite(tokens_k).all() & torch.isfinite(tokens_v).all()):
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
