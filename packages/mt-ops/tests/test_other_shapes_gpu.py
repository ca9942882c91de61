"""MoE and FP8 kernels on other model families' expert shapes, each against its reference.

Legend: T tokens, D model dim, F expert hidden, E experts, K top-k, R routed rows (T·K),
P expert-parallel ranks.

The other GPU tests use Qwen3-30B-A3B (E 128, K 8, D 2048, F 768) and DeepSeek-V2-Lite
(E 64, K 6, D 2048, F 1408) shapes. These run every kernel path on four more, each with
balanced routing and skewed routing (expert 0 in every token's top-k, the most rows one
expert can get; the rest by Zipf-like popularity, so tail experts get few or none):

- GPT-OSS-20B: E 32, K 4, D = F = 2880, not a multiple of 128 (ragged K and N tiles); its
  clamped SwiGLU over biased experts on the BF16 grouped path, and in FP8;
- Mixtral-8x7B: E 8, K 2, D 4096, F 14336 (few large experts, full size);
- DeepSeek-V3: E 256, K 8, D 7168, F 2048 with 64 tokens (2 rows per expert on average:
  many experts get none or one, which ``_routed`` asserts);
- an odd tiny case: E 3, K 2, D 200, F 72, 37 tokens (D and F not multiples of 16: the
  GEMMs take pointer loads instead of TMA, and FP8 linears refuse these dims).

Standards are the other tests': plans and permutation exact, quantizers bit for bit, fp32
GEMM outputs within Hopper's FP8 accumulation of the exact emulation, one FP8 product within
calc_diff 1e-3 of the unquantized product and a chain of them (the expert MLP) within 3e-3
of the BF16 path (4e-3 for the few top-k weight gradients, see FP8_CHAIN_FEW_VALUES), the
fused MLP equal to the unfused modules.

The check bodies take a ``Where``, so they also run on CPU: here for the odd shape (the
public ops run their references and the emulation there, and the planning and permutation
kernels run in Triton's interpreter), within a few seconds. The GPU shapes' small stand-ins
(same E, K, P and raggedness) took minutes on CPU and were run once by hand.
"""

import importlib
import math
import zlib
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import mt_ops.fp8_gemm as gemm_module
from mt_ops import (
    FP8GroupedLinear,
    FP8WeightCache,
    GroupedLinear,
    clamped_swiglu_fused,
    clamped_swiglu_reference,
    fp8_grouped_gemm,
    fp8_grouped_gemm_sum,
    fp8_grouped_gemm_sum_reference,
    fp8_grouped_wgrad,
    fp8_moe_swiglu_experts,
    fp8_swiglu_experts,
    fp8_swiglu_experts_reference,
    grouped_linear,
    grouped_linear_reference,
    grouped_swiglu_moe,
    permute,
    permute_reference,
    plan_dispatch,
    plan_dispatch_reference,
    quantize_1x128,
    quantize_1x128_dual,
    quantize_128x128,
    row_tiles,
    swiglu,
    swiglu_backward_quantize_1x128,
    swiglu_backward_quantize_1x128_reference,
    swiglu_quantize_1x128,
    swiglu_quantize_1x128_reference,
    unpermute,
    unpermute_reference,
)
from mt_ops.fp8_gemm import fp8_grouped_gemm_reference, fp8_grouped_wgrad_reference
from mt_ops.fp8_quant import (
    Fp8Quantized,
    quantize_1x128_dual_reference,
    quantize_1x128_reference,
    quantize_128x128_reference,
    scale_to_float,
)


@dataclass(frozen=True)
class MoEShape:
    """One model family's experts, at a test's token count."""

    name: str
    num_experts: int
    topk: int
    dim: int
    hidden: int
    num_tokens: int
    num_ranks: int  # P of the plan's per-rank counts (divides E)
    mlp_hidden: int | None  # F of the FP8 expert MLP check; None: FP8 linears refuse D or F


GPU_SHAPES = {
    "gpt-oss-20b": MoEShape("gpt-oss-20b", 32, 4, 2880, 2880, 1000, 4, 2880),
    # Full F: 1.9 GB per fp32 expert weight; the MLP check peaks near 25 GB.
    "mixtral-8x7b": MoEShape("mixtral-8x7b", 8, 2, 4096, 14336, 1024, 4, 14336),
    # The MLP check runs F 512 (~45 GB): at F 2048 three fp32 [256, 2048, 7168] weights
    # (45 GB), their gradients for two runs and the BF16 copies would pass 150 GB. The
    # quantizer and GEMM checks keep F 2048 (bf16 weights, 7.5 GB each; 30 GB with their
    # quantizations, plus ~45 GB while the emulation dequantizes one).
    "deepseek-v3": MoEShape("deepseek-v3", 256, 8, 7168, 2048, 64, 8, 512),
    "odd-tiny": MoEShape("odd-tiny", 3, 2, 200, 72, 37, 3, None),
}
CLAMPED_FAMILIES = ("gpt-oss-20b", "odd-tiny")  # GPT-OSS's activation, and the odd dims
ROUTINGS = ("balanced", "skewed")


@dataclass(frozen=True)
class Where:
    """Where the checks run and what they can demand there.

    Attributes:
        device: "cuda" or "cpu".
        dtype: Activations: bf16; fp32 in the interpreter, which mis-rounds casts to bf16.
        compiled: Compiled kernels: Hopper's FP8 accumulation, and fused ops equal to the
            unfused ones bit for bit. On CPU the public ops run their references and the
            exact emulation (or, in the interpreter, the kernels with fp32 dot products).
        exact_casts: Casts to fp8 round correctly. The interpreter's do not (1.98 -> 1.0):
            there quantizers match in scales and >= 75% of the bytes (test_fp8_quant), and
            FP8 results are not compared with unquantized ones.
    """

    device: str
    dtype: torch.dtype
    compiled: bool
    exact_casts: bool = True


GPU = Where("cuda", torch.bfloat16, compiled=True)
CPU = Where("cpu", torch.bfloat16, compiled=False)
INTERPRETER = Where("cpu", torch.float32, compiled=False, exact_casts=False)

# Relative L2 error of an op against its reference by output dtype (conftest's TOLERANCES).
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# fp32 GEMM outputs against the exact emulation: Hopper's FP8 tensor cores add inside each
# 128-wide K block with fewer bits than fp32 (measured 1.3e-4; test_fp8_gemm.py).
HOPPER_FP8_ACCUMULATION = 3e-4
BF16_OUTPUT = 4e-3  # bf16 outputs of the same fp32 products (test_fp8_gemm, test_fp8_linear)
FP8_PRODUCT = 1e-3  # calc_diff of one FP8 product against the unquantized one
FP8_CHAIN = 3e-3  # three chained FP8 products, as the expert MLP (test_fp8_expert_mlp)
# The top-k weight gradient (one dot product of y with the output gradient per slot) carries
# y's error, but its calc_diff over only T·K values scatters: over 512 values (DeepSeek-V3's
# 64 tokens) 2.2e-3 ± 2.4e-4 across 12 seeds of the CPU emulation, max 2.7e-3 (the other
# outputs ± 6e-5). 3e-3 would sit only 3.3 standard deviations above the mean: 4e-3.
FP8_CHAIN_FEW_VALUES = 4e-3
ALPHA, LIMIT = 1.702, 7.0  # GPT-OSS's swiglu_alpha and swiglu_limit


# --- comparisons (in float64 chunks: a DeepSeek-V3 dW holds 3.8e9 values) -----------------


def _sums(got: torch.Tensor, want: torch.Tensor, chunk: int = 1 << 26) -> list[float]:
    """[Σ(g − w)², Σw², Σgw, Σg²] in float64."""
    assert got.shape == want.shape, f"{got.shape=}, {want.shape=}"
    g_flat, w_flat = got.detach().reshape(-1), want.detach().reshape(-1)
    sums = torch.zeros(4, dtype=torch.float64, device=got.device)
    for start in range(0, g_flat.numel(), chunk):
        g, w = g_flat[start : start + chunk].double(), w_flat[start : start + chunk].double()
        sums += torch.stack(
            [(g - w).square().sum(), w.square().sum(), (g * w).sum(), g.square().sum()]
        )
    return sums.tolist()


def _relative(got, want) -> float:
    diff2, want2, _, _ = _sums(got, want)
    return math.sqrt(diff2) / max(math.sqrt(want2), 1e-30)


def _calc_diff(got, want) -> float:
    """DeepGEMM's similarity error 1 − 2Σxy / Σ(x² + y²) (0 for two zero tensors)."""
    _, want2, cross, got2 = _sums(got, want)
    return 1 - 2 * cross / (got2 + want2) if got2 + want2 > 0 else 0.0


def _assert_relative(got, want, tol, what):
    err = _relative(got, want)
    if tol == 0:
        assert torch.equal(got, want), f"{what}: not equal (relative L2 error {err:.3e})"
    assert err <= tol, f"{what}: relative L2 error {err:.3e} > {tol:.1e}"


def _assert_calc_diff(got, want, tol, what):
    diff = _calc_diff(got, want)
    assert diff <= tol, f"{what}: calc_diff {diff:.3e} > {tol:.1e}"


def _assert_same_fp8(got: Fp8Quantized, want: Fp8Quantized, where: Where, what: str):
    assert got.data.shape == want.data.shape, f"{what}: {got.data.shape=}, {want.data.shape=}"
    assert torch.equal(scale_to_float(got.scale), scale_to_float(want.scale)), f"{what}: scales"
    num_differ = int((got.data.view(torch.uint8) != want.data.view(torch.uint8)).sum())
    allowed = 0 if where.exact_casts else want.data.numel() // 4
    assert num_differ <= allowed, f"{what}: {num_differ} of {want.data.numel()} fp8 bytes differ"


# --- inputs --------------------------------------------------------------------------------


def _randn(gen, *shape, dtype=torch.float32, std=1.0):
    out = torch.randn(*shape, generator=gen, device=gen.device, dtype=dtype)
    return out.mul_(std) if std != 1.0 else out


def _generator(where: Where, seed: int) -> torch.Generator:
    return torch.Generator(device=where.device).manual_seed(seed)


def _routing(shape: MoEShape, routing: str, device: str):
    """Top-k ids [T, K] and weights [T, K] (rows sum to one), seeded by shape and routing."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{shape.name}/{routing}".encode()))
    uniform_TE = torch.rand(shape.num_tokens, shape.num_experts, generator=gen).clamp_min(1e-12)
    scores_TE = uniform_TE
    if routing == "skewed":
        # Gumbel top-k over log-popularity: K distinct experts per token, by popularity.
        popularity_E = torch.arange(1, shape.num_experts + 1, dtype=torch.float32).pow(-1.5)
        scores_TE = popularity_E.log() - (-uniform_TE.log()).log()
        scores_TE[:, 0] = math.inf
    topk_ids_TK = scores_TE.topk(shape.topk, dim=-1).indices
    weights_TK = torch.rand(shape.num_tokens, shape.topk, generator=gen) + 0.1
    weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    return topk_ids_TK.to(device), weights_TK.to(device)


def _routed(shape: MoEShape, routing: str, where: Where):
    """The routing, its plan (public op) and a label; asserts the routing is as claimed."""
    topk_ids_TK, weights_TK = _routing(shape, routing, where.device)
    plan = plan_dispatch(topk_ids_TK, shape.num_experts, num_ranks=shape.num_ranks)
    counts = plan.tokens_per_expert_E.tolist()
    what = f"{shape.name}, {routing} routing"
    assert sum(counts) == shape.num_tokens * shape.topk, (what, counts)
    if routing == "skewed":
        assert counts[0] == shape.num_tokens == max(counts), (what, counts[:8])
    elif shape.num_tokens * shape.topk <= 2 * shape.num_experts:  # the sparse DeepSeek-V3 case
        assert 0 in counts and 1 in counts, (what, "experts with zero and one row expected")
    return topk_ids_TK, weights_TK, plan, what


def _grouped_linear_of(weight_EOD, bias_EO=None) -> GroupedLinear:
    num_experts, d_out, d_in = weight_EOD.shape
    with torch.device("meta"):
        module = GroupedLinear(num_experts, d_in, d_out, bias=bias_EO is not None)
    module.weight = nn.Parameter(weight_EOD.detach())
    if bias_EO is not None:
        module.bias = nn.Parameter(bias_EO.detach())
    return module


def _fp8_grouped(weight_EOD, bias_EO=None, backend=None, cache=None) -> FP8GroupedLinear:
    module = _grouped_linear_of(weight_EOD, bias_EO)
    return FP8GroupedLinear.from_grouped_linear(module, weight_cache=cache, backend=backend)


def _outputs_and_grads(fn, inputs, grad_out, modules=()):
    """``fn(*inputs)``, then the gradients of the inputs and of the modules' parameters."""
    for module in modules:
        module.zero_grad(set_to_none=True)
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    params = [p.grad for m in modules for p in (m.weight, m.bias) if p is not None]
    return [out.detach(), *(leaf.grad for leaf in leaves), *params]


# --- checks --------------------------------------------------------------------------------

PLAN_FIELDS = ("tokens_per_expert_E", "sorted_token_ids_R", "sorted_slot_R", "row_of_slot_R")
RANK_FIELDS = ("tokens_per_rank_P", "token_to_rank_TP")
PERMUTE_OUTPUTS = (
    "permute",
    "permute x grad",
    "unpermute",
    "unpermute y grad",
    "unpermute top-k weight grad",
)


def _check_plan_and_permutation(shape: MoEShape, where: Where):
    gen = _generator(where, 1)
    for routing in ROUTINGS:
        topk_ids_TK, weights_TK, plan, what = _routed(shape, routing, where)
        for num_ranks in (shape.num_ranks, None):
            got = plan_dispatch(topk_ids_TK, shape.num_experts, num_ranks=num_ranks)
            ref = plan_dispatch_reference(topk_ids_TK, shape.num_experts, num_ranks=num_ranks)
            for field in PLAN_FIELDS + (RANK_FIELDS if num_ranks else ()):
                same = torch.equal(getattr(got, field), getattr(ref, field))
                assert same, f"{what}: plan {field} with num_ranks={num_ranks}"
        ranks_per_token_T = plan.token_to_rank_TP.sum(1)
        assert torch.equal(plan.token_to_rank_TP.sum(0), plan.tokens_per_rank_P), what
        assert int(ranks_per_token_T.min()) >= 1, what
        assert int(ranks_per_token_T.max()) <= min(shape.topk, shape.num_ranks), what
        for dtype in dict.fromkeys((where.dtype, torch.float32)):
            label = f"{what}, {dtype}"
            num_rows = shape.num_tokens * shape.topk
            x_TD, grad_TD = (_randn(gen, shape.num_tokens, shape.dim, dtype=dtype) for _ in "xg")
            y_RD, grad_RD = (_randn(gen, num_rows, shape.dim, dtype=dtype) for _ in "yg")
            runs = []
            for perm, unperm in ((permute, unpermute), (permute_reference, unpermute_reference)):
                routed = _outputs_and_grads(
                    lambda x, perm=perm, plan=plan: perm(x, plan), [x_TD], grad_RD
                )
                combined = _outputs_and_grads(
                    lambda y, w, unperm=unperm, plan=plan: unperm(y, plan, w),
                    [y_RD, weights_TK],
                    grad_TD,
                )
                runs.append(routed + combined)
            # Permute copies rows: exact. The rest sum in fp32 and round to the output dtype;
            # the top-k weight gradient is fp32 (the existing GPU test's 1e-5).
            tols = [0, TOLERANCES[dtype], TOLERANCES[dtype], TOLERANCES[dtype], 1e-5]
            for name, tol, got, ref in zip(PERMUTE_OUTPUTS, tols, *runs, strict=True):
                _assert_relative(got, ref, tol, f"{label}: {name}")


def _check_fp8_quantizers(shape: MoEShape, where: Where):
    gen = _generator(where, 2)
    num_rows = shape.num_tokens * shape.topk
    for routing in ROUTINGS:
        _, weights_TK, plan, what = _routed(shape, routing, where)
        tiles = row_tiles(plan.tokens_per_expert_E, num_rows)
        # Rows and columns over six orders of magnitude: tiles get many different scales.
        x_TD = _randn(gen, shape.num_tokens, shape.dim)
        x_TD *= torch.logspace(-1.5, 1.5, shape.num_tokens, device=where.device)[:, None]
        x_TD = (x_TD * torch.logspace(-1.5, 1.5, shape.dim, device=where.device)).to(where.dtype)
        x_RD = permute(x_TD, plan)
        row_weights_R = weights_TK.reshape(-1).index_select(0, plan.sorted_slot_R)
        gate_RF, up_RF, grad_RF = (
            _randn(gen, num_rows, shape.hidden, dtype=where.dtype, std=3.0) for _ in "gud"
        )
        for fmt in ("fp32", "e8m0"):
            label = f"{what}, {fmt} scales"
            _assert_same_fp8(
                quantize_1x128(x_TD, scale_format=fmt),
                quantize_1x128_reference(x_TD, scale_format=fmt),
                where,
                f"{label}: rows of x",
            )
            gather = {"source_rows": plan.sorted_token_ids_R, "row_weights": row_weights_R}
            cases = [
                ("routed x", x_RD, {}),
                ("x gathered and weighted", x_TD, gather),
                ("gate", gate_RF, {}),
            ]
            for name, x, options in cases:
                got = quantize_1x128_dual(x, tiles=tiles, scale_format=fmt, **options)
                ref = quantize_1x128_dual_reference(x, tiles=tiles, scale_format=fmt, **options)
                for half, g, r in zip(("rows", "expert tiles of xᵀ"), got, ref, strict=True):
                    _assert_same_fp8(g, r, where, f"{label}: {name}, {half}")
            # The fused SwiGLU quantizers: on GPU equal to the unfused kernels (Triton SwiGLU,
            # then the quantizer), on CPU checked against their references.
            fused = [
                swiglu_quantize_1x128(gate_RF, up_RF, tiles=tiles, scale_format=fmt),
                *swiglu_backward_quantize_1x128(
                    grad_RF, gate_RF, up_RF, tiles=tiles, scale_format=fmt
                ),
            ]
            if where.compiled:
                h_RF, dgate_RF, dup_RF = _outputs_and_grads(swiglu, [gate_RF, up_RF], grad_RF)
                unfused = [
                    quantize_1x128_dual(t, tiles=tiles, scale_format=fmt)
                    for t in (h_RF, dgate_RF, dup_RF)
                ]
            else:
                unfused = [
                    swiglu_quantize_1x128_reference(gate_RF, up_RF, tiles=tiles, scale_format=fmt),
                    *swiglu_backward_quantize_1x128_reference(
                        grad_RF, gate_RF, up_RF, tiles=tiles, scale_format=fmt
                    ),
                ]
            for name, got, ref in zip(("swiglu", "dgate", "dup"), fused, unfused, strict=True):
                for half, g, r in zip(("rows", "expert tiles"), got, ref, strict=True):
                    _assert_same_fp8(g, r, where, f"{label}: fused {name} quantization, {half}")
    # Expert weights [E, F, D] by 128×128 blocks and transposed; the reference 16 experts at
    # a time (DeepSeek-V3: 0.9 GB of fp32 per slice).
    w_EFD = _randn(
        gen, shape.num_experts, shape.hidden, shape.dim, dtype=where.dtype, std=shape.dim**-0.5
    )
    for fmt in ("fp32", "e8m0"):
        got = quantize_128x128(w_EFD, scale_format=fmt, transpose=True)
        for e0 in range(0, shape.num_experts, 16):
            ref = quantize_128x128_reference(w_EFD[e0 : e0 + 16], scale_format=fmt, transpose=True)
            for half, g, r in zip(("blocks", "transposed"), got, ref, strict=True):
                g = Fp8Quantized(*(t[e0 : e0 + 16] for t in g))
                _assert_same_fp8(g, r, where, f"{shape.name}, {fmt}: weight {half}, experts {e0}+")


def _exact_grouped(a_RK, w_ENK, counts) -> torch.Tensor:
    """``a[rows of e] @ w[e]ᵀ`` per expert in fp32 from the unquantized operands."""
    out = torch.zeros(a_RK.shape[0], w_ENK.shape[1], device=a_RK.device)
    start = 0
    for e, count in enumerate(counts):
        if count:
            out[start : start + count] = a_RK[start : start + count].float() @ w_ENK[e].float().T
        start += count
    return out


def _check_wgrad(a_t, b_t, tiles, a_RN, b_RK, counts, where, what):
    backend = "triton" if where.compiled else None
    tol = HOPPER_FP8_ACCUMULATION if where.compiled else 1e-5
    got = fp8_grouped_wgrad(a_t, b_t, tiles, backend=backend)  # fp32 [E, N, K]
    ref = fp8_grouped_wgrad_reference(a_t, b_t, tiles)
    _assert_relative(got, ref, tol, f"{what}: fp32 vs emulation")
    nonzero = [e for e, count in enumerate(counts) if count == 0 and bool(got[e].any())]
    assert not nonzero, f"{what}: experts without rows got a gradient: {nonzero[:8]}"
    got_bf16 = fp8_grouped_wgrad(a_t, b_t, tiles, out_dtype=torch.bfloat16, backend=backend)
    if where.compiled:  # one rounding of the same fp32 accumulator
        assert torch.equal(got_bf16, got.bfloat16()), f"{what}: bf16 output"
    _assert_relative(got_bf16, ref, BF16_OUTPUT, f"{what}: bf16 output vs emulation")
    del got_bf16
    accumulated = ref.clone()
    fp8_grouped_wgrad(a_t, b_t, tiles, out=accumulated, backend=backend)
    _assert_relative(accumulated.sub_(ref), ref, tol, f"{what}: accumulated into out")
    del accumulated
    if where.exact_casts:
        exact = torch.zeros_like(ref)  # [E, N, K] fp32, filled expert by expert
        start = 0
        for e, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                exact[e] = a_RN[rows].float().T @ b_RK[rows].float()
            start += count
        _assert_calc_diff(got, exact, FP8_PRODUCT, f"{what}: vs unquantized")


def _check_fp8_grouped_gemms(shape: MoEShape, where: Where):
    num_experts, dim, hidden = shape.num_experts, shape.dim, shape.hidden
    num_rows = shape.num_tokens * shape.topk
    backend = "triton" if where.compiled else None
    tol = HOPPER_FP8_ACCUMULATION if where.compiled else 1e-5
    gen = _generator(where, 3)
    # Weights in the activation dtype: DeepSeek-V3's [256, 2048, 7168] is 7.5 GB in bf16.
    w1_EFD = _randn(gen, num_experts, hidden, dim, dtype=where.dtype, std=dim**-0.5)  # up
    w2_EDF = _randn(gen, num_experts, dim, hidden, dtype=where.dtype, std=hidden**-0.5)  # down
    w1, w1_t = quantize_128x128(w1_EFD, transpose=True)
    w2, w2_t = quantize_128x128(w2_EDF, transpose=True)
    for routing in ROUTINGS:
        _, _, plan, what = _routed(shape, routing, where)
        counts = plan.tokens_per_expert_E.tolist()
        tiles = row_tiles(plan.tokens_per_expert_E, num_rows)
        x_RD, dy_RD = (_randn(gen, num_rows, dim, dtype=where.dtype) for _ in "xy")
        h_RF, dh_RF = (_randn(gen, num_rows, hidden, dtype=where.dtype) for _ in "hd")
        (xq, xq_t), (dyq, dyq_t), (hq, hq_t), (dhq, dhq_t) = (
            quantize_1x128_dual(t, tiles=tiles) for t in (x_RD, dy_RD, h_RF, dh_RF)
        )
        products = [
            ("fprop x·w1ᵀ", xq, w1, x_RD, w1_EFD),
            ("fprop h·w2ᵀ", hq, w2, h_RF, w2_EDF),
            ("dgrad dh·w1", dhq, w1_t, dh_RF, w1_EFD.transpose(1, 2)),
            ("dgrad dy·w2", dyq, w2_t, dy_RD, w2_EDF.transpose(1, 2)),
        ]
        for name, a, b, a_exact, w_exact in products:
            label = f"{what}: {name}"
            ref = fp8_grouped_gemm_reference(a, b, tiles, out_dtype=torch.float32)
            got = fp8_grouped_gemm(a, b, tiles, out_dtype=torch.float32, backend=backend)
            _assert_relative(got, ref, tol, f"{label}, fp32 vs emulation")
            got_bf16 = fp8_grouped_gemm(a, b, tiles, out_dtype=torch.bfloat16, backend=backend)
            _assert_relative(got_bf16, ref, BF16_OUTPUT, f"{label}, bf16 vs emulation")
            if where.exact_casts:
                exact = _exact_grouped(a_exact, w_exact, counts)
                _assert_calc_diff(got, exact, FP8_PRODUCT, f"{label}, vs unquantized")
        # Two products in one pass (as the gate and up dgrad): dh·w1 + h·w2ᵀ, both [E, D, F].
        label = f"{what}: dh·w1 + h·w2ᵀ"
        got = fp8_grouped_gemm_sum(
            dhq, w1_t, hq, w2, tiles, out_dtype=torch.float32, backend=backend
        )
        ref = fp8_grouped_gemm_sum_reference(dhq, w1_t, hq, w2, tiles, out_dtype=torch.float32)
        _assert_relative(got, ref, tol, f"{label}, fp32 vs emulation")
        first = fp8_grouped_gemm_reference(dhq, w1_t, tiles, out_dtype=torch.float32)
        assert _relative(got, first) > 0.1, f"{label}: the second product is not added"
        _check_wgrad(dhq_t, xq_t, tiles, dh_RF, x_RD, counts, where, f"{what}: wgrad dhᵀ·x")
        _check_wgrad(dyq_t, hq_t, tiles, dy_RD, h_RF, counts, where, f"{what}: wgrad dyᵀ·h")


def _permute_experts_unpermute(x_TD, plan, weights_TK, *projections):
    routed_RD = permute(x_TD, plan)
    y_RD = fp8_swiglu_experts(routed_RD, plan.tokens_per_expert_E, *projections)
    return unpermute(y_RD, plan, weights_TK)


MLP_OUTPUTS = ("y", "x grad", "gate weight grad", "up weight grad", "down weight grad")
MOE_OUTPUTS = ("out", "x grad", "top-k weight grad", *MLP_OUTPUTS[2:])


def _check_fp8_expert_mlp(shape: MoEShape, where: Where):
    if shape.mlp_hidden is None:
        with pytest.raises(ValueError, match="multiples of 16"):
            FP8GroupedLinear(shape.num_experts, shape.dim, shape.hidden)
        return
    num_experts, dim, hidden = shape.num_experts, shape.dim, shape.mlp_hidden
    gen = _generator(where, 4)
    backend = "triton" if where.compiled else None
    cache = FP8WeightCache()
    weights = [
        _randn(gen, num_experts, d_out, d_in, std=d_in**-0.5)  # fp32 masters
        for d_in, d_out in ((dim, hidden), (dim, hidden), (hidden, dim))
    ]
    plain = [_grouped_linear_of(w.to(where.dtype)) for w in weights]
    fp8 = [_fp8_grouped(w, backend=backend, cache=cache) for w in weights]
    del weights
    for routing in ROUTINGS:
        _, weights_TK, plan, what = _routed(shape, routing, where)
        counts_E = plan.tokens_per_expert_E
        x_TD, grad_TD = (_randn(gen, shape.num_tokens, dim, dtype=where.dtype) for _ in "xg")
        grad_RD = _randn(gen, shape.num_tokens * shape.topk, dim, dtype=where.dtype)
        x_RD = permute(x_TD, plan)

        def experts(fn, counts_E=counts_E):
            return lambda x: fn(x, counts_E, *fp8)

        fused = _outputs_and_grads(experts(fp8_swiglu_experts), [x_RD], grad_RD, fp8)
        unfused = _outputs_and_grads(experts(fp8_swiglu_experts_reference), [x_RD], grad_RD, fp8)
        for name, got, ref in zip(MLP_OUTPUTS, fused, unfused, strict=True):
            # On GPU only the input gradient differs: one bf16 rounding instead of two. On
            # CPU the unfused SwiGLU rounds silu(gate) to bf16 before multiplying by up.
            tol = (0 if name != "x grad" else BF16_OUTPUT) if where.compiled else 3e-2
            _assert_relative(got, ref, tol, f"{what}: fused MLP {name} vs unfused modules")
        empty = (counts_E == 0).nonzero().flatten().tolist()
        for name, grad in zip(MLP_OUTPUTS[2:], fused[2:], strict=True):
            assert not any(bool(grad[e].any()) for e in empty), f"{what}: {name} of empty experts"
        del fused, unfused

        def moe(fn, plan=plan):
            return lambda x, w: fn(x, plan, w, *fp8)

        got = _outputs_and_grads(moe(fp8_moe_swiglu_experts), [x_TD, weights_TK], grad_TD, fp8)
        composed = _outputs_and_grads(
            moe(_permute_experts_unpermute), [x_TD, weights_TK], grad_TD, fp8
        )
        for name, g, r in zip(MOE_OUTPUTS, got, composed, strict=True):
            tol = 0 if where.compiled else 1e-5  # the interpreter sums fp32 in another order
            _assert_relative(g, r, tol, f"{what}: fused MoE {name} vs permute-MLP-unpermute")
        del composed
        if not where.exact_casts:
            continue

        def plain_moe(x, w, plan=plan):
            return grouped_swiglu_moe(x, plan, w, *plain)

        reference = _outputs_and_grads(plain_moe, [x_TD, weights_TK], grad_TD, plain)
        for name, g, r in zip(MOE_OUTPUTS, got, reference, strict=True):
            tol = FP8_CHAIN_FEW_VALUES if name == "top-k weight grad" else FP8_CHAIN
            _assert_calc_diff(g, r, tol, f"{what}: FP8 MoE {name} vs {where.dtype} path")


def _clamped_experts(gate_up, down, counts_E, activation):
    def fn(x_RD, w_gate_up, b_gate_up, w_down, b_down):
        gate_up_R2F = gate_up(x_RD, w_gate_up, counts_E, b_gate_up)  # [R, 2F] interleaved
        return down(activation(gate_up_R2F, ALPHA, LIMIT), w_down, counts_E, b_down)

    return fn


CLAMPED_OUTPUTS = (
    "out",
    "x grad",
    "gate_up weight grad",
    "gate_up bias grad",
    "down weight grad",
    "down bias grad",
)


def _check_clamped_swiglu_experts(shape: MoEShape, where: Where):
    num_experts, dim, hidden = shape.num_experts, shape.dim, shape.hidden
    gen = _generator(where, 5)
    for routing in ROUTINGS:
        _, _, plan, what = _routed(shape, routing, where)
        counts_E = plan.tokens_per_expert_E
        num_rows = shape.num_tokens * shape.topk
        x_RD, grad_RD = (_randn(gen, num_rows, dim, dtype=where.dtype) for _ in "xg")
        # BF16 grouped path (torch._grouped_mm and the fused kernel on GPU) against the
        # per-expert loops and the reference activation. Pre-activations of std ~4: about a
        # tenth of gate and up values lie past the limit, exercising the clamps' zero grads.
        params = [
            _randn(gen, num_experts, 2 * hidden, dim, dtype=where.dtype, std=4 * dim**-0.5),
            _randn(gen, num_experts, 2 * hidden, dtype=where.dtype),
            _randn(gen, num_experts, dim, hidden, dtype=where.dtype, std=hidden**-0.5),
            _randn(gen, num_experts, dim, dtype=where.dtype, std=0.1),
        ]
        gate_up_R2F = grouped_linear_reference(x_RD, params[0], counts_E, params[1]).float()
        past = torch.cat([gate_up_R2F[:, 0::2] > LIMIT, gate_up_R2F[:, 1::2].abs() > LIMIT])
        assert float(past.float().mean()) >= 0.02, f"{what}: the clamps are hardly exercised"
        fast = _clamped_experts(grouped_linear, grouped_linear, counts_E, clamped_swiglu_fused)
        reference = _clamped_experts(
            grouped_linear_reference, grouped_linear_reference, counts_E, clamped_swiglu_reference
        )
        got = _outputs_and_grads(fast, [x_RD, *params], grad_RD)
        ref = _outputs_and_grads(reference, [x_RD, *params], grad_RD)
        for name, g, r in zip(CLAMPED_OUTPUTS, got, ref, strict=True):
            _assert_relative(g, r, TOLERANCES[where.dtype], f"{what}: clamped experts {name}")
        if shape.mlp_hidden is not None:
            _check_fp8_clamped_experts(shape, counts_E, x_RD, grad_RD, where, what)


def _check_fp8_clamped_experts(shape, counts_E, x_RD, grad_RD, where, what):
    """GPT-OSS's experts with FP8 linears (biases, the clamped SwiGLU between them)."""
    num_experts, dim, hidden = shape.num_experts, shape.dim, shape.hidden
    gen = _generator(where, 6)
    backend = "triton" if where.compiled else None
    # Pre-activations of std ~1: FP8 moves values by a few percent, and near ±7 that would
    # switch clamps (and their gradients) between the FP8 and the reference runs.
    masters = [
        _randn(gen, num_experts, 2 * hidden, dim, std=dim**-0.5),
        _randn(gen, num_experts, 2 * hidden, std=0.1),
        _randn(gen, num_experts, dim, hidden, std=hidden**-0.5),
        _randn(gen, num_experts, dim, std=0.1),
    ]
    fp8 = [
        _fp8_grouped(masters[0], masters[1], backend),
        _fp8_grouped(masters[2], masters[3], backend),
    ]

    def fp8_experts(x):
        act = clamped_swiglu_fused(fp8[0](x, counts_E), ALPHA, LIMIT)
        return fp8[1](act, counts_E)

    if where.exact_casts:
        got = _outputs_and_grads(fp8_experts, [x_RD], grad_RD, fp8)
        plain = _clamped_experts(grouped_linear, grouped_linear, counts_E, clamped_swiglu_fused)
        ref = _outputs_and_grads(plain, [x_RD, *(m.to(where.dtype) for m in masters)], grad_RD)
        for name, g, r in zip(CLAMPED_OUTPUTS, got, ref, strict=True):
            label = f"{what}: FP8 clamped experts {name} vs {where.dtype}"
            _assert_calc_diff(g, r, FP8_CHAIN, label)
    # One FP8 layer against the same layer in the emulation, on the same input.
    grad_R2F = _randn(gen, x_RD.shape[0], 2 * hidden, dtype=where.dtype)
    runs = []
    for layer_backend in (backend, "emulation"):
        layer = _fp8_grouped(masters[0], masters[1], layer_backend)
        runs.append(
            _outputs_and_grads(lambda x, layer=layer: layer(x, counts_E), [x_RD], grad_R2F, [layer])
        )
    for name, g, r in zip(CLAMPED_OUTPUTS[:4], *runs, strict=True):
        _assert_relative(g, r, BF16_OUTPUT, f"{what}: FP8 gate_up layer {name} vs emulation")


CHECKS = {
    "plan_and_permutation": _check_plan_and_permutation,
    "fp8_quantizers": _check_fp8_quantizers,
    "fp8_grouped_gemms": _check_fp8_grouped_gemms,
    "fp8_expert_mlp": _check_fp8_expert_mlp,
    "clamped_swiglu_experts": _check_clamped_swiglu_experts,
}


# --- GPU tests -------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


GPU_CASES = [
    (check, family)
    for check in CHECKS
    for family in (CLAMPED_FAMILIES if check == "clamped_swiglu_experts" else GPU_SHAPES)
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("check", "family"), GPU_CASES)
def test_checks_hold_on_other_shapes_on_gpu(check, family):
    CHECKS[check](GPU_SHAPES[family], GPU)


# --- the same bodies on CPU (the odd shape) -----------------------------------------------


@pytest.fixture
def kernels_in_interpreter(monkeypatch):
    """Sends the public ops on CPU tensors down their kernel paths, run by Triton's
    interpreter, and the FP8 GEMMs to the Triton kernels (an explicit 'emulation' stays)."""
    modules = "moe_plan moe_permute fp8_quant fp8_swiglu swiglu clamped_swiglu_kernel"
    for name in (*modules.split(), "fp8_expert_mlp"):
        module = importlib.import_module(f"mt_ops.{name}")  # (mt_ops.swiglu is the function)
        monkeypatch.setattr(module, "use_kernels", lambda *tensors: True)
    monkeypatch.setattr(
        gemm_module,
        "fp8_backend",
        lambda device, backend=None: backend if backend == "emulation" else "triton",
    )


@pytest.mark.parametrize("check", CHECKS)
def test_odd_shape_checks_hold_on_cpu(check):
    CHECKS[check](GPU_SHAPES["odd-tiny"], CPU)


def test_odd_shape_planning_and_permutation_kernels_hold_in_interpreter(kernels_in_interpreter):
    _check_plan_and_permutation(GPU_SHAPES["odd-tiny"], INTERPRETER)
