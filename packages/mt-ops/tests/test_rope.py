import pytest
import torch

from mt_ops import apply_rope, apply_rope_reference
from mt_ops.rope import _kernel_function_for_test


def _cos_sin(seq_len: int, head_dim: int, theta: float = 10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None]  # [S, hd/2]
    emb = torch.cat((angles, angles), dim=-1)  # [S, hd]
    return emb.cos(), emb.sin(), angles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 16, 4, 32), (1, 37, 3, 78), (2, 0, 4, 32)])
def test_apply_rope_matches_reference_forward_and_backward(
    shape, dtype, assert_close, run_with_grads
):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    cos, sin, _ = _cos_sin(shape[1], shape[3])
    cos, sin = cos.float(), sin.float()
    out, grads = run_with_grads(lambda x: apply_rope(x, cos, sin), [x])
    ref_out, ref_grads = run_with_grads(lambda x: apply_rope_reference(x, cos, sin), [x])
    assert out.dtype == dtype
    assert_close(out, ref_out, dtype, "out")
    assert_close(grads[0], ref_grads[0], dtype, "grad x")


def test_apply_rope_equals_complex_multiplication_of_half_pairs():
    batch, seq_len, heads, head_dim = 2, 19, 3, 16
    x = torch.randn(batch, seq_len, heads, head_dim, dtype=torch.float64)
    cos, sin, angles = _cos_sin(seq_len, head_dim)
    half = head_dim // 2
    z = torch.complex(x[..., :half], x[..., half:])  # pairs (i, i + hd/2)
    rotated = z * torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    expected = torch.cat((rotated.real, rotated.imag), dim=-1)
    got = apply_rope(x.float(), cos.float(), sin.float())
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_float64_rope_is_computed_in_float64_and_passes_gradcheck():
    # fp64 x was rounded through fp32 (~1e-8 off the complex product, failing gradcheck).
    batch, seq_len, heads, head_dim = 1, 5, 2, 8
    x = torch.randn(batch, seq_len, heads, head_dim, dtype=torch.float64, requires_grad=True)
    cos, sin, angles = _cos_sin(seq_len, head_dim)
    half = head_dim // 2
    z = torch.complex(x.detach()[..., :half], x.detach()[..., half:])
    rotated = z * torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    expected = torch.cat((rotated.real, rotated.imag), dim=-1)
    for fn in (apply_rope, apply_rope_reference):
        torch.testing.assert_close(fn(x, cos, sin).detach(), expected, rtol=1e-12, atol=1e-12)
        assert torch.autograd.gradcheck(fn, (x, cos, sin))


def test_float64_rope_where_kernels_run_is_the_float64_reference(monkeypatch):
    # Where kernels run (CUDA; here the interpreter stands in), fp64 x went to the kernel,
    # which rotates in fp32: ~1e-8 off the fp64 reference that the CPU path runs.
    import mt_ops.rope as rope_module

    monkeypatch.setattr(rope_module, "use_kernels", lambda *tensors: True)
    x = torch.randn(1, 5, 2, 8, dtype=torch.float64, requires_grad=True)
    cos, sin, _ = _cos_sin(5, 8)
    assert torch.equal(apply_rope(x, cos, sin), apply_rope_reference(x, cos, sin))
    assert torch.autograd.gradcheck(apply_rope, (x, cos, sin))
    out = apply_rope(x.detach().float().requires_grad_(), cos.float(), sin.float())
    assert "RopeFn" in type(out.grad_fn).__name__  # fp32 still takes the kernel


def test_apply_rope_accepts_batched_cos_sin_and_preserves_norm():
    x = torch.randn(2, 11, 4, 8)
    cos, sin, _ = _cos_sin(11, 8)
    batched = apply_rope(x, cos.float().expand(2, 11, 8), sin.float().expand(2, 11, 8))
    torch.testing.assert_close(batched, apply_rope(x, cos.float(), sin.float()))
    torch.testing.assert_close(batched.norm(dim=-1), x.norm(dim=-1))


def test_apply_rope_rejects_cos_of_wrong_length():
    cos, sin, _ = _cos_sin(10, 8)
    with pytest.raises(ValueError, match="cos shape"):
        apply_rope(torch.randn(1, 11, 2, 8), cos.float(), sin.float())


def test_apply_rope_rejects_batched_tables_of_another_batch():
    cos, sin, _ = _cos_sin(11, 8)
    with pytest.raises(ValueError, match="3 rows of positions but x has batch 2"):
        apply_rope(
            torch.randn(2, 11, 2, 8), cos.float().expand(3, 11, 8), sin.float().expand(3, 11, 8)
        )


@pytest.mark.parametrize("tables", ["shared", "batched"])
def test_rope_kernel_matches_reference_in_interpreter(tables, assert_close, run_with_grads):
    # 20 heads: two head blocks, the second ragged; head_dim 78: half 39 of a 64-wide block.
    # x is a strided view (a split of a wider projection), as DeepSeek's q_rope is.
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(2, 9, 20, 100, generator=gen)
    x = wide[..., 11:89]
    cos, sin, _ = _cos_sin(9, 78)
    cos, sin = cos.float(), sin.float()
    if tables == "batched":  # per-sequence positions (packed documents, context parallelism)
        shift = torch.tensor([0.0, 0.3])[:, None, None]
        cos, sin = (cos[None] + shift).cos(), (sin[None] + shift).sin()
    rope_kernel = _kernel_function_for_test()
    out, grads = run_with_grads(lambda x: rope_kernel(x, cos, sin), [x])
    ref_out, ref_grads = run_with_grads(lambda x: apply_rope_reference(x, cos, sin), [x])
    assert out.shape == x.shape and out.is_contiguous()
    assert_close(out, ref_out, torch.float32, "out")
    assert_close(grads[0], ref_grads[0], torch.float32, "grad x")
    # The backward takes a non-contiguous gradient too (attention's transposed one).
    grad_BHSD = torch.randn(2, 20, 9, 78, generator=gen)
    x_leaf = x.detach().clone().requires_grad_(True)
    rope_kernel(x_leaf, cos, sin).backward(grad_BHSD.transpose(1, 2))
    x_ref = x.detach().clone().requires_grad_(True)
    apply_rope_reference(x_ref, cos, sin).backward(grad_BHSD.transpose(1, 2))
    assert_close(x_leaf.grad, x_ref.grad, torch.float32, "grad x, strided")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# (2, 512, 1, 64): MLA's k_rope, one head shared by all (a one-head block on GPU).
@pytest.mark.parametrize(
    "shape", [(4, 4096, 32, 128), (2, 512, 16, 64), (2, 512, 1, 64), (1, 37, 3, 78)]
)
def test_rope_kernel_on_gpu_matches_reference(shape, run_with_grads):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=gen).bfloat16().cuda()
    cos, sin, _ = _cos_sin(shape[1], shape[3])
    cos, sin = cos.float().cuda(), sin.float().cuda()
    out, grads = run_with_grads(lambda x: apply_rope(x, cos, sin), [x])
    ref_out, ref_grads = run_with_grads(lambda x: apply_rope_reference(x, cos, sin), [x])
    # Both compute in fp32 and round once to bf16; fused multiply-adds may move a rounding.
    for got, want in ((out, ref_out), (grads[0], ref_grads[0])):
        assert got.dtype == torch.bfloat16
        differ = (got != want).float().mean().item()
        assert differ < 1e-3, differ
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-6)


def _last_rows_match_reference(shape, device):
    """The op's output and input gradient at the last (batch, position) rows against the
    reference run on those rows alone (RoPE acts on each row by itself)."""
    gen = torch.Generator(device=device).manual_seed(6)
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    x.requires_grad_(True)
    cos, sin, _ = _cos_sin(shape[1], shape[3])
    cos, sin = cos.float().to(device), sin.float().to(device)
    out = apply_rope(x, cos, sin)
    grad = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    (dx,) = torch.autograd.grad(out, x, grad)
    last = (slice(-1, None), slice(-2, None))  # batch B-1, positions S-2 and S-1
    x_last = x.detach()[last].requires_grad_(True)
    ref = apply_rope_reference(x_last, cos[-2:], sin[-2:])
    (ref_dx,) = torch.autograd.grad(ref, x_last, grad[last])
    for got, want in ((out[last], ref), (dx[last], ref_dx)):
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rope_kernel_on_gpu_addresses_rows_past_2_to_the_31_elements():
    # 4 · 131073 · 32 · 128 = 2**31 + 16384 elements (4 GiB of bf16): the last rows' offsets
    # overflow int32, so they are right only if every offset is int64.
    _last_rows_match_reference((4, 131073, 32, 128), "cuda")
