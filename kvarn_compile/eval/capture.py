"""Real KV tensors: every layer's keys and values of one forward pass, :func:`capture_kv`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers is imported lazily: it takes seconds
    from transformers import PreTrainedModel

__all__ = ["capture_kv"]


@torch.no_grad()
def capture_kv(
    model: PreTrainedModel, input_ids: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run one forward pass and return every layer's cached keys and values.

    The keys are post-RoPE, exactly as a ``transformers.DynamicCache`` stores them; the LM head
    is skipped (only the decoder stack runs).

    Args:
        model: a Hugging Face causal LM (e.g. from :func:`~.models.load_model`).
        input_ids: ``[batch, tokens]`` (or ``[tokens]``, treated as batch 1) token ids.

    Returns:
        One ``(keys, values)`` pair per layer, each ``[batch, kv_heads, tokens, head_dim]`` in
        the model dtype. Sliding-window layers would hold only their window.
    """
    from transformers import DynamicCache

    from kvarn_compile.hf import cache_kwarg

    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"Expected integer input_ids of shape [batch, tokens], but got dtype "
            f"{input_ids.dtype} and shape {tuple(input_ids.shape)}. Pass token ids, e.g. from "
            f"text_windows()."
        )
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    decoder = getattr(model, "base_model", model)
    decoder(input_ids=input_ids.to(device), use_cache=True, **{cache_kwarg(decoder): cache})
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    if len(kv) != n_layers or any(k is None for k, _ in kv):
        raise RuntimeError(
            f"Expected the cache to hold {n_layers} filled layers, but got {len(kv)}. "
            f"Is {type(model).__name__} a decoder that writes to a DynamicCache?"
        )
    return kv
