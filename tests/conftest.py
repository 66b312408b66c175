import os

os.environ.setdefault("USE_HUB_KERNELS", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels can only run in the interpreter; set it before any test module
# (the engine's, the kernels') imports triton, whatever the collection order.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
