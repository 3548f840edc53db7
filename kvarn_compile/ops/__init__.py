"""KVarN runtime ops. Importing this package registers ``torch.ops.kvarn.*``.

* :mod:`.reference` - pure-torch implementations (the CPU kernels and the oracle);
* :mod:`.library` - the ``torch.library.custom_op`` registrations and fake kernels.
"""

from kvarn_compile.ops import library, positions  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile.ops.library import attention, append_, commit_

__all__ = ["append_", "attention", "commit_"]
