"""KVarN runtime ops. Importing this package registers ``torch.ops.kvarn.*``.

* :mod:`.library` - every op's schema, fake kernel and default implementation;
* :mod:`.reference` - the pure-torch implementations: each op's default, the oracle of
  every kernel and the benchmark baseline, on any device;
* :mod:`.regions` - the exact (sink + tail) region and the log-sum-exp merge, shared by the
  reference, the kernel path and the Inductor decomposition;
* :mod:`.dispatch` - the device kernels (C++ on CPU, Triton on CUDA), registered against
  the library ops.
"""

from kvarn_compile.ops import dispatch, library  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile.ops.library import append_, attention, commit_

__all__ = ["append_", "attention", "commit_"]
