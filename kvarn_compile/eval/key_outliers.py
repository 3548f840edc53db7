"""The stress model: key-bias outliers added to a model's keys, :func:`add_key_outliers`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers is imported lazily: it takes seconds
    from transformers import PreTrainedModel

__all__ = ["KEY_OUTLIERS", "KeyOutlierHooks", "add_key_outliers"]

#: Default outliers of :func:`add_key_outliers`: channel of every KV head -> offset added
#: to the k_proj output (before RoPE). Channel 10 and 50 of a 64-dim head sit in different
#: RoPE frequency bands, so after RoPE one offset turns slowly, the other faster.
KEY_OUTLIERS: dict[int, float] = {10: 100.0, 50: 150.0}


@dataclass
class KeyOutlierHooks:
    """Handles of the hooks :func:`add_key_outliers` registered; ``remove()`` undoes them."""

    handles: list
    layers: tuple[int, ...]
    channels: dict[int, float]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def add_key_outliers(model: PreTrainedModel, *, layers: int | tuple[int, ...] = 4,
                     channels: dict[int, float] | None = None) -> KeyOutlierHooks:
    """Give the keys of ``model`` huge near-constant channels, like a learned k_proj bias.

    Adds ``channels[c]`` to channel ``c`` of every KV head of the k_proj output (before
    RoPE) in the first ``layers`` decoder layers (or the listed layer indices) through
    forward hooks. Some popular model families have such a bias (|k| > 100 in a few
    channels, ~1 elsewhere); this builds the same structure into the default model so the
    effect on rotation-based quantizers can be tested without another download.
    """
    channels = dict(KEY_OUTLIERS if channels is None else channels)
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if any(not 0 <= c < head_dim for c in channels):
        raise ValueError(f"Expected channels in [0, {head_dim}), but got {sorted(channels)}.")
    decoder = getattr(model, "model", model)
    blocks = getattr(decoder, "layers", None)
    if blocks is None or not all(hasattr(b, "self_attn") and hasattr(b.self_attn, "k_proj") for b in blocks):
        raise ValueError(f"Expected a decoder with layers[i].self_attn.k_proj (Llama-style), "
                         f"but {type(model).__name__} has none.")
    idx = tuple(range(min(layers, len(blocks)))) if isinstance(layers, int) else tuple(layers)
    offset = torch.zeros(kv_heads, head_dim)
    for c, value in channels.items():
        offset[:, c] = value
    offset = offset.reshape(-1)

    def hook(_module, _inputs, out):
        return out + offset.to(out.dtype).to(out.device)

    handles = [blocks[i].self_attn.k_proj.register_forward_hook(hook) for i in idx]
    return KeyOutlierHooks(handles=handles, layers=idx, channels=channels)
