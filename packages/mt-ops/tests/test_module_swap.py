"""Swapping a linear for its deferred-wgrad or FP8 form keeps what was set on the module.

``Linear.from_linear``, ``FP8Linear.from_linear`` and ``FP8GroupedLinear.from_grouped_linear``
take over a module's parameters; the module's mode, its hooks and the parameters' flags must
come along, and state they cannot take over must be refused by name, not dropped.
"""

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from mt_ops import GroupedLinear
from mt_ops.deferred_wgrad import Linear, make_weight_grads_deferrable
from mt_ops.fp8_linear import FP8GroupedLinear, FP8Linear, convert_to_fp8

KINDS = ["linear", "fp8_linear", "fp8_grouped"]


def _source(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "fp8_grouped":
        module = GroupedLinear(2, 128, 64, bias=True)
        nn.init.normal_(module.weight, std=128**-0.5)
        nn.init.zeros_(module.bias)
        return module
    return nn.Linear(128, 64)


def _convert(kind: str, module: nn.Module) -> nn.Module:
    if kind == "linear":
        return Linear.from_linear(module)
    if kind == "fp8_linear":
        return FP8Linear.from_linear(module)
    return FP8GroupedLinear.from_grouped_linear(module)


def _call(module: nn.Module, x_RD: torch.Tensor) -> torch.Tensor:
    if isinstance(module, GroupedLinear):
        return module(x_RD, torch.tensor([3, x_RD.shape[0] - 3]))
    return module(x_RD)


@pytest.mark.parametrize("kind", KINDS)
def test_converted_module_keeps_eval_mode_and_frozen_parameters(kind):
    source = _source(kind).eval()
    source.weight.requires_grad_(False)
    converted = _convert(kind, source)
    assert not converted.training
    assert not converted.weight.requires_grad and converted.bias.requires_grad
    assert converted.weight.device == source.weight.device
    assert converted.weight.dtype == source.weight.dtype


@pytest.mark.parametrize("kind", KINDS)
def test_converted_module_runs_the_source_hooks_until_their_handles_remove_them(kind):
    source = _source(kind)
    calls = []
    handles = [
        source.register_forward_pre_hook(lambda m, args: calls.append(("pre", m))),
        source.register_forward_hook(lambda m, args, out: calls.append(("forward", m))),
        source.register_full_backward_hook(lambda m, gin, gout: calls.append(("backward", m))),
        source.register_state_dict_post_hook(lambda m, sd, prefix, meta: calls.append(("sd", m))),
    ]
    converted = _convert(kind, source)
    x_RD = torch.randn(8, 128, requires_grad=True)
    _call(converted, x_RD).sum().backward()
    converted.state_dict()
    assert calls == [(what, converted) for what in ("pre", "forward", "backward", "sd")]
    for handle in handles:
        handle.remove()
    _call(converted, x_RD).sum().backward()
    converted.state_dict()
    assert len(calls) == 4


@pytest.mark.parametrize("kind", KINDS)
def test_converted_module_runs_the_source_load_state_dict_hooks_on_itself(kind):
    # register_load_state_dict_pre_hook keeps a weak reference to the module it was
    # registered on: the carried hook was called with the replaced module, and once that
    # was collected, load_state_dict raised "the hook of a dead Module".
    import gc

    source = _source(kind)
    calls = []
    handles = [
        source.register_load_state_dict_pre_hook(lambda m, *args: calls.append(("pre", m))),
        source.register_load_state_dict_post_hook(lambda m, keys: calls.append(("post", m))),
    ]
    converted = _convert(kind, source)
    del source
    gc.collect()
    converted.load_state_dict(converted.state_dict())
    assert calls == [("pre", converted), ("post", converted)]
    for handle in handles:
        handle.remove()
    converted.load_state_dict(converted.state_dict())
    assert len(calls) == 2


class _ScaledLinear(nn.Linear):
    """A linear subclass with state of its own, which a swap would silently drop."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("scale", torch.ones(()))


def test_converters_refuse_a_linear_with_state_they_cannot_take_over_by_name():
    for convert in (Linear.from_linear, FP8Linear.from_linear):
        with pytest.raises(ValueError, match=r"_ScaledLinear.*buffer 'scale'"):
            convert(_ScaledLinear(128, 64))
        parametrized = nn.Linear(128, 64)
        parametrize.register_parametrization(parametrized, "weight", nn.Identity())
        with pytest.raises(ValueError, match="parametriz"):
            convert(parametrized)


@pytest.mark.parametrize("swap", [make_weight_grads_deferrable, convert_to_fp8])
def test_model_swaps_refuse_before_swapping_anything(swap):
    model = nn.Sequential(nn.Linear(128, 128), _ScaledLinear(128, 64))
    with pytest.raises(ValueError, match=r"'1'.*buffer 'scale'"):
        swap(model)
    assert type(model[0]) is nn.Linear  # refused before any swap: not half converted


@pytest.mark.parametrize(
    ("swap", "order"),
    [
        (make_weight_grads_deferrable, "make_weight_grads_deferrable before"),
        (convert_to_fp8, "before fully_shard"),
    ],
)
def test_model_swaps_after_fully_shard_are_refused_with_the_order_to_use(tmp_path, swap, order):
    # FSDP2 gathers weights into the modules it recorded: a module swapped in after
    # fully_shard only ever saw the sharded DTensor, and the first forward failed with
    # "aten.addmm.default got mixed torch.Tensor and DTensor".
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(ValueError, match=rf"'0'.*DTensor.*{order}"):
            swap(model)
        assert type(model[0]) is nn.Linear
    finally:
        dist.destroy_process_group()


def test_a_weight_grad_queue_is_refused_for_an_fsdp_sharded_model(tmp_path):
    # FSDP2 reduce-scatters each layer's gradients inside the backward, before any flush:
    # the deferred weight gradients never reached the sharded parameters (their .grad
    # stayed None after the flush), silently.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mt_ops.deferred_wgrad import WeightGradQueue, set_weight_grad_queue

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        make_weight_grads_deferrable(model)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(
            ValueError,
            match=r"FSDP2-sharded modules \(the model itself, 1 in all\).*before any flush",
        ):
            set_weight_grad_queue(model, WeightGradQueue())
        assert model[0].wgrad_queue is None
        assert set_weight_grad_queue(model, None) == 2  # clearing stays allowed
    finally:
        dist.destroy_process_group()
