"""A whole K/V sequence split into sink, quantized tiles and high-precision tail.

This is the reference layout of one layer's cache, built in one go from full K/V (for
evaluation, bits-per-element accounting and as the oracle of the runtime cache)::

    tokens:  [0 ........ S) [S .................. S + n*G) [S + n*G ....... T)
             sink (exact)   quantized tiles (packed codes)   tail (exact: the incomplete
                                                              tile plus the recent window R)
"""

from __future__ import annotations

import dataclasses

import torch

from kvarn_compile.config import KVarNConfig
from kvarn_compile.quant.quantize import QuantizedTiles, dequantize_kv, quantize_kv

__all__ = ["QuantizedKV", "quantize_cache", "split_lengths"]


def split_lengths(tokens: int, config: KVarNConfig) -> tuple[int, int, int]:
    """(sink, quantized, tail) token counts for a sequence of ``tokens`` committed tokens."""
    sink = min(tokens, config.sink)
    rest = max(tokens - sink - config.recent_window, 0)
    quantized = rest - rest % config.group_size
    return sink, quantized, tokens - sink - quantized


@dataclasses.dataclass
class QuantizedKV:
    """One layer's compressed K/V: exact sink and tail around packed K and V tiles."""

    config: KVarNConfig
    sink_k: torch.Tensor          # [..., S, D] high precision
    sink_v: torch.Tensor
    k_tiles: QuantizedTiles | None  # [..., n, D, G]
    v_tiles: QuantizedTiles | None  # [..., n, G, D]
    tail_k: torch.Tensor          # [..., T_tail, D] high precision
    tail_v: torch.Tensor

    @property
    def tokens(self) -> int:
        n = 0 if self.k_tiles is None else self.k_tiles.shape[-3] * self.config.group_size
        return self.sink_k.shape[-2] + n + self.tail_k.shape[-2]

    @property
    def elements(self) -> int:
        """Number of K plus V elements represented."""
        return self.tokens * (self.sink_k.shape[-1] + self.sink_v.shape[-1]) * _lead(self.sink_k)

    def _exact_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.sink_k, self.sink_v, self.tail_k, self.tail_v))

    def quantized_bytes(self) -> int:
        return sum(t.nbytes for t in (self.k_tiles, self.v_tiles) if t is not None)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor held: sink, codes, scales, zero points, tail."""
        return self._exact_bytes() + self.quantized_bytes()

    def bpe(self) -> float:
        """Bits per element over the whole cache, from the live tensors."""
        return 8 * self.nbytes / self.elements

    def quantized_bpe(self) -> dict[str, float]:
        """Bits per element of the quantized region alone, for K and for V."""
        out = {}
        for name, tiles in (("k", self.k_tiles), ("v", self.v_tiles)):
            if tiles is not None:
                out[name] = 8 * tiles.nbytes / _numel(tiles.shape)
        return out

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K̂, V̂) token-major in the original frame and the sink's dtype."""
        rotated = self.config.method != "kivi"
        parts_k, parts_v = [self.sink_k.float()], [self.sink_v.float()]
        if self.k_tiles is not None:
            parts_k.append(dequantize_kv(self.k_tiles, "k", rotated=rotated))
            parts_v.append(dequantize_kv(self.v_tiles, "v", rotated=rotated))
        parts_k.append(self.tail_k.float())
        parts_v.append(self.tail_v.float())
        dtype = self.sink_k.dtype
        return torch.cat(parts_k, -2).to(dtype), torch.cat(parts_v, -2).to(dtype)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _lead(x: torch.Tensor) -> int:
    return _numel(tuple(x.shape[:-2]))


def quantize_cache(k: torch.Tensor, v: torch.Tensor, config: KVarNConfig, *,
                   exact_dtype: torch.dtype | None = None) -> QuantizedKV:
    """Compress full K [..., T, D] and V [..., T, Dv] (post-RoPE, token-major; Dv = D but for
    multi-head latent attention) with ``config``.

    The sink and tail are kept in ``exact_dtype`` (default: the input dtype).
    """
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"Expected K and V of one shape but for the head dim, but got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}.")
    exact_dtype = exact_dtype or k.dtype
    sink, n_q, _ = split_lengths(k.shape[-2], config)
    tiles = {}
    for kind, bits, x in (("k", config.key_bits, k), ("v", config.value_bits, v)):
        region = x[..., sink:sink + n_q, :]
        tiles[kind] = None if n_q == 0 else quantize_kv(
            region, kind, method=config.method, bits=bits, group=config.group_size,
            iters=config.sinkhorn_iters, scale_dtype=config.torch_scale_dtype,
            check_finite=config.check_finite, key_frame=config.key_frame, clip=config.clip)
    return QuantizedKV(
        config=config,
        sink_k=k[..., :sink, :].to(exact_dtype).clone(), sink_v=v[..., :sink, :].to(exact_dtype).clone(),
        k_tiles=tiles["k"], v_tiles=tiles["v"],
        tail_k=k[..., sink + n_q:, :].to(exact_dtype).clone(),
        tail_v=v[..., sink + n_q:, :].to(exact_dtype).clone())
