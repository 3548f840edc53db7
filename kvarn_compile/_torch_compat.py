"""Every private PyTorch API kvarn_compile touches, in one version-gated place.

Tested with torch 2.13. These internals (``torch._inductor``, ``torch._logging._internal``)
change between releases; when they move, only this module should need an edit. Each
helper fails with a clear message naming the torch version instead of an AttributeError
deep inside a compile.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
from typing import Any

import torch

__all__ = ["TESTED_TORCH", "check_torch_version", "compile_fx_with_pass", "kvarn_sources_hash",
           "KVarNUUIDPass"]

TESTED_TORCH = ((2, 13), (2, 14))   # inclusive range of minor versions


def _torch_minor() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch_version() -> None:
    lo, hi = TESTED_TORCH
    if not lo <= _torch_minor() <= hi:
        raise RuntimeError(
            f"kvarn_compile's compiler integration is tested with torch {lo[0]}.{lo[1]}-"
            f"{hi[0]}.{hi[1]}, but torch {torch.__version__} is installed. Install a tested "
            "torch (pip install torch==2.13.0) or use the eager KVarNCache without compiling.")


# ------------------------------------------------------------------------------ sources hash
@functools.lru_cache(maxsize=1)
def kvarn_sources_hash() -> str:
    """sha256 over every source file of the package (passes, ops, kernels, templates)."""
    root = pathlib.Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".jinja") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _uuid_pass_class() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _KVarNUUIDPass(CustomGraphPass):
        """A no-op post-grad pass whose uuid() hashes every kvarn source file.

        User lowerings and templates are not part of Inductor's FX-graph cache key; with
        this pass installed an edited kernel or pass never hits a stale compiled graph.
        """

        def __call__(self, graph: torch.fx.Graph) -> None:
            return None

        def uuid(self) -> Any:
            return kvarn_sources_hash()

    return _KVarNUUIDPass


def KVarNUUIDPass() -> Any:  # noqa: N802  (a factory that reads like the class)
    return _uuid_pass_class()()


# ------------------------------------------------------------------------------ compile
def compile_fx_with_pass(gm: torch.fx.GraphModule, inputs: list[Any], mode: str | None = None):
    """Inductor's compile_fx with the kvarn uuid pass (and the options of ``mode``)."""
    check_torch_version()
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches: dict[str, Any] = {"post_grad_custom_post_pass": KVarNUUIDPass()}
    if mode:
        patches.update(list_mode_options(mode))
    return compile_fx(gm, inputs, config_patches=patches)
