"""Peak FLOP/s for MFU by device name; the metrics.jsonl format."""

import io
import json
import math

import pytest

from mt_train.metrics import MetricsLogger, peak_flops


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


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def test_a_skipped_steps_non_finite_numbers_are_written_as_strict_json_nulls(tmp_path):
    logger = MetricsLogger(tmp_path, max_steps=2, stream=io.StringIO())
    row = {"loss": 2.5, "aux_loss": 0.01, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0}
    logger.log({"step": 1, **row})
    logger.log({"step": 2, **row, "loss": math.nan, "grad_norm": math.inf, "aux_loss": -math.inf})
    logger.close()
    # A strict parser (jq, JSON.parse) refuses NaN and Infinity.
    lines = [
        json.loads(line, parse_constant=_reject_constant)
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert lines[0] == {"step": 1, **row}
    assert lines[1] == {**row, "step": 2, "loss": None, "grad_norm": None, "aux_loss": None}
