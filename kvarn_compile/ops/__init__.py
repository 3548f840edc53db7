"""KVarN runtime ops. Importing this package registers ``torch.ops.kvarn.*``.

One op family, one module, the same name in every layer (``kernels/``, ``lowering/``,
``tests/``, ``benchmarks/``):

* :mod:`.library` - every op's schema and fake kernel (the default implementation of each
  op calls its reference below);
* :mod:`.append` - the pure-torch reference of the cache writes (``append_``, ``commit_``,
  ``adopt_``, ``reorder_``, ``positions_start``);
* :mod:`.attention` - the pure-torch reference of ``attention`` and ``tile_partials_`` (the
  one implementation of the dual-scale tile math);
* :mod:`.regions` - the exact (sink + tail) region and the log-sum-exp merge, shared by the
  reference, the kernel path and the Inductor decomposition;
* :mod:`.dispatch` - the device kernels (C++ on CPU, Triton on CUDA), registered against
  the library ops;
* :mod:`.keyed` - packed states addressed by key (the keyed ops of ``inductor_pass``) and
  the release of model-owned cache buffers;
* :mod:`.context_parallel` - one sequence's tiles over the ranks of a process group.

Each reference is its op's eager fallback, the oracle of every kernel and the baseline of
the benchmarks, on any device.
"""

from kvarn_compile.ops import dispatch, library  # noqa: F401  (registers torch.ops.kvarn)
