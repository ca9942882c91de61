"""FP8 training as a precision setting of the run (`precision.fp8`, ARCHITECTURE.md §4, §7).

`setup` converts the meta-device model with `mt_ops.convert_to_fp8` before parallelism is
applied, so FSDP2 shards the FP8 modules' own parameters (the same objects, under the same
names: checkpoints and canonical Hub keys do not change) and, in forward and backward,
hands them the gathered compute-dtype (BF16) weight, which is what gets quantized. The
run's one `mt_ops.FP8WeightCache` belongs to the training state: every micro-batch's
forward and backward of a step reuse a weight's quantization, and `train_step` invalidates
the cache after the optimizer step. That is required, not an optimization: FSDP2 writes
each step's gathered weights into the same tensor with its version counter preserved, so
the cache's own version check cannot see the update.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from mt_ops import FP8GroupedLinear, FP8Linear, FP8WeightCache, GroupedLinear, convert_to_fp8
from mt_ops.fp8_linear import default_fp8_filter

log = logging.getLogger("mt_train")

# FP8 (E4M3) tensor cores: Ada (8.9), Hopper (9.0) and Blackwell (10.x, 12.x).
_FP8_MIN_CAPABILITY = (8, 9)


def check_fp8_device(device: torch.device) -> None:
    """Raises ValueError unless FP8 GEMMs can run on `device` (CPU runs the emulation).

    Args:
        device: the rank's device.
    """
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ValueError(
            f"precision.fp8=true runs on CUDA GPUs or on the CPU, not on {device.type}; "
            "set precision.fp8=false"
        )
    if torch.version.hip is not None:
        raise ValueError(
            "precision.fp8=true uses NVIDIA's E4M3 format and Triton kernels tuned for it; "
            "this is a ROCm build; set precision.fp8=false"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < _FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"precision.fp8=true needs FP8 tensor cores (compute capability >= 8.9: H100, "
            f"H200, L40S, B200, ...), but {name} has {capability[0]}.{capability[1]}; set "
            "precision.fp8=false (BF16) or run on such a GPU"
        )


def apply_fp8(model: nn.Module, device: torch.device) -> FP8WeightCache:
    """Swaps the model's eligible linears for FP8 ones sharing one new weight cache.

    Converted: every ``nn.Linear`` and expert ``GroupedLinear`` whose in and out features
    are multiples of 16, except the output head (`mt_ops.fp8_linear.default_fp8_filter`);
    routers, embedding and norms are other module types and stay as they are.

    Args:
        model: an mt-models causal LM, on the meta device before `parallelize` (or
            materialized, single-process).
        device: the rank's device (checked for FP8 support).

    Returns:
        The cache; the caller invalidates it after every optimizer step.
    """
    check_fp8_device(device)
    cache = FP8WeightCache()
    convert_to_fp8(model, default_fp8_filter, weight_cache=cache)
    converted = [n for n, m in model.named_modules() if isinstance(m, FP8Linear | FP8GroupedLinear)]
    kept = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear | GroupedLinear) and not isinstance(m, FP8GroupedLinear)
    ]
    if not converted:
        raise ValueError(
            "precision.fp8=true found no linear layer to run in FP8: FP8 GEMMs need in and "
            "out features that are multiples of 16, and none of this model's are; choose "
            "model sizes that are (hidden_size, head_dim · heads, expert sizes) or set "
            "precision.fp8=false"
        )
    log.info(
        "precision.fp8: %d linears run in FP8 (%s); left in the compute dtype: %s",
        len(converted),
        "exact emulation on CPU" if device.type == "cpu" else "block-scaled GEMMs",
        ", ".join(kept) or "none",
    )
    return cache
