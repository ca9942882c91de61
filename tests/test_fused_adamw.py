"""The fused AdamW that CUDA runs take steps FSDP2-sharded (DTensor) parameters as the
foreach path does (two gloo ranks: the kernel's DTensor dispatch, its step tensors on the
parameters' device, the two weight-decay groups)."""

from pathlib import Path

import pytest
import torch

from mt_models import build_model, gpt_oss
from mt_parallel import ParallelDims, parallelize
from mt_parallel.testing import spawn
from mt_train.optim import build_optimizer
from mt_train.overrides import resolve_config
from mt_train.recipes import get_recipe

pytestmark = pytest.mark.slow


def _sharded_model():
    with torch.device("meta"):
        model = build_model(gpt_oss.debug())  # its 2-D expert biases go undecayed
    parallelize(model, ParallelDims(world_size=2, dp=2), "cpu", seed=3)
    return model


def _two_steps(fused: bool) -> list[torch.Tensor]:
    model = _sharded_model()
    training = resolve_config(get_recipe("tiny")).training
    optimizer = build_optimizer(model, training, fused=fused)
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
        param.grad.to_local().copy_(torch.randn(param.to_local().shape, generator=gen))
    for _ in range(2):
        optimizer.step()
    return [p.detach().to_local().clone() for p in model.parameters()]


def _compare() -> None:
    fused, foreach = _two_steps(True), _two_steps(False)
    for got, expected in zip(fused, foreach, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    initial = [p.detach().to_local() for p in _sharded_model().parameters()]
    assert all(not torch.equal(p, q) for p, q in zip(fused, initial, strict=True))


def test_fused_adamw_steps_sharded_parameters_as_foreach_does(monkeypatch):
    # Spawned ranks take this process's sys.path and import tests.test_fused_adamw.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    spawn(_compare, 2)
