"""Module swaps that take over a linear's parameters and keep what was set on the module.

``Linear.from_linear``, ``FP8Linear.from_linear`` and ``FP8GroupedLinear.from_grouped_linear``
build a new module around the *same* parameter objects (so ``requires_grad``, device, dtype,
names and optimizer state hold). The module object itself changes, so its training mode and
its hooks are carried over here; state the new module has no place for (a subclass's own
buffers or parameters, a parametrization) is refused by name rather than dropped.
"""

import weakref
from typing import NoReturn

from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _WrappedHook
from torch.nn.utils import parametrize

_OWN_PARAMETERS = ("weight", "bias")


def check_swappable(module: nn.Module, converter: str, fqn: str | None = None) -> None:
    """Raises ValueError when ``module`` holds state a swap would drop, or is FSDP-sharded.

    Args:
        module: The linear (or grouped linear) about to be swapped.
        converter: What swaps it, for the message (``"FP8Linear.from_linear"``).
        fqn: Its name in the model, when a model-wide swap selected it.
    """
    where = f"{fqn!r} ({type(module).__name__})" if fqn is not None else type(module).__name__
    if isinstance(getattr(module, "weight", None), DTensor):
        # FSDP2 gathers each forward's weight into the module it recorded at fully_shard;
        # a module swapped in later would only ever see the sharded DTensor.
        raise ValueError(
            f"{where} has a DTensor weight (shape {tuple(module.weight.shape)}): the model is "
            f"already sharded; call {converter} before fully_shard / parallelize"
        )
    extras = []
    if parametrize.is_parametrized(module):
        extras.append(f"parametrizations of {sorted(module.parametrizations.keys())}")
    else:
        extras += [f"child module {n!r}" for n, _ in module.named_children()]
    extras += [
        f"parameter {n!r}"
        for n, _ in module.named_parameters(recurse=False)
        if n not in _OWN_PARAMETERS
    ]
    extras += [f"buffer {n!r}" for n, _ in module.named_buffers(recurse=False)]
    if extras:
        raise ValueError(
            f"{where} holds {', '.join(extras)} beyond weight and bias, which {converter} "
            "would drop; leave this layer out of the swap (module_filter_fn for convert_to_fp8) "
            "or remove that state first (parametrize.remove_parametrizations)"
        )


def refuse_root_layer(model: nn.Module, converter: str, swap: str) -> NoReturn:
    """Raises the ValueError of a model-wide swap handed the layer itself.

    Such a swap replaces children in place, so a model that is itself the layer would come
    back as it was (``convert_to_fp8`` returned the ``nn.Linear`` unconverted,
    ``make_weight_grads_deferrable`` returned 0).

    Args:
        model: The layer passed as the model.
        converter: The model-wide swap that refuses it (``"convert_to_fp8"``).
        swap: The one-layer swap to use instead (``"FP8Linear.from_linear"``).
    """
    raise ValueError(
        f"model is itself a {type(model).__name__} (in_features {model.in_features}, "
        f"out_features {model.out_features}), which {converter} cannot replace in place; "
        f"use {swap}(model), or pass the module that holds it to {converter}"
    )


def carry_module_state(new: nn.Module, old: nn.Module) -> None:
    """Gives ``new`` the training mode and every hook of ``old``.

    The hook dictionaries are shared, not copied: a handle ``old.register_*_hook`` returned
    removes the hook from ``new`` too, and hooks receive ``new`` as their module.

    Args:
        new: The module that took over ``old``'s parameters.
        old: The module it replaces.
    """
    new.training = old.training
    for name, value in vars(old).items():
        # _forward_hooks, _backward_pre_hooks, _state_dict_hooks, _is_full_backward_hook, ...
        if "hook" in name:
            new.__dict__[name] = value
    for hook in new._load_state_dict_pre_hooks.values():
        # register_load_state_dict_pre_hook binds (weakly) the module it was registered on:
        # the hook would get `old`, and raise "dead Module" once `old` is collected.
        if isinstance(hook, _WrappedHook) and hook.with_module and hook.module() is old:
            hook.module = weakref.ref(new)
