"""Triton kernels of kvarn_compile, each with a thin launcher and a pure-torch reference.

* quantize (``kernels/quantize.py``, kernel ``_kvarn_quantize_tiles_kernel``): rotate,
  variance-normalize, round, fold and pack whole tiles in place.
  Launchers: :func:`quantize_tiles_into` (into preallocated cache tensors at given tile
  indices) and :func:`quantize_tiles_triton` (returns ``QuantizedTiles``).
  Reference: :func:`kvarn_compile.quant.quantize_kv` / ``quantize_tiles``.
* attention (``kernels/attention.py``):

  - ``_kvarn_attn_kernel``, launcher :func:`kvarn_attention`: ``kvarn::attention`` of one
    step in one launch: split-K over the packed tiles, the exact sink and tail ring, and
    the log-sum-exp merge by the program that finishes last (the CUDA op's path);
  - ``_kvarn_decode_attn_kernel`` and ``_combine_splits_kernel``, launchers
    :func:`kvarn_decode_attention` (stacked tensors), :func:`kvarn_decode_attention_tiles`
    (``QuantizedTiles``), :func:`combine_splits`: the packed tiles alone (the
    ``tile_partials_`` contract), output and log-sum-exp for a merge by the caller.

  Both run the tile loop ``_decode_range`` (in-register unpack, the dual-scale fold, GQA
  heads packed per program), which the Inductor decode template runs too.
  Reference: softmax attention over ``quant.dequantize_tiles`` (see tests/kernels/test_triton.py).

Without a GPU the kernels run on CPU tensors under the Triton interpreter: set
``TRITON_INTERPRET=1`` before triton is first imported. The launchers are imported lazily,
so :func:`triton_available` works even where triton is not installed.
"""

from __future__ import annotations

import importlib
import os

__all__ = [
    "triton_available", "quantize_tiles_into", "quantize_tiles_triton",
    "kvarn_attention", "kvarn_decode_attention", "kvarn_decode_attention_tiles",
    "combine_splits", "CUDA_PRECISION",
]

#: The code-matmul precision of the decode kernel and template on a GPU: fp16 operands (codes
#: exact as 1024 + code, the other operand rounded to tf32's 11-bit significand, fp32 sums),
#: 1.3-1.4x faster than tf32 on an H200 at 32k-128k tokens, outputs within 3e-4 of it
#: (benchmarks/bench_decode_attention_gpu.py, template_sweep). Its limit is fp16's range:
#: q * rs_k and p * rs_v beyond 65504 overflow (scores of that size saturate any softmax);
#: the default model over 1024 tokens of news text stays four orders of magnitude below it
#: (largest |q * rs_k| 4.0, |rs_v| 8.6: benchmarks/fp16_operand_range.py).
#: Without a GPU (the interpreter) the default is exact fp32 ("ieee").
CUDA_PRECISION = "fp16"

_LAUNCHERS = {
    "quantize_tiles_into": "kvarn_compile.kernels.triton.quantize",
    "quantize_tiles_triton": "kvarn_compile.kernels.triton.quantize",
    "kvarn_attention": "kvarn_compile.kernels.triton.attention",
    "kvarn_decode_attention": "kvarn_compile.kernels.triton.attention",
    "kvarn_decode_attention_tiles": "kvarn_compile.kernels.triton.attention",
    "combine_splits": "kvarn_compile.kernels.triton.attention",
}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


#: ``KVARN_TRITON_PTX``: "1" / "0" force inline PTX in the Triton kernels on or off (default:
#: :func:`use_inline_ptx` decides; the sm_90 static report sets it, compiling on a CPU-only torch).
PTX_ENV = "KVARN_TRITON_PTX"


def use_inline_ptx() -> bool:
    """Whether the Triton kernels use inline PTX (``lop3``: the phased loop's AND-OR of two
    codes in one instruction, where ptxas made two or kept register moves): only where they
    are compiled for an NVIDIA GPU, i.e. not under the interpreter (which runs no PTX) and
    with a CUDA build of torch (not ROCm or XPU). Read once, when the kernels' module loads."""
    forced = os.environ.get(PTX_ENV, "").strip().lower()
    if forced in ("0", "1", "true", "false", "on", "off", "yes", "no"):
        return forced in ("1", "true", "on", "yes")
    if _interpreting():
        return False
    import torch

    return torch.version.cuda is not None and torch.version.hip is None


def triton_available() -> bool:
    """True when triton imports and can run here: a CUDA device, or ``TRITON_INTERPRET=1``."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install failing at import
        return False
    if _interpreting():
        return True
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def __getattr__(name: str):
    if name in _LAUNCHERS:
        return getattr(importlib.import_module(_LAUNCHERS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
