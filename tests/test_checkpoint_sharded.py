"""Checkpoints of an FSDP2-sharded model gather nothing and load under any layout.

Two gloo ranks save a Qwen3-MoE debug model sharded over dp = 2 (experts split between
the ranks) with `DTensor.full_tensor` and `redistribute` made to fail, so a save that
gathered a parameter or Adam moment would raise. The checkpoint is then loaded, again
without gathering, under ep = 2 (each rank owning half the experts) and into a plain
unsharded model on each rank; every canonical tensor and the optimizer step must come
back bit for bit. `init_from` of the checkpoint and of its Hugging Face export fills
sharded models (dp = 2, ep = 2) the same way.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mt_models import build_model, qwen3_moe, save_hf
from mt_parallel import ParallelDims, parallelize
from mt_parallel.testing import spawn
from mt_train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from mt_train.convert import init_config_differences, init_from_weights
from mt_train.optim import init_optimizer_state

pytestmark = pytest.mark.slow


def _config():
    return replace(
        qwen3_moe.debug(), vocab_size=64, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_hidden_layers=2, head_dim=8, mlp_only_layers=(1,),
    )  # fmt: skip


_TRAIN_STATE = json.loads(
    json.dumps({"config": {"model_family": "qwen3_moe", "model": asdict(_config())}})
)


@contextmanager
def _no_gathers():
    saved = DTensor.full_tensor, DTensor.redistribute

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint gathered a sharded tensor")

    DTensor.full_tensor = DTensor.redistribute = refuse
    try:
        yield
    finally:
        DTensor.full_tensor, DTensor.redistribute = saved


def _device() -> str:
    return f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"


def _model_and_optimizer(layout: dict[str, int] | None, config=None):
    with torch.device("meta"):
        model = build_model(config or _config())
    if layout is None:
        model.to_empty(device=_device())
        model.init_weights(1)
    else:
        parallelize(model, ParallelDims(world_size=2, **layout), _device(), seed=1)
    optimizer = torch.optim.AdamW(model.parameters())
    init_optimizer_state(optimizer)
    return model, optimizer


def _whole_canonical(model, optimizer) -> dict[str, torch.Tensor]:
    """Every canonical tensor this rank holds, gathered whole (after the checks)."""
    out = {}
    for fqn, param in model.named_parameters():
        tensors = {
            "model": param,
            **{m: optimizer.state[param][m] for m in ("exp_avg", "exp_avg_sq")},
        }
        for kind, tensor in tensors.items():
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            for key, value in model.to_canonical({fqn: whole.detach()}).items():
                out[f"{kind}/{key}"] = value.clone()
    return out


def _round_trip(root: str) -> None:
    model, optimizer = _model_and_optimizer({"dp": 2})
    gen = torch.Generator().manual_seed(5 + dist.get_rank())
    for state in optimizer.state.values():  # distinct moments on every shard
        for moment in ("exp_avg", "exp_avg_sq"):
            local = state[moment].to_local()
            local.copy_(torch.rand(local.shape, generator=gen).to(local.device))
        state["step"].fill_(7)
    with _no_gathers():
        save_checkpoint(root, 7, model, optimizer, _TRAIN_STATE)
    expected = _whole_canonical(model, optimizer)
    assert any(".experts.7." in key for key in expected)  # both ranks' experts

    for layout in ({"ep": 2}, None):
        other, other_optimizer = _model_and_optimizer(layout)
        with _no_gathers():
            state = load_checkpoint(latest_checkpoint(root), other, other_optimizer)
        assert state["config"] == _TRAIN_STATE["config"]
        if layout is None:
            whole_model = other
        got = _whole_canonical(other, other_optimizer)
        if layout is not None:  # each EP rank holds half the experts
            assert len(got) < len(expected)
        for key, value in got.items():
            assert torch.equal(value, expected[key]), f"{layout}: {key} differs"
        for param_state in other_optimizer.state.values():
            assert int(param_state["step"]) == 7

    # init_from (model tensors only) of the mt checkpoint and of its Hugging Face export,
    # into a sharded model: each rank reads its own pieces, nothing is gathered.
    hf_dir = Path(root).parent / f"hf_{dist.get_rank()}"  # one per rank
    save_hf(whole_model, hf_dir)
    for source in (latest_checkpoint(root).path, hf_dir):
        for layout in ({"dp": 2}, {"ep": 2}):
            other, other_optimizer = _model_and_optimizer(layout)
            with _no_gathers():
                source_config = init_from_weights(other, source)
            assert init_config_differences(source_config, _config()) == {}
            got = _whole_canonical(other, other_optimizer)
            for key, value in got.items():
                if key.startswith("model/"):
                    assert torch.equal(value, expected[key]), f"{source} {layout}: {key} differs"

    # Twice the experts under ep = 2: rank 1's experts are missing from the checkpoint, rank
    # 0's are there (only the router's shape differs). Every rank must raise the same error
    # (the first rank's), none may wait alone in a collective.
    more_experts = replace(_config(), num_experts=2 * _config().num_experts)
    other, other_optimizer = _model_and_optimizer({"ep": 2}, more_experts)
    try:
        load_checkpoint(latest_checkpoint(root), other, other_optimizer)
    except ValueError as err:
        assert "mlp.gate.weight has shape (8, 32) but the model gives (16, 32)" in str(err)
    else:
        raise AssertionError("a checkpoint of half the experts loaded")


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
            ],
        ),
    ],
)
def test_sharded_checkpoints_gather_nothing_and_load_under_another_layout(
    tmp_path, monkeypatch, backend
):
    # Spawned ranks take this process's sys.path and import tests.test_checkpoint_sharded.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    spawn(_round_trip, 2, str(tmp_path / "checkpoints"), backend=backend)
