import os

import pytest
import torch

# Kernels written in Triton are tested on CPU tensors through the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none found); CPU paths are tested elsewhere")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
