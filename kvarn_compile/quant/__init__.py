"""Pure-torch reference math of KVarN: the readable oracle, the eager CPU implementation
and the benchmark baseline of every kvarn_compile kernel.

* :mod:`.rotation` - the orthonormal head-dim rotations (Hadamard and fallbacks);
* :mod:`.quantize` - normalization, RTN, scale folding, bit packing, dequant, and the
  baselines (``method="kivi"``, ``method="hadamard"``);
* :mod:`.cache` - a whole sequence as sink + packed tiles + tail, with byte accounting.

``fake_quantize`` is the stable evaluation entry point (quantize then dequantize); it is
never part of the runtime path, which stores packed codes.
"""

from kvarn_compile.quant.cache import QuantizedKV, quantize_cache, split_lengths
from kvarn_compile.quant.quantize import (
    NonFiniteError, QuantizedTiles, dequantize_kv, dequantize_tiles, fake_quantize, imbalance,
    normalize_variance, pack_codes, quantize_kv, quantize_tiles, rtn_rows, unpack_codes,
)
from kvarn_compile.quant.rotation import is_hadamard_dim, rotate, rotation_matrix, unrotate

__all__ = [
    "fake_quantize", "quantize_kv", "dequantize_kv", "quantize_tiles", "dequantize_tiles",
    "QuantizedTiles", "QuantizedKV", "quantize_cache", "split_lengths", "normalize_variance",
    "imbalance", "rtn_rows", "pack_codes", "unpack_codes", "rotation_matrix", "rotate",
    "unrotate", "is_hadamard_dim", "NonFiniteError",
]
