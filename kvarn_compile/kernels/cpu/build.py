"""Builds the C++ CPU kernels of ``kernels/csrc`` with ``torch.utils.cpp_extension.load``.

Two extensions, each compiled on first use (a C++ compiler and ninja; about a minute on 2
idle cores) into ``cpu_kernels/<name>/`` of the kvarn cache folder (``KVARN_CACHE_DIR``,
default ``~/.cache/kvarn_compile``; :func:`build_dir`), and loaded from there afterwards. A
build is announced on the ``kvarn_compile.kernels.cpu.build`` logger (a warning: it shows
without any logging set up) with the time it took; :func:`is_built` tells beforehand, and
:func:`announced_elsewhere` hands the announcement to a caller that shows it itself (the
main job makes the build a phase of its own):

* ``attention``: ``attention.cpp`` (the decode / tile attention; it defines the module),
  ``latent_attention.cpp`` (``kvarn::latent_attention``; helpers shared with attention.cpp in
  ``attention_common.h``), ``append.cpp`` (the decode-step append fast path) and ``ops.cpp``
  (that append as the native AutogradCPU kernel of ``kvarn::append_`` / ``append_from_``),
  with ``-ffp-contract=fast``; launchers in ``kernels/cpu/attention.py``;
* ``quantize``: ``quantize.cpp`` (the tile quantizer), with ``-ffp-contract=off
  -fno-fast-math`` (no fused multiply-add: every product rounds as in torch, so the
  result is the reference's bit for bit); launchers in ``kernels/cpu/quantize.py``.

Both include ``kvarn_common.h`` and build with ``-O3 -march=native -fopenmp``. The
extension's name carries a hash of the sources (every ``csrc/*.h`` too), flags, torch's
version and C++ ABI and the Python version, and a hash of the CPU model: an edited source
is never served from an old build, a build is never loaded into another torch (that
crashes the process), and ``-march=native`` builds never mix when the cache is shared
between machines.

``KVARN_CPU_KERNEL`` switches both kernels: ``0`` turns them off, ``require`` makes a
failed build an error (:class:`KernelBuildError`; the test suite sets it, so CI fails when
the shipped fast path does not build); otherwise a failed build logs a warning and the
ops use the pure-torch reference (:func:`usable`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pathlib
import platform
import time
from collections.abc import Iterator

from kvarn_compile.paths import cache_dir

__all__ = ["KernelBuildError", "CSRC", "load", "build_extension", "usable", "mode", "cpu_model",
           "build_dir", "extension_name", "is_built", "announced_elsewhere"]

log = logging.getLogger(__name__)

#: The C++ sources, shipped next to the package (package data ``kernels/csrc/*``).
CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"

_COMMON = ["-O3", "-march=native"]
#: extension -> (sources in ``CSRC``, extra_cflags)
_EXTENSIONS: dict[str, tuple[tuple[str, ...], list[str]]] = {
    # -fopenmp: at::parallel_for is inlined here as an OpenMP region (without it the loop
    # runs on one thread); libgomp resolves to torch's own copy.
    "attention": (("attention.cpp", "latent_attention.cpp", "append.cpp", "ops.cpp"),
                  [*_COMMON, "-ffp-contract=fast", "-fopenmp"]),
    # -ffp-contract=off: no fused multiply-add, every product rounds as in torch.
    "quantize": (("quantize.cpp",), [*_COMMON, "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]),
}


class KernelBuildError(RuntimeError):
    """A C++ CPU kernel could not be built (``KVARN_CPU_KERNEL=require``)."""


def mode() -> str:
    """``KVARN_CPU_KERNEL``, lower-case: ``"0"`` (off), ``"require"`` or anything else (on)."""
    return os.environ.get("KVARN_CPU_KERNEL", "1").strip().lower()


def cpu_model() -> str:
    """The CPU's model line of ``/proc/cpuinfo`` (or its flags), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _digest(*parts: bytes) -> str:
    h = hashlib.sha1()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:8]


def _abi() -> bytes:
    """What a build links against: torch's version and C++ ABI, the Python version. A build
    loaded into another torch crashes the process (a segmentation fault), never an error."""
    import sys

    import torch

    return f"{torch.__version__}|{torch._C._GLIBCXX_USE_CXX11_ABI}|{sys.version_info[:2]}".encode()


def extension_name(kind: str) -> str:
    """The extension's module name: ``kvarn_cpu_<kind>_<hash of sources, flags, torch and
    Python>_<hash of the CPU>``."""
    files, cflags = _EXTENSIONS[kind]
    inputs = [CSRC / f for f in files] + sorted(CSRC.glob("*.h"))
    src = _digest(*(p.name.encode() + b"\0" + p.read_bytes() for p in inputs), " ".join(cflags).encode(),
                  _abi())
    return f"kvarn_cpu_{kind}_{src}_{_digest(cpu_model().encode())}"


def build_dir(kind: str | None = None) -> pathlib.Path:
    """Where the builds live: ``<KVARN_CACHE_DIR>/cpu_kernels`` (one folder per extension name)."""
    root = cache_dir() / "cpu_kernels"
    return root if kind is None else root / extension_name(kind)


def is_built(kind: str) -> bool:
    """Whether extension ``kind``'s current sources are already built in :func:`build_dir`."""
    name = extension_name(kind)
    return (build_dir() / name / f"{name}.so").is_file()


_announce = True


@contextlib.contextmanager
def announced_elsewhere() -> Iterator[None]:
    """Inside the block, a build logs nothing: the caller shows it (e.g. as a phase)."""
    global _announce
    old, _announce = _announce, False
    try:
        yield
    finally:
        _announce = old


def load(kind: str):
    """Build (or load the cached build of) extension ``kind`` (``"attention"`` or
    ``"quantize"``) and return its module; raises whatever the build raises."""
    from torch.utils.cpp_extension import load as load_extension

    files, cflags = _EXTENSIONS[kind]
    name = extension_name(kind)
    folder = build_dir() / name
    building = not is_built(kind)
    if building and _announce:
        log.warning("kvarn: building the C++ CPU %s kernel once (about a minute on 2 idle cores) "
                    "into %s", kind, folder)
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    module = load_extension(name=name, sources=[str(CSRC / f) for f in files], extra_cflags=cflags,
                            extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
    if building and _announce:
        log.warning("kvarn: built the C++ CPU %s kernel in %.0f s", kind, time.perf_counter() - t0)
    return module


def build_extension(module_fn, what: str):
    """``module_fn()`` (build, or load the cached build of, a C++ extension); a failure
    raises :class:`KernelBuildError` naming ``what`` with the compiler's first line."""
    try:
        return module_fn()
    except Exception as err:  # no compiler, no ninja, headers missing ...
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise KernelBuildError(
            f"kvarn: the C++ CPU {what} could not be built ({first}). It needs a C++ "
            "compiler, ninja and the Python headers; set KVARN_CPU_KERNEL=0 to use the "
            "pure-torch reference without trying.") from err


def usable(build_fn, logger: logging.Logger = log) -> bool:
    """True when ``build_fn()`` succeeds; a :class:`KernelBuildError` is raised again under
    ``KVARN_CPU_KERNEL=require`` and otherwise logged on ``logger`` (the reference is used
    instead)."""
    try:
        build_fn()
        return True
    except KernelBuildError as err:
        if mode() == "require":
            raise
        logger.warning("%s Using the pure-torch reference instead.", err)
        return False
