import os

import pytest
import torch

# Kernels written in Triton are tested on CPU tensors through the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The C++ CPU kernel is the shipped fast path: a build failure fails the tests instead of
# silently falling back to the reference (users get the fallback with a warning).
os.environ.setdefault("KVARN_CPU_KERNEL", "require")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """Run a test single-threaded. For tiny tensors and models intra-op threads only add
    overhead (up to 10x on a busy 2-core machine); modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fresh_dynamo():
    """A test that compiles starts and ends with a reset Dynamo (no graphs, guards or
    recompile counts left over from another test)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def many_recompiles(fresh_dynamo):
    """A reset Dynamo with room for the many graphs a flow of generate/forward calls on one
    compiled model makes (call signatures, cache types, batch sizes: Dynamo's default limit
    of 8 per function would end the flow, with or without kvarn)."""
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=4096):
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none found); CPU paths are tested elsewhere")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
