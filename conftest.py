"""Repository-wide pytest setup: tests marked `gpu` skip cleanly on machines without CUDA."""

import pytest


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in gpu_items:
        item.add_marker(skip)
