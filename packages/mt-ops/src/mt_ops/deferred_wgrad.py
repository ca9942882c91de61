"""Deferred weight gradients: a queue, owned by the caller, of weight-gradient GEMMs.

A zero-bubble pipeline schedule (DualPipeV) splits a layer's backward in two: the input
gradient ("B") is needed right away by the previous stage, the weight gradient ("W") can
run later to fill a bubble. Linear layers here take an optional :class:`WeightGradQueue`:
when set, their backward computes only the input gradient and pushes a closure that later
computes the weight gradient and adds it to ``param.grad``, exactly as autograd would have.

No mode flag: the queue is an attribute of the modules (``wgrad_queue``), set by the caller
through :func:`set_weight_grad_queue`, and drained by :meth:`WeightGradQueue.flush`.

Only what autograd would have *accumulated* is deferred (:func:`weight_grad_or_defer`):

- ``.backward()`` (or ``.backward(inputs=[..., weight])``): queued, ``.grad`` set at flush;
- ``torch.autograd.grad(..., inputs=[..., weight])``: computed now and returned, as
  ``autograd.grad`` promises; nothing queued, ``.grad`` untouched;
- a backward or ``autograd.grad`` whose inputs leave the weight out: neither computed nor
  queued (a flush would otherwise write a ``.grad`` nobody asked for).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from mt_ops._dtypes import autocast_dtype
from mt_ops._swap import carry_module_state, check_swappable, refuse_root_layer

__all__ = [
    "Linear",
    "WeightGradQueue",
    "accumulate_grad",
    "make_weight_grads_deferrable",
    "set_weight_grad_queue",
    "weight_grad_or_defer",
]


class WeightGradQueue:
    """Pending weight-gradient computations, run in first-in first-out order by :meth:`flush`."""

    def __init__(self) -> None:
        self._pending: list[Callable[[], None]] = []

    def push(self, compute: Callable[[], None]) -> None:
        """Adds a closure that computes one weight gradient and accumulates it.

        Args:
            compute: Called once by :meth:`flush`, with no arguments.
        """
        self._pending.append(compute)

    def flush(self) -> int:
        """Runs every pending weight-gradient computation, oldest first, with grad mode off.

        The closures read activations that require grad; with grad mode on each ``.grad``
        would record a graph back to them (and keep them alive), as autograd's own weight
        gradients never do.

        Returns:
            How many were run.
        """
        pending, self._pending = self._pending, []
        with torch.no_grad():
            for compute in pending:
                compute()
        return len(pending)

    def __len__(self) -> int:
        return len(self._pending)


def accumulate_grad(param: Tensor, grad: Tensor) -> None:
    """Adds ``grad`` to ``param.grad`` as autograd's accumulation does (creates it if None).

    Args:
        param: A leaf parameter.
        grad: Its gradient contribution, same shape; cast to the parameter's dtype.
    """
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def _accumulates_into_grad(param: Tensor) -> bool | None:
    """What the backward running now does with ``param``'s gradient: accumulates it into
    ``.grad`` (True), does not want it (False), or returns it from ``autograd.grad`` (None)."""
    if not param.is_leaf:
        return None  # no .grad to defer into: hand the gradient to autograd
    node = torch.autograd.graph.get_gradient_edge(param).node  # its AccumulateGrad
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        # Raised for a leaf that autograd.grad captures (an input of that call): PyTorch
        # refuses to say whether it "executes", since the gradient goes to the caller.
        return None


def weight_grad_or_defer(
    param: Tensor, queue: WeightGradQueue | None, compute: Callable[[], Tensor]
) -> Tensor | None:
    """The weight gradient a backward returns to autograd: computed now, deferred, or skipped.

    Args:
        param: The leaf weight parameter the gradient belongs to.
        queue: The queue the layer had at forward time, or None for immediate gradients.
        compute: Computes dW, in ``param``'s shape (any dtype); runs now or at flush.

    Returns:
        dW for autograd, or None when it was queued (``.backward()``, flushed into
        ``param.grad``) or when the running backward does not ask for this weight.
    """
    if queue is None:
        return compute()
    accumulates = _accumulates_into_grad(param)
    if accumulates is None:  # autograd.grad: the caller gets dW, .grad stays untouched
        return compute()
    if accumulates:
        queue.push(lambda: accumulate_grad(param, compute()))
    return None


def set_weight_grad_queue(
    model: nn.Module, queue: WeightGradQueue | None, *, fsdp_reduction_held: bool = False
) -> int:
    """Sets (or, with None, clears) the weight-gradient queue of every module that has one.

    Args:
        model: Any module tree; modules with a ``wgrad_queue`` attribute are updated
            (:class:`Linear`, ``GroupedLinear``, ``FP8Linear``, ``FP8GroupedLinear``).
            A queue for a tree with FSDP2-sharded modules is refused (ValueError) unless
            `fsdp_reduction_held`.
        queue: The queue, or None for immediate weight gradients.
        fsdp_reduction_held: the caller has stopped FSDP2 from reducing gradients inside
            the backward and reduces them after the flushes (a pipeline schedule does,
            with ``mt_parallel.fsdp.hold_gradient_reduction``): flushed gradients land in
            the gathered parameters and are reduced with the rest.

    Returns:
        The number of modules updated.
    """
    if queue is not None and not fsdp_reduction_held:
        sharded = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        if sharded:
            where = "the model itself" if sharded[0] == "" else repr(sharded[0])
            raise ValueError(
                f"model holds FSDP2-sharded modules ({where}, {len(sharded)} in all): FSDP2 "
                "reduce-scatters each layer's gradients inside the backward, before any flush, "
                "so deferred weight gradients would never reach the sharded parameters; defer "
                "weight gradients only in an unsharded model, or hold FSDP2's reduction until "
                "after the flushes and pass fsdp_reduction_held=True (or pass queue=None)"
            )
    count = 0
    for module in model.modules():
        if hasattr(module, "wgrad_queue"):
            module.wgrad_queue = queue
            count += 1
    return count


class _DeferredLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, queue, param):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.queue = queue
        ctx.weight_param = param  # the leaf parameter (weight may be its autocast copy)
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_x = grad_y @ weight if ctx.needs_input_grad[0] else None
        grad_bias = grad_y.reshape(-1, grad_y.shape[-1]).sum(0) if ctx.has_bias else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            x_2d, g_2d = x.reshape(-1, x.shape[-1]), grad_y.reshape(-1, grad_y.shape[-1])
            grad_w = weight_grad_or_defer(ctx.weight_param, ctx.queue, lambda: g_2d.T @ x_2d)
        return grad_x, grad_w, grad_bias, None, None


class Linear(nn.Linear):
    """``nn.Linear`` whose weight gradient can be deferred into a :class:`WeightGradQueue`.

    Same parameters, names and forward as ``nn.Linear``; with ``wgrad_queue`` None it *is*
    ``F.linear``. Build one from an existing layer with :meth:`from_linear`.
    """

    wgrad_queue: WeightGradQueue | None = None

    def forward(self, x: Tensor) -> Tensor:
        """``x @ weight.T + bias``; the weight gradient goes to ``wgrad_queue`` when set."""
        if self.wgrad_queue is None or not torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        weight = self.weight
        dtype = autocast_dtype(x.device)  # a custom Function sees no autocast
        if dtype is not None:
            x, weight = x.to(dtype), weight.to(dtype)
        return _DeferredLinearFn.apply(x, weight, self.bias, self.wgrad_queue, self.weight)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Linear":
        """Wraps the *same* parameters of ``linear`` (no copy), so names and optimizer state hold.

        The training mode and hooks come along (:func:`mt_ops._swap.carry_module_state`).

        Args:
            linear: The layer to take over; one with state besides weight and bias (a
                subclass's buffers, a parametrization) is refused with ValueError.

        Returns:
            A :class:`Linear` sharing ``linear``'s weight and bias.
        """
        check_swappable(linear, "Linear.from_linear")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        carry_module_state(new, linear)
        return new


def make_weight_grads_deferrable(model: nn.Module) -> int:
    """Swaps every ``nn.Linear`` (subclasses too) for :class:`Linear`, sharing its parameters.

    ``GroupedLinear`` and the FP8 linears already take a queue; plain ``nn.Linear`` needs this
    swap first. Names, parameter objects and results are unchanged.

    Args:
        model: Modified in place; a selected layer with state besides weight and bias is
            refused (ValueError) before anything is swapped.

    Returns:
        The number of modules swapped.
    """
    if isinstance(model, nn.Linear) and not isinstance(model, Linear):
        refuse_root_layer(model, "make_weight_grads_deferrable", "Linear.from_linear")
    swaps = []  # (parent, attribute name, layer); all checked before the first swap
    for fqn, module in model.named_modules():
        for name, child in module.named_children():
            if isinstance(child, nn.Linear) and not isinstance(child, Linear):
                check_swappable(child, "make_weight_grads_deferrable", f"{fqn}.{name}".lstrip("."))
                swaps.append((module, name, child))
    for module, name, child in swaps:
        setattr(module, name, Linear.from_linear(child))
    return len(swaps)
