"""kvarn_compile: KVarN-compressed KV caches for any PyTorch model, through torch.compile.

Public API (more arrives as the backend grows):

* :class:`KVarNConfig`, :func:`get_config`, :data:`PRESETS` - what the cache stores;
* :class:`KVarNOptions` - how a front-end keeps its caches (``max_cache_len``,
  ``release_buffers``, ``spec_tokens``), taken by every front-end;
* :func:`kvarn_backend` - the torch.compile backend (``model.compile(backend=kvarn_backend())``);
* :func:`inductor_pass` - the same rewrite as an Inductor pre-grad pass, for
  ``backend="inductor"`` (``options={"pre_grad_custom_pass": inductor_pass()}``);
* :mod:`kvarn_compile.quant` - the pure-torch quantizer, ``fake_quantize`` for evaluation.
"""

from kvarn_compile.backend import KVarNBackend, kvarn_backend
from kvarn_compile.config import PRESETS, KVarNConfig, KVarNOptions, get_config

__all__ = ["KVarNConfig", "KVarNOptions", "PRESETS", "get_config", "kvarn_backend", "KVarNBackend",
           "inductor_pass"]
__version__ = "0.1.0"


def inductor_pass(preset="k4v2", **kwargs):
    """KVarN as an Inductor pre-grad pass (see :mod:`kvarn_compile.pre_grad_pass`):

        kv = inductor_pass(preset="k4v2")
        model.compile(options={"pre_grad_custom_pass": kv}); print(kv.report)

    Imported on first use (it loads torch._inductor).
    """
    from kvarn_compile.pre_grad_pass import inductor_pass as make

    return make(preset, **kwargs)
