"""Inductor lowering of ``kvarn::positions_start`` for a single cache position.

A decode step writes one position: there is nothing to check (one position is always a
contiguous run, one batch row always agrees with itself), so the op is a broadcast of that
position to ``[batch]`` int64, which Inductor fuses into the neighbouring kernels instead of
calling the op (one Python call per layer and step). Any other shape - several positions,
symbolic sizes - returns None and keeps the op, whose checks then run.
"""

from __future__ import annotations

import math

import sympy
import torch

from kvarn_compile._torch_compat import inductor, static_ints

__all__ = ["lower_positions_start"]


def lower_positions_start(positions, batch):
    """User lowering of ``torch.ops.kvarn.positions_start.default``; None falls back to the op."""
    sizes = static_ints(positions.get_size())
    if sizes is None or math.prod(sizes) != 1 or not isinstance(batch, int) or batch < 1:
        return None
    ind = inductor()
    load = positions.make_loader()
    first = [sympy.Integer(0)] * len(sizes)

    def inner_fn(index):
        return ind.ops.to_dtype(load(first), torch.int64)

    return ind.ir.Pointwise.create(device=positions.get_device(), dtype=torch.int64,
                                   inner_fn=inner_fn, ranges=[sympy.Integer(batch)])
