"""kvarn_compile: KVarN-compressed KV caches for any PyTorch model, through torch.compile.

Public API (more arrives as the backend grows):

* :class:`KVarNConfig`, :func:`get_config`, :data:`PRESETS` - what the cache stores;
* :func:`kvarn_backend` - the torch.compile backend (``model.compile(backend=kvarn_backend())``);
* :mod:`kvarn_compile.reference` - the pure-torch quantizer, ``fake_quantize`` for evaluation.
"""

from kvarn_compile.backend import KVarNBackend, kvarn_backend
from kvarn_compile.config import PRESETS, KVarNConfig, get_config

__all__ = ["KVarNConfig", "PRESETS", "get_config", "kvarn_backend", "KVarNBackend"]
__version__ = "0.1.0"
