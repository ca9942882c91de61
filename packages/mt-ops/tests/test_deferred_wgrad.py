"""Deferred weight gradients under every way of running a backward.

A queue defers what ``.backward()`` would accumulate into ``.grad``; ``torch.autograd.grad``
returns gradients instead of accumulating them, and a backward limited to other inputs
asks for no weight gradient at all. Legend: R rows, D in, O out, E experts.
"""

import pytest
import torch
from torch import nn

from mt_ops import GroupedLinear
from mt_ops.deferred_wgrad import Linear, WeightGradQueue, set_weight_grad_queue
from mt_ops.fp8_linear import FP8GroupedLinear, FP8Linear

KINDS = ["linear", "grouped", "fp8_linear", "fp8_grouped"]
COUNTS_E = torch.tensor([5, 0, 9, 2])  # R = 16


def _module(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind in ("linear", "fp8_linear"):
        linear = nn.Linear(128, 64)
        return Linear.from_linear(linear) if kind == "linear" else FP8Linear.from_linear(linear)
    grouped = GroupedLinear(4, 128, 64, bias=True)
    nn.init.normal_(grouped.weight, std=128**-0.5)
    nn.init.normal_(grouped.bias)
    return grouped if kind == "grouped" else FP8GroupedLinear.from_grouped_linear(grouped)


def _call(module: nn.Module, x_RD: torch.Tensor) -> torch.Tensor:
    if isinstance(module, GroupedLinear):
        return module(x_RD, COUNTS_E)
    return module(x_RD)


def _deferred_pair(kind: str) -> tuple[nn.Module, nn.Module, WeightGradQueue]:
    immediate, deferred = _module(kind), _module(kind)
    queue = WeightGradQueue()
    assert set_weight_grad_queue(deferred, queue) == 1
    return immediate, deferred, queue


@pytest.mark.parametrize("kind", KINDS)
def test_autograd_grad_returns_the_weight_gradient_and_leaves_grad_and_queue_alone(kind):
    immediate, deferred, queue = _deferred_pair(kind)
    x_RD = torch.randn(16, 128, requires_grad=True)
    want = torch.autograd.grad(_call(immediate, x_RD).square().sum(), [x_RD, immediate.weight])
    got = torch.autograd.grad(_call(deferred, x_RD).square().sum(), [x_RD, deferred.weight])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert len(queue) == 0 and deferred.weight.grad is None


@pytest.mark.parametrize("kind", KINDS)
def test_autograd_grad_of_the_input_only_queues_no_weight_gradient(kind):
    immediate, deferred, queue = _deferred_pair(kind)
    x_RD = torch.randn(16, 128, requires_grad=True)
    (want,) = torch.autograd.grad(_call(immediate, x_RD).square().sum(), [x_RD])
    (got,) = torch.autograd.grad(_call(deferred, x_RD).square().sum(), [x_RD])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(queue) == 0
    queue.flush()
    assert deferred.weight.grad is None


@pytest.mark.parametrize("kind", KINDS)
def test_backward_limited_to_the_input_queues_no_weight_gradient(kind):
    _, deferred, queue = _deferred_pair(kind)
    x_RD = torch.randn(16, 128, requires_grad=True)
    _call(deferred, x_RD).square().sum().backward(inputs=[x_RD])
    assert x_RD.grad is not None and len(queue) == 0 and deferred.weight.grad is None


@pytest.mark.parametrize("kind", KINDS)
def test_backward_limited_to_the_weight_still_defers_it(kind):
    immediate, deferred, queue = _deferred_pair(kind)
    x_RD = torch.randn(16, 128, requires_grad=True)
    for module in (immediate, deferred):
        _call(module, x_RD).square().sum().backward(inputs=[module.weight])
    assert deferred.weight.grad is None and queue.flush() == 1
    torch.testing.assert_close(deferred.weight.grad, immediate.weight.grad, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_flushed_weight_gradient_records_no_autograd_graph(kind):
    # The activations saved for the weight gradient require grad; a flush run with grad
    # mode on must not chain .grad to them (a graph, and the activations, kept alive).
    _, deferred, queue = _deferred_pair(kind)
    x_RD = torch.randn(16, 128, requires_grad=True)
    _call(deferred, x_RD).square().sum().backward()
    assert torch.is_grad_enabled() and queue.flush() == 1
    grad = deferred.weight.grad
    assert grad.grad_fn is None and not grad.requires_grad
