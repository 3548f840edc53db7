"""``kvarn::positions_start``: the first written position, checked to be a contiguous run.

Model code writes its cache at a positions tensor (``cache_position``, ``input_pos``). The
packed cache appends runs of consecutive positions, so the rewrite routes the positions
through this op: it returns ``positions[0]`` broadcast to the batch and raises if the
positions are not ``p, p+1, ..., p+T-1`` (e.g. tree attention), instead of silently
writing tokens to the wrong place.
"""

from __future__ import annotations

import torch

__all__ = ["positions_start"]


@torch.library.custom_op("kvarn::positions_start", mutates_args=())
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


@positions_start.register_fake
def _positions_start_fake(positions, batch):
    return positions.new_empty((batch,), dtype=torch.int64)
