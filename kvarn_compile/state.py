"""The packed KV-cache state of one attention layer: preallocated, static-shaped tensors.

Token layout of batch row b (S sink tokens, G tokens per tile, n_tiles[b] frozen tiles)::

    positions  [0, S)                 -> sink_k/sink_v, high precision (model dtype)
    positions  [S, S + n_tiles*G)     -> packed tiles: codes + dual scales (rotated frame)
    positions  [S + n_tiles*G, len)   -> tail_k/tail_v, a ring buffer of W slots,
                                         position p lives in slot (p - S) % W

A tile is frozen (rotated, normalized, quantized, packed) as soon as its G tokens are
committed and at least ``recent_window`` newer committed tokens exist; its tail slots are
then free again. Nothing else holds these tokens: no full-precision copy of the quantized
region exists. Every buffer is allocated once to the maximum length so compiled graphs
and CUDA graphs see static shapes.

The buffers travel to the custom ops as one flat list (``LayerState.buffers``); the
``BUF`` table names the positions in that list.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from kvarn_compile.config import KVarNConfig

__all__ = ["BUF", "LayerState", "allocate_layer", "fp16_cache_bytes"]

#: Positions of the tensors in the flat buffer list handed to the ops.
BUF = {name: i for i, name in enumerate((
    "sink_k", "sink_v",                                   # [B, H, S, D] exact dtype
    "k_codes", "k_row_scale", "k_row_zero", "k_col_scale",  # [B,H,n,D,G*kb/8] [B,H,n,D] [B,H,n,D] [B,H,n,G]
    "v_codes", "v_row_scale", "v_row_zero", "v_col_scale",  # [B,H,n,G,D*vb/8] [B,H,n,G] [B,H,n,G] [B,H,n,D]
    "tail_k", "tail_v",                                   # [B, H, W, D] exact dtype, ring buffer
    "lengths", "committed", "n_tiles",                    # [B] int64
    "capacity",                                           # [B] int64: max_len, constant
    "k_row_factor", "k_col_factor", "v_row_factor", "v_col_factor",  # [B,H,n,1] fp16 (fp8 scales only)
))}
N_BASE_BUFFERS = BUF["k_row_factor"]
#: Count of the fp8 scale factors that follow the base buffers when scales are fp8.
N_FP8_FACTORS = 4

__all__ += ["N_BASE_BUFFERS", "has_fp8_factors", "key_plain"]


def has_fp8_factors(buffers: list[torch.Tensor]) -> bool:
    """True when the state stores its scales as fp8 (the four factor buffers follow)."""
    return len(buffers) >= N_BASE_BUFFERS + N_FP8_FACTORS


def key_plain(buffers: list[torch.Tensor]) -> torch.Tensor | None:
    """The per-tile key-frame flags (uint8 [B, H, n]; 1 = tile stored un-rotated), if any.

    Only states of a ``key_frame="auto"`` config have them: they are the last buffer, after
    the fp8 factors when scales are fp8.
    """
    return buffers[-1] if (len(buffers) - N_BASE_BUFFERS) % N_FP8_FACTORS == 1 else None


@dataclasses.dataclass
class LayerState:
    """One layer's packed cache. ``buffers`` is the flat list the ops mutate in place."""

    config: KVarNConfig
    buffers: list[torch.Tensor]
    max_len: int
    name: str = ""

    def __getattr__(self, item: str) -> torch.Tensor:
        index = BUF.get(item)
        if index is None:
            raise AttributeError(item)
        buffers = self.__dict__["buffers"]
        if index >= len(buffers) or (index >= N_BASE_BUFFERS and not has_fp8_factors(buffers)):
            raise AttributeError(f"{item} is only allocated for float8_e4m3fn scales")
        return buffers[index]

    @property
    def k_plain(self) -> torch.Tensor | None:
        """Per-tile key-frame flags (``key_frame="auto"`` states only), else None."""
        return key_plain(self.buffers)

    # ------------------------------------------------------------------ geometry
    @property
    def batch(self) -> int:
        return self.sink_k.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.sink_k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.sink_k.shape[-1]

    @property
    def sink_len(self) -> int:
        return self.sink_k.shape[2]

    @property
    def max_tiles(self) -> int:
        return self.k_codes.shape[2]

    @property
    def tail_len(self) -> int:
        return self.tail_k.shape[2]

    # ------------------------------------------------------------------ accounting
    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the state holds, counted from the live tensors."""
        return sum(t.numel() * t.element_size() for t in self.buffers)

    def used_bytes(self) -> dict[str, int]:
        """Bytes that hold the current tokens, by region (for bits-per-element reports).

        Preallocated but still empty tile slots are not counted here; ``nbytes`` counts
        them. Per batch row: the sink and the W tail slots are always in use.
        """
        tiles = self.n_tiles.tolist()
        per_tile = sum(self.buffers[BUF[n]][0, :, 0].numel() * self.buffers[BUF[n]].element_size()
                       for n in ("k_codes", "k_row_scale", "k_row_zero", "k_col_scale",
                                 "v_codes", "v_row_scale", "v_row_zero", "v_col_scale"))
        per_tile += sum(self.buffers[i][0, :, 0].numel() * self.buffers[i].element_size()
                        for i in range(N_BASE_BUFFERS, len(self.buffers)))  # fp8 factors, frames
        exact = lambda t: t[0].numel() * t.element_size()  # noqa: E731
        return {
            "sink": self.batch * (exact(self.sink_k) + exact(self.sink_v)),
            "tiles": sum(tiles) * per_tile,
            "tail": self.batch * (exact(self.tail_k) + exact(self.tail_v)),
        }

    def describe(self) -> str:
        c = self.config
        return (f"LayerState({self.name or 'layer'}: B={self.batch}, H={self.kv_heads}, "
                f"D={self.head_dim}, max_len={self.max_len}, sink={self.sink_len}, "
                f"tiles={self.max_tiles}x{c.group_size}, tail={self.tail_len}, "
                f"{c.short()}, {self.nbytes} bytes)")


def _tail_slots(config: KVarNConfig, spec_tokens: int) -> int:
    """Ring size: one tile still filling + the recent window + room for uncommitted tokens."""
    g = config.group_size
    return g + config.recent_window + g * math.ceil(spec_tokens / g)


def allocate_layer(config: KVarNConfig, *, batch: int, kv_heads: int, head_dim: int,
                   max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                   spec_tokens: int = 0, name: str = "") -> LayerState:
    """Preallocate one layer's packed cache for ``max_len`` tokens per batch row.

    ``spec_tokens`` is how many uncommitted (speculative) tokens beyond a full tail tile
    may exist at once; with the default auto-commit 0 suffices.
    """
    if head_dim % 16 or head_dim < 16:
        raise ValueError(f"Expected head_dim to be a multiple of 16, but got {head_dim}.")
    if not dtype.is_floating_point:
        raise ValueError(f"Expected a floating-point model dtype, but got {dtype}.")
    if max_len < 1 or batch < 1 or kv_heads < 1:
        raise ValueError(f"Expected positive batch, kv_heads and max_len, but got "
                         f"{batch}, {kv_heads}, {max_len}.")
    g = config.group_size
    # sink and tail are "high precision": fp16 like the reference for fp32 models (so the
    # comparison with an fp16 cache is fair), the model's own dtype for fp16/bf16 models
    exact = torch.float16 if dtype == torch.float32 and config.exact_dtype == "auto" else dtype
    if config.exact_dtype == "float32":
        exact = torch.float32
    sink = min(config.sink, max_len)
    tiles = max(max_len - sink, 0) // g
    tail = _tail_slots(config, spec_tokens)
    kb, vb = config.key_bits, config.value_bits
    if (g * kb) % 8 or (head_dim * vb) % 8:
        raise ValueError(f"{kb}/{vb}-bit codes do not pack whole bytes for G={g}, D={head_dim}.")
    sdt = config.torch_scale_dtype
    zdt = torch.float16 if sdt == torch.float8_e4m3fn else sdt
    shape = (batch, kv_heads)

    def new(*dims: int, dt: torch.dtype) -> torch.Tensor:
        return torch.zeros(*shape, *dims, dtype=dt, device=device)

    buffers = [
        new(sink, head_dim, dt=exact), new(sink, head_dim, dt=exact),
        new(tiles, head_dim, g * kb // 8, dt=torch.uint8), new(tiles, head_dim, dt=sdt),
        new(tiles, head_dim, dt=zdt), new(tiles, g, dt=sdt),
        new(tiles, g, head_dim * vb // 8, dt=torch.uint8), new(tiles, g, dt=sdt),
        new(tiles, g, dt=zdt), new(tiles, head_dim, dt=sdt),
        new(tail, head_dim, dt=exact), new(tail, head_dim, dt=exact),
        torch.zeros(batch, dtype=torch.int64, device=device),
        torch.zeros(batch, dtype=torch.int64, device=device),
        torch.zeros(batch, dtype=torch.int64, device=device),
        torch.full((batch,), max_len, dtype=torch.int64, device=device),
    ]
    if sdt == torch.float8_e4m3fn:
        buffers += [new(tiles, 1, dt=torch.float16) for _ in range(N_FP8_FACTORS)]
    if config.key_frame == "auto" and config.method != "kivi":
        buffers.append(new(tiles, dt=torch.uint8))   # k_plain: 1 = tile stored un-rotated
    return LayerState(config=config, buffers=buffers, max_len=max_len, name=name)


def fp16_cache_bytes(*, batch: int, kv_heads: int, head_dim: int, tokens: int) -> int:
    """Bytes of a plain fp16 K+V cache holding ``tokens`` tokens (the comparison baseline)."""
    return 2 * batch * kv_heads * tokens * head_dim * 2
