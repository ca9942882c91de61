"""Peak FLOP/s for MFU by device name."""

import pytest

from mt_train.metrics import peak_flops


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H200", (794e12, 989e12)),
        ("NVIDIA H100 80GB HBM3", (794e12, 989e12)),
        ("NVIDIA H100 PCIe", (None, 756e12)),  # not the SXM part's 989
        ("NVIDIA H100 NVL", (None, 835e12)),
        ("NVIDIA H200 NVL", (None, 835e12)),
        ("NVIDIA A100-SXM4-80GB", (None, None)),
    ],
)
def test_peak_flops_tell_the_pcie_and_nvl_parts_from_the_sxm_ones(name, expected):
    assert peak_flops(name) == expected
