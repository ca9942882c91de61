"""FP8 training linears: ``FP8Linear``, ``FP8GroupedLinear`` and ``convert_to_fp8``.

Legend: R rows (tokens, or routed rows), D input features, O output features, E experts.

Forward, input gradient and weight gradient all run as block-scaled FP8 GEMMs
(:mod:`mt_ops.fp8_gemm`) with BF16 (or fp32) inputs and outputs and the master weight in
its own dtype (fp32 for FP8 training). Per layer and step:

- fprop ``y = x Wᵀ``: x quantized 1×128 by rows *and*, in the same pass, xᵀ by 128-token
  tiles (saved for wgrad instead of x: half the activation memory of BF16); W 128×128.
- dgrad ``dx = dy W``: dy quantized 1×128 by rows and dyᵀ by token tiles in one pass; W's
  quantized transpose (the same 128×128 blocks, transposed).
- wgrad ``dW = dyᵀ x``: the two transposed quantizations; fp32 result. It can be deferred
  into a :class:`~mt_ops.deferred_wgrad.WeightGradQueue`.

Weights are quantized once per optimizer step through an :class:`FP8WeightCache` owned by
the caller (no global flag): every micro-batch's forward and backward reuse the entry;
``cache.invalidate()`` after ``optimizer.step()`` drops it. As a guard the entry also
records the weight's version counter, dtype and device, so an in-place op on the parameter
(``p.copy_``, ``load_state_dict``, foreach AdamW) or a ``module.to(...)`` without
``invalidate()`` is re-quantized rather than served stale. The guard is partial, so
``invalidate()`` is required: fused optimizers (``torch.optim.AdamW(fused=True)``, mt-train's
choice on CUDA), writes through ``p.data`` and FSDP2's all-gathers leave the counter as it was.

For experts, token tiles restart at each expert (:func:`mt_ops.fp8_quant.row_tiles`), so
each expert's wgrad scales only its own tokens. ``FP8Linear`` is the one-group case.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mt_ops._dtypes import autocast_dtype
from mt_ops._swap import carry_module_state, check_swappable, refuse_root_layer
from mt_ops.deferred_wgrad import WeightGradQueue, weight_grad_or_defer
from mt_ops.fp8_gemm import BACKENDS, fp8_grouped_gemm, fp8_grouped_wgrad
from mt_ops.fp8_quant import (
    Fp8Quantized,
    RowTiles,
    ScaleFormat,
    _check_scale_format,
    quantize_1x128,
    quantize_1x128_dual,
    quantize_128x128,
    row_tiles,
)
from mt_ops.grouped_linear import GroupedLinear, _wide_counts, segment_sum
from mt_ops.grouped_linear import _check_shapes as _check_grouped_args

__all__ = [
    "FP8GroupedLinear",
    "FP8Linear",
    "FP8WeightCache",
    "QuantizedWeight",
    "convert_to_fp8",
    "default_fp8_filter",
]

# FP8 GEMMs need 16-byte aligned rows: in and out features multiples of 16.
_FP8_ALIGN = 16


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight's 128×128 quantization and that of its transpose.

    Attributes:
        blocks: data [E, O, D], scales [E, O/128, D/128] (fprop).
        transposed: data [E, D, O], scales [E, D/128, O/128] (dgrad).
    """

    blocks: Fp8Quantized
    transposed: Fp8Quantized


class FP8WeightCache:
    """Quantized weights for one optimizer step, owned by the training step.

    Args:
        scale_format: ``"fp32"`` (Hopper) or ``"e8m0"`` (Blackwell) scales.
    """

    def __init__(self, scale_format: ScaleFormat = "fp32") -> None:
        _check_scale_format(scale_format)
        self.scale_format: ScaleFormat = scale_format
        self.num_quantizations = 0
        # id(weight) -> (weight, its version counter, dtype and device when quantized, result)
        self._entries: dict[int, tuple[Tensor, tuple, QuantizedWeight]] = {}

    def get(self, weight: Tensor) -> QuantizedWeight:
        """The quantized weight, computed on first use after :meth:`invalidate`.

        Args:
            weight: The master weight parameter itself ([O, D] or [E, O, D]; not a view:
                entries are keyed by the tensor object).

        Returns:
            Its :class:`QuantizedWeight`.
        """
        key = id(weight)
        # module.to(dtype / device) replaces p.data: same object, same version counter.
        stamp = (weight._version, weight.dtype, weight.device)
        entry = self._entries.get(key)
        if entry is not None and entry[0] is weight and entry[1] == stamp:
            return entry[2]
        quantized = quantize_weight(weight, self.scale_format)
        self._entries[key] = (weight, stamp, quantized)
        self.num_quantizations += 1
        return quantized

    def invalidate(self) -> None:
        """Forgets every entry; call once after each ``optimizer.step()``."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def quantize_weight(weight: Tensor, scale_format: ScaleFormat = "fp32") -> QuantizedWeight:
    """Quantizes a weight ([O, D] or stacked [E, O, D]) and its transpose by 128×128 blocks.

    Args:
        weight: The master weight; a 2-D weight is treated as one expert.
        scale_format: ``"fp32"`` or ``"e8m0"``.

    Returns:
        The :class:`QuantizedWeight`, always with a leading expert dim.
    """
    weight_EOD = weight.detach() if weight.dim() == 3 else weight.detach().unsqueeze(0)
    blocks, transposed = quantize_128x128(
        weight_EOD.contiguous(), scale_format=scale_format, transpose=True
    )
    assert transposed is not None
    return QuantizedWeight(blocks, transposed)


@dataclass(frozen=True)
class _Fp8Call:
    """The non-tensor context of one FP8 linear call (kept out of autograd's inputs)."""

    param: Tensor  # the weight parameter: cache key and target of deferred gradients
    weight_source: Callable[[Tensor], QuantizedWeight]
    queue: WeightGradQueue | None
    backend: str | None
    scale_format: ScaleFormat
    # Whether the weight gradient will be asked for: xᵀ and dyᵀ feed nothing else, so
    # evaluation (no_grad) and frozen weights quantize by rows only.
    weight_grad: bool


class _FP8GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, w_EOD, bias_EO, counts_E, call):
        backend, scale_format = call.backend, call.scale_format
        qweight = call.weight_source(call.param)
        tiles = row_tiles(counts_E, x_RD.shape[0])
        if call.weight_grad:
            x_q, x_qt = quantize_1x128_dual(x_RD, tiles=tiles, scale_format=scale_format)
        else:  # evaluation or a frozen weight: nothing will read xᵀ
            x_q, x_qt = quantize_1x128(x_RD, scale_format=scale_format), (None, None)
        y_RO = fp8_grouped_gemm(x_q, qweight.blocks, tiles, out_dtype=x_RD.dtype, backend=backend)
        if bias_EO is not None:
            bias_RO = bias_EO.repeat_interleave(counts_E, dim=0, output_size=x_RD.shape[0])
            y_RO = y_RO + bias_RO.to(y_RO.dtype)
        ctx.save_for_backward(
            *x_qt, counts_E, tiles.start_T, tiles.end_T, tiles.group_T,
            tiles.group_first_tile_G,
        )  # fmt: skip
        ctx.num_rows, ctx.x_dtype = x_RD.shape[0], x_RD.dtype
        ctx.qweight, ctx.weight_param, ctx.queue = qweight, call.param, call.queue
        ctx.w_shape = w_EOD.shape
        ctx.backend, ctx.scale_format = backend, scale_format
        ctx.bias_dtype = None if bias_EO is None else bias_EO.dtype
        return y_RO

    @staticmethod
    def backward(ctx, dy_RO):
        x_data, x_scale, counts_E, start_T, end_T, group_T, first_G = ctx.saved_tensors
        tiles = RowTiles(start_T, end_T, group_T, first_G, ctx.num_rows)
        dy_RO = dy_RO.contiguous()
        if ctx.needs_input_grad[1]:
            assert x_data is not None, "forward quantized no xᵀ for a weight gradient"
            dy_q, dy_qt = quantize_1x128_dual(dy_RO, tiles=tiles, scale_format=ctx.scale_format)
        else:
            dy_q = quantize_1x128(dy_RO, scale_format=ctx.scale_format)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_grouped_gemm(
                dy_q, ctx.qweight.transposed, tiles, out_dtype=ctx.x_dtype, backend=ctx.backend
            )
        grad_w = None
        if ctx.needs_input_grad[1]:
            x_qt = Fp8Quantized(x_data, x_scale)
            param, backend = ctx.weight_param, ctx.backend

            def weight_grad() -> Tensor:  # [E, O, D] or, for FP8Linear, [O, D]
                dw = fp8_grouped_wgrad(dy_qt, x_qt, tiles, out_dtype=param.dtype, backend=backend)
                return dw.view(param.shape)

            grad_w = weight_grad_or_defer(param, ctx.queue, weight_grad)
            if grad_w is not None:
                grad_w = grad_w.view(ctx.w_shape)
        grad_b = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = segment_sum(dy_RO, counts_E).view(-1, dy_RO.shape[1]).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None


def _weight_source(cache: FP8WeightCache | None, scale_format: ScaleFormat) -> Callable:
    if cache is not None:
        if cache.scale_format != scale_format:
            raise ValueError(
                f"weight cache scale_format ({cache.scale_format!r}) must equal the module's "
                f"({scale_format!r}); build the cache with the same format"
            )
        return cache.get
    return lambda w: quantize_weight(w, scale_format)


def _needs_weight_grad(weight: Tensor) -> bool:
    """Whether autograd will ask a call made now for ``weight``'s gradient."""
    return torch.is_grad_enabled() and weight.requires_grad


def _autocast_input(x: Tensor) -> Tensor:
    """Under autocast, FP8 linears take and return the autocast dtype (a Function sees none)."""
    dtype = autocast_dtype(x.device)
    return x if dtype is None else x.to(dtype)


def _check_settings(backend: str | None, scale_format: str) -> None:
    """At construction, not at the first forward of a model converted whole."""
    _check_scale_format(scale_format)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(
            f"backend ({backend!r}) must be one of {BACKENDS}, or None for the automatic "
            "choice (mt_ops.fp8_backend)"
        )


def _check_aligned(in_features: int, out_features: int) -> None:
    if in_features % _FP8_ALIGN or out_features % _FP8_ALIGN:
        raise ValueError(
            f"FP8 linears need in_features ({in_features}) and out_features ({out_features}) "
            f"to be multiples of {_FP8_ALIGN}; leave this layer in BF16 (module_filter_fn)"
        )


class FP8GroupedLinear(GroupedLinear):
    """``GroupedLinear`` with FP8 fprop, dgrad and wgrad; same parameter names and shapes.

    A subclass of :class:`~mt_ops.grouped_linear.GroupedLinear`, so code that finds expert
    projections by that class (mt-models' per-expert checkpoint names) still finds them.

    Args:
        num_experts: E.
        in_features: D (a multiple of 16).
        out_features: O (a multiple of 16).
        bias: Whether each expert has a bias [E, O].
        weight_cache: Caller-owned :class:`FP8WeightCache`; None quantizes every call.
        backend: FP8 GEMM backend override (:func:`mt_ops.fp8_gemm.fp8_backend`).
        scale_format: ``"fp32"`` or ``"e8m0"``.
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        weight_cache: FP8WeightCache | None = None,
        backend: str | None = None,
        scale_format: ScaleFormat = "fp32",
    ):
        _check_aligned(in_features, out_features)
        _check_settings(backend, scale_format)
        super().__init__(num_experts, in_features, out_features, bias)
        self.weight_cache, self.backend, self.scale_format = weight_cache, backend, scale_format

    @classmethod
    def from_grouped_linear(cls, module: GroupedLinear, **kwargs) -> "FP8GroupedLinear":
        """Takes over ``module``'s parameters (same objects, so names and state hold).

        The training mode and hooks come along (:func:`mt_ops._swap.carry_module_state`).

        Args:
            module: The BF16 ``GroupedLinear``; one with state besides weight and bias is
                refused with ValueError.
            **kwargs: ``weight_cache``, ``backend``, ``scale_format``.

        Returns:
            The FP8 module.
        """
        check_swappable(module, "FP8GroupedLinear.from_grouped_linear")
        with torch.device("meta"):  # placeholders only: the module's parameters move in
            new = cls(module.num_experts, module.in_features, module.out_features, **kwargs)
        new.weight = module.weight
        new.bias = module.bias
        new.wgrad_queue = getattr(module, "wgrad_queue", None)
        carry_module_state(new, module)
        return new

    def forward(self, x_RD: Tensor, tokens_per_expert_E: Tensor) -> Tensor:
        """Applies expert e's weight (and bias) to its consecutive rows in FP8.

        Args:
            x_RD: Rows grouped by expert, in expert order [R, D].
            tokens_per_expert_E: Rows per expert [E], summing to R.

        Returns:
            ``y`` [R, O] in the dtype of ``x_RD``.
        """
        # As GroupedLinear: a count per expert (more counts would leave rows unwritten).
        _check_grouped_args(x_RD, self.weight, tokens_per_expert_E)
        call = _Fp8Call(
            self.weight, _weight_source(self.weight_cache, self.scale_format), self.wgrad_queue,
            self.backend, self.scale_format, _needs_weight_grad(self.weight),
        )  # fmt: skip
        return _FP8GroupedLinearFn.apply(
            _autocast_input(x_RD).contiguous(), self.weight, self.bias,
            _wide_counts(tokens_per_expert_E), call,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"{self.num_experts}, {self.in_features}, {self.out_features}, fp8"


class FP8Linear(nn.Module):
    """``nn.Linear`` with FP8 fprop, dgrad and wgrad; same ``weight`` [O, D] and ``bias`` [O].

    Args:
        in_features: D (a multiple of 16).
        out_features: O (a multiple of 16).
        bias: Whether the layer has a bias.
        weight_cache: Caller-owned :class:`FP8WeightCache`; None quantizes every call.
        backend: FP8 GEMM backend override.
        scale_format: ``"fp32"`` or ``"e8m0"``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        weight_cache: FP8WeightCache | None = None,
        backend: str | None = None,
        scale_format: ScaleFormat = "fp32",
    ):
        super().__init__()
        _check_aligned(in_features, out_features)
        _check_settings(backend, scale_format)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.weight_cache, self.backend, self.scale_format = weight_cache, backend, scale_format
        self.wgrad_queue: WeightGradQueue | None = None

    @classmethod
    def from_linear(cls, module: nn.Linear, **kwargs) -> "FP8Linear":
        """Takes over ``module``'s parameters (same objects, so names and state hold).

        The training mode and hooks come along (:func:`mt_ops._swap.carry_module_state`).

        Args:
            module: An ``nn.Linear`` (or subclass, e.g. :class:`mt_ops.deferred_wgrad.Linear`);
                one with state besides weight and bias is refused with ValueError.
            **kwargs: ``weight_cache``, ``backend``, ``scale_format``.

        Returns:
            The FP8 module.
        """
        check_swappable(module, "FP8Linear.from_linear")
        with torch.device("meta"):  # placeholders only: the module's parameters move in
            new = cls(module.in_features, module.out_features, bias=False, **kwargs)
        new.weight = module.weight
        new.bias = module.bias
        new.wgrad_queue = getattr(module, "wgrad_queue", None)
        carry_module_state(new, module)
        return new

    def forward(self, x: Tensor) -> Tensor:
        """``x @ weight.T + bias`` in FP8, over any leading dims of ``x`` [..., D]."""
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"x shape ({tuple(x.shape)}) must end in in_features ({self.in_features}); "
                "pass [..., in_features]"
            )
        x_MD = _autocast_input(x).reshape(-1, self.in_features).contiguous()
        counts_1 = torch.full((1,), x_MD.shape[0], dtype=torch.int64, device=x.device)
        bias_1O = None if self.bias is None else self.bias.unsqueeze(0)
        call = _Fp8Call(
            self.weight, _weight_source(self.weight_cache, self.scale_format), self.wgrad_queue,
            self.backend, self.scale_format, _needs_weight_grad(self.weight),
        )  # fmt: skip
        y_MO = _FP8GroupedLinearFn.apply(x_MD, self.weight.unsqueeze(0), bias_1O, counts_1, call)
        return y_MO.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8"


def default_fp8_filter(module: nn.Module, fqn: str) -> bool:
    """Converts linears whose dims are multiples of 16, except the output head.

    Args:
        module: An ``nn.Linear`` or ``GroupedLinear``.
        fqn: Its fully qualified name in the model.

    Returns:
        Whether to convert it (ARCHITECTURE §4: the head, embedding, router and norms stay
        BF16; routers are not ``nn.Linear`` here, so only the head needs excluding).
    """
    aligned = module.in_features % _FP8_ALIGN == 0 and module.out_features % _FP8_ALIGN == 0
    return aligned and fqn.split(".")[-1] != "lm_head"


def convert_to_fp8(
    model: nn.Module,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    *,
    weight_cache: FP8WeightCache | None = None,
    backend: str | None = None,
    scale_format: ScaleFormat = "fp32",
) -> nn.Module:
    """Swaps ``nn.Linear`` → :class:`FP8Linear` and ``GroupedLinear`` → :class:`FP8GroupedLinear`.

    Subclasses count (a model's own ``nn.Linear`` subclass with plain linear semantics).
    Layers already converted stay as they are; a second call must ask for their settings.
    Convert before FSDP2's ``fully_shard`` (it records the modules that own each weight).

    Parameters are moved, not copied, so fully qualified names (``...experts.gate_proj.weight``),
    checkpoints and optimizer state are unchanged; model files stay dtype-agnostic.

    Args:
        model: The model, modified in place.
        module_filter_fn: ``(module, fqn) -> bool``; None uses :func:`default_fp8_filter`.
        weight_cache: Caller-owned cache shared by all converted modules (recommended).
        backend: FP8 GEMM backend override for all converted modules.
        scale_format: ``"fp32"`` or ``"e8m0"``.

    Returns:
        ``model`` (for chaining).
    """
    _check_settings(backend, scale_format)
    keep = module_filter_fn or default_fp8_filter
    kwargs = {"weight_cache": weight_cache, "backend": backend, "scale_format": scale_format}
    root_layer = isinstance(model, nn.Linear | GroupedLinear)
    if root_layer and not isinstance(model, FP8Linear | FP8GroupedLinear) and keep(model, ""):
        linear = isinstance(model, nn.Linear)
        swap = "FP8Linear.from_linear" if linear else "FP8GroupedLinear.from_grouped_linear"
        refuse_root_layer(model, "convert_to_fp8", swap)
    # Every selected layer is checked before the first swap: a refusal leaves the model as
    # it was, not half converted.
    swaps = []  # (parent, attribute name, layer)
    for fqn, module in model.named_modules():
        for name, child in module.named_children():
            child_fqn = f"{fqn}.{name}" if fqn else name
            if isinstance(child, FP8Linear | FP8GroupedLinear):
                if keep(child, child_fqn):
                    _check_same_settings(child, child_fqn, kwargs)
                continue
            convertible = isinstance(child, nn.Linear | GroupedLinear)
            if convertible and keep(child, child_fqn):
                _check_convertible(child, child_fqn)
                swaps.append((module, name, child))
    for module, name, child in swaps:
        convert = (
            FP8Linear.from_linear
            if isinstance(child, nn.Linear)
            else FP8GroupedLinear.from_grouped_linear
        )
        setattr(module, name, convert(child, **kwargs))
    return model


def _check_same_settings(module: nn.Module, fqn: str, settings: dict) -> None:
    """A second conversion changes nothing, so it must not ask for other settings: its
    caller would invalidate a cache that the converted modules never fill."""
    differing = [k for k, v in settings.items() if getattr(module, k) != v]  # cache: by identity
    if differing:
        raise ValueError(
            f"{fqn!r} is already an {type(module).__name__} with other settings "
            f"({', '.join(differing)}) than this convert_to_fp8 call asks for; convert the "
            "model once, with the weight cache the training step invalidates (or set the "
            "module's attributes directly)"
        )


def _check_convertible(module: nn.Module, fqn: str) -> None:
    """Raises ValueError, naming the layer, when ``module_filter_fn`` selected a layer that
    cannot run in FP8."""
    check_swappable(module, "convert_to_fp8", fqn)  # also refuses FSDP-sharded layers
    if module.in_features % _FP8_ALIGN or module.out_features % _FP8_ALIGN:
        raise ValueError(
            f"{fqn!r} (in_features {module.in_features}, out_features {module.out_features}) "
            f"was selected for FP8, but FP8 linears need both to be multiples of {_FP8_ALIGN}; "
            "leave it in BF16 (exclude it in module_filter_fn)"
        )
