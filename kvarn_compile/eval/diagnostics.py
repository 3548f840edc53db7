"""Where the quantization error sits and which part of it matters (the paper's diagnostics).

All diagnostics use the static setting (see :mod:`.harness`): the prefix ``[0, L - b)`` of a
window is quantized once and the last block of ``b`` tokens is run against it.

* :func:`relative_errors` / :func:`attention_output_errors`: per layer, ‖x̂ − x‖ / ‖x‖ of K
  and V over the quantized region, and of each layer's self-attention output (the module's
  output, with the *same* input hidden states fed to the fp and the quantized run, so the
  number isolates that layer's cache error from upstream error).
* :func:`error_terms` / :func:`quantile_buckets`: per token, ‖k − k̂‖² splits exactly into
  a magnitude part (‖k‖ − ‖k̂‖)² and a direction part 2‖k‖‖k̂‖(1 − cos θ); the buckets say
  how much of the total error the worst tokens hold and which part dominates there.
* :func:`restore_entries`: the outlier experiment, restoring the top k% worst entries
  (per element |x − x̂|, per layer and tensor) to full precision, or all the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvarn_compile.config import KVarNConfig
from kvarn_compile.quant import split_lengths

from .harness import block_logits, n_layers

__all__ = [
    "quantized_region", "relative_errors", "attention_modules", "attention_output_errors",
    "error_terms", "quantile_buckets", "restore_entries", "DEFAULT_BUCKETS",
]

#: Error-quantile buckets (by rank of the per-token error, worst first): top 1%, 1-5%, rest.
DEFAULT_BUCKETS: tuple[tuple[str, float, float], ...] = (
    ("top 1%", 0.0, 0.01), ("top 1-5%", 0.01, 0.05), ("rest 95%", 0.05, 1.0), ("top 5%", 0.0, 0.05),
)


def quantized_region(tokens: int, config: KVarNConfig) -> slice:
    """Token slice of the quantized tiles in a cache of ``tokens`` tokens."""
    sink, n_q, _ = split_lengths(tokens, config)
    return slice(sink, sink + n_q)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def relative_errors(fp_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    q_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], region: slice
                    ) -> dict[str, list[float]]:
    """Per layer ‖x̂ − x‖ / ‖x‖ of K and V over the quantized ``region``."""
    k_rel, v_rel = [], []
    for (k, v), (kh, vh) in zip(fp_kv, q_kv):
        k_rel.append(_rel(kh[..., region, :], k[..., region, :]))
        v_rel.append(_rel(vh[..., region, :], v[..., region, :]))
    return {"k_rel": k_rel, "v_rel": v_rel}


# ------------------------------------------------------------------------------ attention output
def attention_modules(model) -> list[torch.nn.Module]:
    """The self-attention module of every decoder layer, in layer order (names ``*.self_attn``)."""
    mods = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    if len(mods) != n_layers(model):
        raise RuntimeError(f"Expected one '*.self_attn' module per layer ({n_layers(model)}), but "
                           f"found {len(mods)}; attention-output diagnostics need that naming.")
    return mods


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


@torch.no_grad()
def attention_output_errors(model, ids_block: torch.Tensor,
                            fp_prefix_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                            q_prefixes: dict[str, Sequence[tuple[torch.Tensor, torch.Tensor]]]
                            ) -> dict[str, list[float]]:
    """Per layer relative error of the self-attention output, quantized vs fp prefix cache.

    One fp run records every attention module's input and output; each quantized run
    (one per entry of ``q_prefixes``) feeds each attention module the *fp* input it saw
    and compares its output. Returns {name: [error per layer]}.
    """
    mods = attention_modules(model)
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    mode = {"replay": False}

    def pre_hook(i):
        def hook(module, args, kwargs):
            if not mode["replay"]:
                inputs[i] = _hidden(args, kwargs).detach().clone()
                return None
            if "hidden_states" in kwargs:
                kwargs = {**kwargs, "hidden_states": inputs[i]}
            else:
                args = (inputs[i], *args[1:])
            return args, kwargs
        return hook

    def post_hook(i):
        def hook(module, args, kwargs, output):
            out = output[0] if isinstance(output, tuple) else output
            outputs[i] = out.detach().clone()
        return hook

    handles = []
    try:
        for i, m in enumerate(mods):
            handles.append(m.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
            handles.append(m.register_forward_hook(post_hook(i), with_kwargs=True))
        block_logits(model, ids_block, fp_prefix_kv)
        fp_out = dict(outputs)
        mode["replay"] = True
        result = {}
        for name, q_kv in q_prefixes.items():
            outputs.clear()
            block_logits(model, ids_block, q_kv)
            result[name] = [_rel(outputs[i], fp_out[i]) for i in range(len(mods))]
        return result
    finally:
        for h in handles:
            h.remove()


# ------------------------------------------------------------------------------ error split
def error_terms(x: torch.Tensor, x_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token vector (last dim) total ‖x − x̂‖², magnitude and direction parts, flattened.

    ‖x − x̂‖² = (‖x‖ − ‖x̂‖)² + 2‖x‖‖x̂‖(1 − cos θ) exactly (float64 here).
    """
    x, x_hat = x.double().flatten(0, -2), x_hat.double().flatten(0, -2)
    total = (x - x_hat).pow(2).sum(-1)
    nx, nh = x.norm(dim=-1), x_hat.norm(dim=-1)
    mag = (nx - nh).pow(2)
    # 2|x||x̂|(1 - cos) = 2(|x||x̂| - x·x̂): no division, exact for zero vectors too
    direction = 2.0 * (nx * nh - (x * x_hat).sum(-1))
    return total, mag, direction


def quantile_buckets(total: torch.Tensor, mag: torch.Tensor, direction: torch.Tensor,
                     buckets: Sequence[tuple[str, float, float]] = DEFAULT_BUCKETS) -> list[dict]:
    """Share of the total squared error and its magnitude/direction split per error-rank bucket.

    Tokens are ranked by their total error, worst first; bucket (name, lo, hi) holds ranks
    [lo·n, hi·n). ``error_share`` is the bucket's part of all error; ``magnitude_share`` and
    ``direction_share`` split the bucket's own error (they sum to 1).
    """
    order = torch.argsort(total, descending=True)
    total, mag, direction = total[order], mag[order], direction[order]
    n = total.numel()
    grand = float(total.sum())
    out = []
    for name, lo, hi in buckets:
        a, b = int(round(lo * n)), int(round(hi * n))
        t = float(total[a:b].sum())
        m = float(mag[a:b].sum())
        d = float(direction[a:b].sum())
        out.append({"bucket": name, "lo": lo, "hi": hi, "tokens": b - a,
                    "error_share": t / grand if grand > 0 else 0.0,
                    "magnitude_share": m / t if t > 0 else 0.0,
                    "direction_share": d / t if t > 0 else 0.0,
                    "mean_error": t / max(b - a, 1)})
    return out


# ------------------------------------------------------------------------------ outliers
def restore_entries(x: torch.Tensor, x_hat: torch.Tensor, fraction: float, part: str = "top"
                    ) -> tuple[torch.Tensor, float, float]:
    """Restore entries of ``x_hat`` to ``x``: the top ``fraction`` by |x − x̂| ("top") or the others ("rest").

    Returns (restored tensor, squared error before, squared error after).
    """
    if part not in ("top", "rest"):
        raise ValueError(f"Expected part 'top' or 'rest', but got {part!r}.")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"Expected a fraction in [0, 1], but got {fraction}.")
    err = (x - x_hat).abs().flatten()
    count = int(round(fraction * err.numel()))
    mask = torch.zeros_like(err, dtype=torch.bool)
    if count:
        mask[torch.topk(err, count, sorted=False).indices] = True
    if part == "rest":
        mask = ~mask
    out = torch.where(mask.view_as(x), x, x_hat)
    before = float((x - x_hat).double().pow(2).sum())
    after = float((x - out).double().pow(2).sum())
    return out, before, after


@torch.no_grad()
def outlier_experiment(model, ids_block: torch.Tensor, ref_logits: torch.Tensor,
                       fp_prefix_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                       q_prefix_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], region: slice,
                       fractions: Sequence[float]) -> list[dict]:
    """KL/top-1 of the last block and the remaining MSE after restoring top-k% / the rest.

    Restoring is done per layer and per tensor (K and V) over the quantized ``region``.
    """
    from .harness import kl_top1

    rows = []
    for fraction in fractions:
        for part in ("top", "rest"):
            kv, before, after = [], 0.0, 0.0
            for (k, v), (kh, vh) in zip(fp_prefix_kv, q_prefix_kv):
                pair = []
                for x, xh in ((k, kh), (v, vh)):
                    restored, b0, b1 = restore_entries(x[..., region, :], xh[..., region, :],
                                                       fraction, part)
                    before, after = before + b0, after + b1
                    full = xh.clone()
                    full[..., region, :] = restored
                    pair.append(full)
                kv.append(tuple(pair))
            kl, agree = kl_top1(ref_logits, block_logits(model, ids_block, kv))
            rows.append({"fraction": fraction, "restore": part, "kl": float(kl.mean()),
                         "top1": float(agree.mean()),
                         "mse_remaining": after / before if before > 0 else 0.0})
    return rows
