"""`clip_grad_norm` against an fp64 reference (CPU), through both of its code paths.

`_PER_TENSOR_MIN_NUMEL` decides which gradients get per-tensor kernels and which go
through the multi-tensor ones. Every test gradient here is under its default, so the
`path` fixture sets it to 0 (all per-tensor), past every size (all multi-tensor) and
between the sizes (both in one call).
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mt_parallel import grad_norm
from mt_parallel.grad_norm import clip_grad_norm
from mt_parallel.testing import check_clip_grad_norm_over_ranks, spawn

PATHS = {"per_tensor": 0, "multi_tensor": 1 << 40, "mixed": 1000}


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch):
    monkeypatch.setattr(grad_norm, "_PER_TENSOR_MIN_NUMEL", PATHS[request.param])
    return request.param


def _params(seed: int = 0, scale: float = 1.0) -> list[nn.Parameter]:
    """fp32 and bf16 gradients of odd shapes (one of 0-d, one empty), two params without."""
    gen = torch.Generator().manual_seed(seed)
    specs = [
        ((1023, 777), torch.float32),
        ((31,), torch.bfloat16),
        ((), torch.float32),
        ((0, 4), torch.bfloat16),
        ((17, 3), torch.bfloat16),
        ((5,), torch.float32),
        ((4, 4), torch.float32),
        ((9,), torch.bfloat16),
    ]
    params = []
    for i, (shape, dtype) in enumerate(specs):
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        if i not in (5, 7):  # these keep grad None
            p.grad = (torch.randn(shape, generator=gen) * scale).to(dtype)
        params.append(p)
    return params


def _reference_norm(params: list[nn.Parameter]) -> float:
    grads = [p.grad.double().flatten() for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.cat(grads)).item()


def _grads(params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in params]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # torch.equal is False for NaN == NaN; compare the bits instead.
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(int_dtype), b.view(int_dtype))


def test_norm_of_mixed_fp32_and_bf16_grads_matches_fp64_norm_of_all_concatenated(path):
    params = _params()
    ref = _reference_norm(params)
    total = clip_grad_norm(params, math.inf)
    assert total == pytest.approx(ref, rel=1e-6)


def test_clipping_scales_every_gradient_by_max_norm_over_total_plus_eps(path):
    params = _params(seed=1)
    before = _grads(params)
    ref = _reference_norm(params)
    max_norm = ref / 7
    total = clip_grad_norm(params, max_norm)
    assert total == pytest.approx(ref, rel=1e-6)  # the norm before clipping
    scale = max_norm / (total + 1e-6)
    for p, g in zip(params, before, strict=True):
        if g is None:
            assert p.grad is None
        else:
            assert _same_bits(p.grad, g.mul_(scale)), p.grad.dtype
    assert _reference_norm(params) == pytest.approx(max_norm, rel=1e-2)  # bf16 rounding


@pytest.mark.parametrize("max_norm", ["above_total", math.inf])
def test_a_norm_within_max_norm_leaves_gradients_untouched(path, max_norm):
    params = _params(seed=2)
    before = _grads(params)
    ref = _reference_norm(params)
    total = clip_grad_norm(params, ref * 1.01 if max_norm == "above_total" else max_norm)
    assert total == pytest.approx(ref, rel=1e-6)
    for p, g in zip(params, before, strict=True):
        assert (p.grad is None) if g is None else _same_bits(p.grad, g)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", [0, 1])  # an fp32 and a bf16 gradient
def test_a_non_finite_gradient_returns_inf_or_nan_and_leaves_gradients_untouched(path, bad, where):
    params = _params(seed=3)
    params[where].grad.view(-1)[3] = bad
    before = _grads(params)
    total = clip_grad_norm(params, 1.0)
    assert math.isnan(total) if math.isnan(bad) else total == math.inf
    for p, g in zip(params, before, strict=True):
        assert (p.grad is None) if g is None else _same_bits(p.grad, g)


def test_bf16_norms_are_not_rounded_to_bf16(path):
    # sqrt(3) = 1.7320508 rounds to 1.734375 in bf16 and sqrt(3 * 2**16) = 443.405 to
    # 444.0: relative errors of 1.3e-3, which 1e-6 catches. Summed in bf16, 2**16 ones
    # would stop growing at 256.
    params = [nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in (3, 3 * 2**16)]
    for p in params:
        p.grad = torch.ones_like(p)
    assert clip_grad_norm(params, math.inf) == pytest.approx(math.sqrt(3 + 3 * 2**16), rel=1e-6)
    assert clip_grad_norm(params[:1], math.inf) == pytest.approx(math.sqrt(3), rel=1e-6)


def test_half_precision_grads_whose_squares_overflow_or_round_give_the_right_norm(path):
    # fp16 tops out at 65504, so 300**2 is inf in fp16. bf16 has fp32's exponent range
    # but 8 significant bits: sqrt(3) * v, for v = 3e18 in bf16, rounds by 1.3e-3 there.
    fp16 = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    fp16.grad = torch.full((4,), 300.0, dtype=torch.float16)
    assert clip_grad_norm([fp16], math.inf) == pytest.approx(600.0, rel=1e-6)
    bf16 = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    bf16.grad = torch.full((3,), 3e18).to(torch.bfloat16)
    expected = math.sqrt(3) * bf16.grad[0].double().item()
    assert clip_grad_norm([bf16], math.inf) == pytest.approx(expected, rel=1e-6)


def test_a_finite_norm_whose_square_passes_the_fp32_range_is_finite_and_clipped(path):
    # Each gradient's norm is 2e19 (fp64 on CPU); its square, 4e38, is past fp32's 3.4e38.
    params = [nn.Parameter(torch.zeros(4)) for _ in range(2)]
    for p in params:
        p.grad = torch.full((4,), 1e19)
    expected = math.sqrt(8) * torch.tensor(1e19).item()
    assert clip_grad_norm(params, 1.0) == pytest.approx(expected, rel=1e-6)
    assert _reference_norm(params) == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("max_norm", [-1.0, math.nan])
def test_a_negative_or_nan_max_norm_is_refused_and_gradients_left_untouched(max_norm):
    params = _params(seed=5)
    before = _grads(params)
    with pytest.raises(ValueError, match=rf"max_norm \({max_norm}\) must be >= 0; pass math.inf"):
        clip_grad_norm(params, max_norm)
    for p, g in zip(params, before, strict=True):
        assert (p.grad is None) if g is None else _same_bits(p.grad, g)


def test_no_gradients_give_a_zero_norm(path):
    params = [nn.Parameter(torch.zeros(3))]
    assert clip_grad_norm(params, 1.0) == 0.0
    assert clip_grad_norm([], 1.0) == 0.0
    assert params[0].grad is None


def test_fp64_gradients_are_measured_and_clipped_in_fp64(path):
    p = nn.Parameter(torch.zeros(1000, dtype=torch.float64))
    p.grad = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    g = p.grad.clone()
    total = clip_grad_norm([p], 0.5)
    assert total == pytest.approx(torch.linalg.vector_norm(g).item(), rel=1e-6)
    assert _same_bits(p.grad, g.mul_(0.5 / (total + 1e-6)))


def test_sharded_dtensor_and_per_rank_grads_give_the_world_norm_and_are_clipped():
    # Also: a rank holding no gradient (an EP rank without a group's experts) joins the
    # all-reduce with an fp64 zero on the group's device, and the ranks that do hold
    # gradients get the one-process norm and clipping.
    spawn(check_clip_grad_norm_over_ranks, 2)


@pytest.mark.parametrize(
    ("backend", "want"),
    [
        ("nccl", torch.device("cuda", 3)),
        ("gloo", torch.device("cpu")),
        ("cpu:gloo,cuda:nccl", torch.device("cpu")),
    ],
)
def test_a_rank_without_gradients_reduces_on_the_device_its_group_communicates_from(
    monkeypatch, backend, want
):
    # An NCCL all-reduce takes CUDA tensors only: a rank with no gradient used to put its
    # zero on the CPU and fail the collective (or hang the ranks that joined it).
    group = object()
    monkeypatch.setattr(dist, "get_backend", lambda g: backend if g is group else "?")
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 3)
    assert grad_norm._reduce_device([], group) == want
    assert grad_norm._reduce_device([], None) == torch.device("cpu")  # one process
    # CPU gradients (FSDP2's CPU offload) with an NCCL group: the sum goes to the GPU too.
    grads = [torch.zeros(2, dtype=torch.bfloat16)]
    assert grad_norm._reduce_device(grads, group) == want
    assert grad_norm._reduce_device(grads, None) == grads[0].device
