"""Deprecated name of :mod:`kvarn_compile.quant` (the pure-torch quantizer), kept for one release.

``kvarn_compile.reference``, ``.reference.quantize``, ``.reference.rotation`` and
``.reference.cache`` are the modules of :mod:`kvarn_compile.quant` under their old names.
"""

import sys
import warnings

from kvarn_compile import quant
from kvarn_compile.quant import cache, quantize, rotation
from kvarn_compile.quant import *  # noqa: F401,F403

__all__ = list(quant.__all__)

for _module in (cache, quantize, rotation):
    sys.modules[f"{__name__}.{_module.__name__.rpartition('.')[2]}"] = _module

warnings.warn("kvarn_compile.reference is now kvarn_compile.quant; the old name goes in the next "
              "release.", DeprecationWarning, stacklevel=2)
