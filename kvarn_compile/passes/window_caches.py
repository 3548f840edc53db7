"""Caches that keep only the newest tokens (sliding-window layers): the ``WINDOW_CACHES`` table.

Matched on the cache the attention's K is read from; :func:`refuse_sliding_window` refuses such
a site with a reason, and the layer keeps its full-precision cache and attention.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

from kvarn_compile.passes.fx_utils import Unsupported, example, is_op

__all__ = ["WINDOW_CACHES", "refuse_sliding_window"]


def _last_rows(n: fx.Node) -> int | None:
    """N when ``n`` is ``x[:, :, -N:]`` / ``x[:, :, -N:, :]`` (keep the newest N positions)."""
    if not is_op(n, "getitem") or not isinstance(n.args[1], tuple):
        return None
    index = n.args[1]
    if not (len(index) in (3, 4) and all(s == slice(None) for s in index[:2])
            and (len(index) == 3 or index[3] == slice(None))):
        return None
    sl = index[2]
    if isinstance(sl, slice) and isinstance(sl.start, int) and sl.start < 0 \
            and sl.stop is None and sl.step in (None, 1):
        return -sl.start
    return None


def _window_slice(keys: fx.Node) -> str | None:
    # transformers DynamicSlidingWindowLayer:  self.keys = cat([past, k])[:, :, -W + 1:]
    # transformers StaticSlidingWindowLayer, prefill past the window:
    #   self.keys.copy_(k[:, :, -W:])   /   self.keys.copy_(cat((keys[:, :, 1:], k))[:, :, -W:])
    for user in keys.users:
        rows = _last_rows(user)
        if rows is not None:
            return f"keeps only the newest {rows} positions (keys[:, :, -{rows}:])"
    return None


def _window_roll(keys: fx.Node) -> str | None:
    # transformers StaticSlidingWindowLayer, window full:
    #   new = self.keys.roll(-1, dims=-2); new[:, :, tensor([-1])] = k; self.keys.copy_(new)
    for user in keys.users:
        if user.op == "call_method" and user.target == "roll":
            val = example(keys)
            length = val.shape[2] if val is not None and val.dim() == 4 else "?"
            return f"rolls a {length}-slot window (keys.roll(-1, dims=-2) + copy_)"
    return None


#: Caches that keep only a window of the newest tokens (matched on the cache the attention's
#: K is read from). Such a site is refused: see ``refuse_sliding_window``.
WINDOW_CACHES: list[tuple[str, Callable[[fx.Node], str | None]]] = [
    ("window_slice", _window_slice),   # transformers Dynamic/StaticSlidingWindowLayer: k[:, :, -W:]
    ("window_roll", _window_roll),     # transformers StaticSlidingWindowLayer: roll + copy_
]


def refuse_sliding_window(source: Any) -> None:
    # A sliding-window cache forgets old tokens and its attention mask counts positions inside
    # the window, not from the start of the sequence; the KVarN cache keeps every token and
    # its attention takes absolute positions. Rewriting would attend outside the window.
    if not isinstance(source, fx.Node):
        return
    for _, matcher in WINDOW_CACHES:
        spelling = matcher(source)
        if spelling is not None:
            raise Unsupported(f"sliding-window attention: its cache {spelling}; "
                              "KVarN compresses full-attention caches only, so this layer keeps "
                              "its full-precision cache and attention")
