"""tools/bench/bench_ops_moe.py: the kernels ``--sweep`` tunes run as the ops run them (CPU,
Triton's interpreter), so a sweep measures them instead of failing on its first call."""

import importlib.util
from pathlib import Path

import torch

from mt_ops import moe_permute, plan_dispatch
from mt_ops.moe_permute import permute_reference, unpermute_reference

ROOT = Path(__file__).resolve().parent.parent


def _load_bench():
    path = ROOT / "tools" / "bench" / "bench_ops_moe.py"
    spec = importlib.util.spec_from_file_location("bench_ops_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sweep_kernels_equal_permute_unpermute_and_its_backward():
    gen = torch.Generator().manual_seed(0)
    topk_ids_TK = torch.rand(9, 6, generator=gen).topk(3, dim=-1).indices  # K = 3: not pow2
    plan = plan_dispatch(topk_ids_TK, 6)
    x_TD, y_RD = torch.randn(9, 40, generator=gen), torch.randn(27, 40, generator=gen)
    weights_TK = torch.rand(9, 3, generator=gen)
    kernels = _load_bench().permute_kernels(x_TD, y_RD, plan, weights_TK)
    for prefix in kernels:  # the PERMUTE_CONFIG entries the sweep sets
        assert {f"{prefix}BLOCK_D", f"{prefix}warps"} <= moe_permute.PERMUTE_CONFIG.keys()
    assert torch.equal(kernels["fwd_"](), permute_reference(x_TD, plan))
    torch.testing.assert_close(kernels[""](), unpermute_reference(y_RD, plan, weights_TK))
    # The unpermute backward, with x as the output gradient (as the sweep calls it).
    y_leaf, w_leaf = y_RD.clone().requires_grad_(True), weights_TK.clone().requires_grad_(True)
    unpermute_reference(y_leaf, plan, w_leaf).backward(x_TD)
    grad_y, grad_w = kernels["bwd_"]()
    torch.testing.assert_close(grad_y, y_leaf.grad)
    torch.testing.assert_close(grad_w, w_leaf.grad)
