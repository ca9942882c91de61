"""Chunked linear cross-entropy. Legend: T tokens, D model dim, V vocabulary."""

import pytest
import torch

import mt_ops.cross_entropy as ce_module
from mt_ops import linear_cross_entropy, linear_cross_entropy_reference

IGNORE = -100


def _inputs(num_tokens, dim, vocab, dtype, ignore_every=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden_TD = torch.randn(num_tokens, dim, generator=gen).to(dtype)
    weight_VD = (torch.randn(vocab, dim, generator=gen) / dim**0.5).to(dtype)
    labels_T = torch.randint(0, vocab, (num_tokens,), generator=gen)
    labels_T[::ignore_every] = IGNORE
    return hidden_TD, weight_VD, labels_T


@pytest.fixture(params=["eager", "kernel"])
def small_chunks(request, monkeypatch):
    """Forces 10-token chunks for V = 131 so the last chunk is ragged; runs each test on
    the eager row pass and on the Triton row kernel (interpreted on CPU, walking each row
    in blocks of 32 logits so the last block is ragged too)."""
    monkeypatch.setattr(ce_module, "_CHUNK_LOGITS_ELEMENTS", 131 * 10)
    if request.param == "kernel":
        monkeypatch.setattr(ce_module, "use_kernels", lambda *tensors: True)
        monkeypatch.setattr(ce_module, "_ROW_BLOCK", 32)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [0, 1, 103])
def test_chunked_linear_cross_entropy_matches_reference_in_value_and_gradients(
    num_tokens, dtype, small_chunks, assert_close, run_with_grads
):
    hidden_TD, weight_VD, labels_T = _inputs(num_tokens, 77, 131, dtype)
    fn = lambda h, w: linear_cross_entropy(h, w, labels_T)
    ref_fn = lambda h, w: linear_cross_entropy_reference(h, w, labels_T)
    loss, grads = run_with_grads(fn, [hidden_TD, weight_VD])
    ref_loss, ref_grads = run_with_grads(ref_fn, [hidden_TD, weight_VD])
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert_close(loss, ref_loss, dtype, "loss")
    for name, g, rg in zip(["hidden", "weight"], grads, ref_grads, strict=True):
        assert g.dtype == dtype
        assert_close(g, rg, dtype, f"grad {name}")


def test_labels_of_a_strided_view_give_the_loss_and_gradients_of_their_copy(
    small_chunks, assert_close, run_with_grads
):
    # A column of a [T, 2] tensor (stride 2): the row kernel must not read labels as if
    # they were contiguous.
    hidden_TD, weight_VD, labels_T = _inputs(23, 16, 131, torch.float32)
    strided_T = torch.stack([labels_T, (labels_T + 7) % 131], dim=1)[:, 0]
    assert strided_T.stride() == (2,) and torch.equal(strided_T, labels_T)
    loss, grads = run_with_grads(
        lambda h, w: linear_cross_entropy(h, w, strided_T), [hidden_TD, weight_VD]
    )
    ref_loss, ref_grads = run_with_grads(
        lambda h, w: linear_cross_entropy_reference(h, w, labels_T), [hidden_TD, weight_VD]
    )
    assert_close(loss, ref_loss, torch.float32, "loss")
    for name, g, rg in zip(["hidden", "weight"], grads, ref_grads, strict=True):
        assert_close(g, rg, torch.float32, f"grad {name}")


def test_count_and_loss_exclude_ignored_labels(small_chunks):
    hidden_TD, weight_VD, labels_T = _inputs(47, 16, 131, torch.float64, ignore_every=3)
    loss, count = linear_cross_entropy(hidden_TD, weight_VD, labels_T)
    valid = labels_T != IGNORE
    assert count.dtype == torch.int64 and int(count) == int(valid.sum()) == 47 - 16
    log_probs = torch.log_softmax(hidden_TD @ weight_VD.T, dim=-1)
    expected = -log_probs[valid].gather(1, labels_T[valid, None]).sum()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)


def test_all_ignored_labels_give_zero_loss_count_and_gradient(small_chunks):
    hidden_TD, weight_VD, labels_T = _inputs(12, 16, 131, torch.float32)
    labels_T[:] = IGNORE
    hidden_TD.requires_grad_(True)
    loss, count = linear_cross_entropy(hidden_TD, weight_VD, labels_T)
    loss.backward()
    assert float(loss.detach()) == 0.0 and int(count) == 0
    assert torch.all(hidden_TD.grad == 0)


def test_no_grad_call_returns_the_same_loss(small_chunks):
    hidden_TD, weight_VD, labels_T = _inputs(33, 16, 131, torch.float32)
    with torch.no_grad():
        loss, _ = linear_cross_entropy(hidden_TD, weight_VD, labels_T)
    ref, _ = linear_cross_entropy_reference(hidden_TD, weight_VD, labels_T)
    torch.testing.assert_close(loss, ref)


def test_no_grad_call_on_parameters_computes_no_gradients(small_chunks):
    # Evaluation runs the loss under no_grad on parameters that require grad: only the
    # logits matmul per chunk may run (no softmax-gradient matmuls, no fp32 [V, D] buffer).
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountMatmuls.calls += func is torch.ops.aten.mm.default
            return func(*args, **(kwargs or {}))

    hidden_TD, weight_VD, labels_T = _inputs(33, 16, 131, torch.float32)
    hidden_TD.requires_grad_(True)
    weight_VD.requires_grad_(True)
    with torch.no_grad(), CountMatmuls():
        loss, _ = linear_cross_entropy(hidden_TD, weight_VD, labels_T)
    assert CountMatmuls.calls == 4  # 33 tokens in 10-token chunks: one matmul per chunk
    ref, _ = linear_cross_entropy_reference(hidden_TD.detach(), weight_VD.detach(), labels_T)
    torch.testing.assert_close(loss, ref)


def test_linear_cross_entropy_rejects_labels_of_wrong_length():
    with pytest.raises(ValueError, match="labels shape"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(5, dtype=int))
    with pytest.raises(ValueError, match="labels are on meta but hidden is on cpu"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, device="meta"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_z_loss_matches_reference_in_value_and_gradients(
    dtype, small_chunks, assert_close, run_with_grads
):
    hidden_TD, weight_VD, labels_T = _inputs(53, 32, 131, dtype)
    fn = lambda h, w: linear_cross_entropy(h, w, labels_T, z_loss_weight=1e-2)
    ref_fn = lambda h, w: linear_cross_entropy_reference(h, w, labels_T, z_loss_weight=1e-2)
    loss, grads = run_with_grads(fn, [hidden_TD, weight_VD])
    ref_loss, ref_grads = run_with_grads(ref_fn, [hidden_TD, weight_VD])
    assert_close(loss, ref_loss, dtype, "loss")
    for name, g, rg in zip(["hidden", "weight"], grads, ref_grads, strict=True):
        assert_close(g, rg, dtype, f"grad {name}")


def test_z_loss_adds_weighted_squared_logsumexp_of_valid_tokens(small_chunks):
    hidden_TD, weight_VD, labels_T = _inputs(29, 16, 131, torch.float64, ignore_every=4)
    plain, _ = linear_cross_entropy(hidden_TD, weight_VD, labels_T)
    with_z, _ = linear_cross_entropy(hidden_TD, weight_VD, labels_T, z_loss_weight=0.5)
    lse_T = torch.logsumexp(hidden_TD @ weight_VD.T, dim=-1)
    expected = 0.5 * lse_T[labels_T != IGNORE].square().sum()
    torch.testing.assert_close((with_z - plain).double(), expected, rtol=1e-5, atol=1e-5)


def test_linear_cross_entropy_traces_shapes_on_the_meta_device():
    # The meta device has no autocast: asking whether autocast is on there must not raise.
    hidden_TD = torch.empty(7, 16, device="meta", requires_grad=True)
    weight_VD = torch.empty(131, 16, device="meta", requires_grad=True)
    labels_T = torch.empty(7, dtype=torch.int64, device="meta")
    loss, count = linear_cross_entropy(hidden_TD, weight_VD, labels_T)
    loss.backward()
    assert loss.shape == () and loss.device.type == "meta" and count.dtype == torch.int64
    assert hidden_TD.grad.shape == (7, 16) and weight_VD.grad.shape == (131, 16)


@pytest.mark.parametrize("fn", [linear_cross_entropy, linear_cross_entropy_reference])
def test_hidden_of_another_dtype_than_weight_is_rejected_outside_autocast(fn):
    hidden_TD, weight_VD, labels_T = _inputs(6, 16, 131, torch.float32)
    with pytest.raises(
        ValueError,
        match=r"hidden dtype \(torch.bfloat16\) must equal weight dtype \(torch.float32\) "
        r"outside autocast; pass hidden.to\(weight.dtype\), or call under torch.autocast",
    ):
        fn(hidden_TD.bfloat16(), weight_VD, labels_T)
    with pytest.raises(ValueError, match=r"hidden dtype \(torch.float32\) .* \(torch.bfloat16\)"):
        fn(hidden_TD, weight_VD.bfloat16(), labels_T)


def test_bf16_hidden_with_fp32_weight_under_autocast_matches_reference(
    small_chunks, assert_close, run_with_grads
):
    # One-GPU training: bf16 activations, the fp32 lm head, the step under autocast.
    hidden_TD, weight_VD, labels_T = _inputs(33, 16, 131, torch.float32)
    hidden_TD = hidden_TD.bfloat16()

    def run(fn):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return run_with_grads(lambda h, w: fn(h, w, labels_T), [hidden_TD, weight_VD])

    loss, (g_h, g_w) = run(linear_cross_entropy)
    ref_loss, (ref_g_h, ref_g_w) = run(linear_cross_entropy_reference)
    assert loss.dtype == torch.float32
    assert g_h.dtype == torch.bfloat16 and g_w.dtype == torch.float32
    assert_close(loss, ref_loss, torch.bfloat16, "loss")
    assert_close(g_h.float(), ref_g_h.float(), torch.bfloat16, "grad hidden")
    assert_close(g_w, ref_g_w, torch.bfloat16, "grad weight")


def test_row_kernel_is_stable_for_large_logits_and_flags_labels_out_of_range(monkeypatch):
    # Logits of ±3e4 overflow exp() without the running max; a label >= V must not read
    # another row's logits silently (the op's gather would raise on CPU, the kernel cannot).
    monkeypatch.setattr(ce_module, "_ROW_BLOCK", 32)
    gen = torch.Generator().manual_seed(3)
    logits_CV = torch.randn(6, 131, generator=gen) * 3e4
    labels_C = torch.randint(0, 131, (6,), generator=gen)
    labels_C[1] = IGNORE
    for z in (0.0, 1e-3):
        expected = ce_module._xent_rows_eager(logits_CV.clone(), labels_C, IGNORE, z, False)
        got_grad = logits_CV.clone()
        got = ce_module._xent_rows_kernels(got_grad, labels_C, IGNORE, z, True)
        eager_grad = logits_CV.clone()
        ce_module._xent_rows_eager(eager_grad, labels_C, IGNORE, z, True)
        assert torch.isfinite(got).all() and got[1] == 0
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-2)
        torch.testing.assert_close(got_grad, eager_grad, rtol=1e-5, atol=1e-6)
    labels_C[2] = 131
    got = ce_module._xent_rows_kernels(logits_CV.clone(), labels_C, IGNORE, 0.0, False)
    assert torch.isnan(got[2]) and torch.isfinite(got[[0, 3, 4, 5]]).all()


@pytest.mark.parametrize("fn", [linear_cross_entropy, linear_cross_entropy_reference])
@pytest.mark.parametrize("bad", [16, -5])
def test_a_label_outside_the_vocabulary_is_named_with_its_position(fn, bad):
    # Before: "index 16 is out of bounds for dimension 1 with size 16" (a RuntimeError of
    # the gather) and "Target 16 is out of bounds" (the reference), naming neither labels
    # nor ignore_index.
    labels = torch.tensor([0, 1, bad, IGNORE])
    with pytest.raises(
        ValueError, match=rf"labels\[2\] is {bad}, outside \[0, V=16\) and not ignore_index"
    ):
        fn(torch.randn(4, 8), torch.randn(16, 8), labels, ignore_index=IGNORE)


@pytest.mark.parametrize("fn", [linear_cross_entropy, linear_cross_entropy_reference])
@pytest.mark.parametrize("z", [-1e-4, float("nan")])
def test_a_negative_or_nan_z_loss_weight_is_refused_by_name(fn, z):
    # Before: a negative weight rewarded large logits (no error), NaN made the loss NaN.
    with pytest.raises(ValueError, match=rf"z_loss_weight \({z}\) must be >= 0"):
        fn(torch.randn(4, 8), torch.randn(16, 8), torch.tensor([0, 1, 2, 3]), z_loss_weight=z)


@pytest.mark.parametrize("vocab", [20, 32, 64])
def test_row_kernel_matches_the_eager_rows_below_at_and_at_twice_the_block(vocab, monkeypatch):
    # The GPU block is 4096 logits, so a small model's whole vocabulary is one ragged block.
    monkeypatch.setattr(ce_module, "_ROW_BLOCK", 32)
    gen = torch.Generator().manual_seed(4)
    logits_CV = torch.randn(5, vocab, generator=gen) * 4
    labels_C = torch.randint(0, vocab, (5,), generator=gen)
    labels_C[3] = IGNORE
    for z in (0.0, 1e-2):
        eager_grad, kernel_grad = logits_CV.clone(), logits_CV.clone()
        expected = ce_module._xent_rows_eager(eager_grad, labels_C, IGNORE, z, True)
        got = ce_module._xent_rows_kernels(kernel_grad, labels_C, IGNORE, z, True)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(kernel_grad, eager_grad, rtol=1e-5, atol=1e-7)
        assert got[3] == 0 and (kernel_grad[3] == 0).all()
        if not z:  # softmax - onehot: every row sums to zero (the ignored one is zero)
            torch.testing.assert_close(kernel_grad.sum(-1), torch.zeros(5), rtol=0, atol=1e-5)


@pytest.mark.parametrize("grad_of", ["hidden", "weight"])
def test_only_the_input_that_requires_grad_gets_a_gradient(grad_of, small_chunks, assert_close):
    hidden_TD, weight_VD, labels_T = _inputs(23, 16, 131, torch.float32)
    results = []
    for fn in (linear_cross_entropy, linear_cross_entropy_reference):
        h = hidden_TD.clone().requires_grad_(grad_of == "hidden")
        w = weight_VD.clone().requires_grad_(grad_of == "weight")
        loss, _ = fn(h, w, labels_T)
        loss.backward()
        results.append((h.grad, w.grad))
    (g_h, g_w), (ref_g_h, ref_g_w) = results
    got, ref, none = (g_h, ref_g_h, g_w) if grad_of == "hidden" else (g_w, ref_g_w, g_h)
    assert none is None
    assert_close(got, ref, torch.float32, f"grad {grad_of}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("z_loss_weight", [0.0, 1e-4])
def test_gpu_kernel_at_qwen3_vocabulary_matches_reference(z_loss_weight, assert_close):
    # Real vocabulary (several chunks, 38 row blocks), bf16 activations and an fp32 head
    # under autocast as in one-GPU training, and the bf16 head of FSDP2 training.
    gen = torch.Generator(device="cuda").manual_seed(0)
    vocab, dim, num_tokens = 151_936, 256, 4000
    hidden = torch.randn(num_tokens, dim, device="cuda", generator=gen).bfloat16()
    weight = torch.randn(vocab, dim, device="cuda", generator=gen) * dim**-0.5
    labels = torch.randint(0, vocab, (num_tokens,), device="cuda", generator=gen)
    labels[::9] = IGNORE
    for head, autocast in ((weight, True), (weight.bfloat16(), False)):
        results = []
        for fn in (linear_cross_entropy, linear_cross_entropy_reference):
            h = hidden.clone().requires_grad_(True)
            w = head.clone().requires_grad_(True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss, count = fn(h, w, labels, z_loss_weight=z_loss_weight)
            (loss / count).backward()
            results.append((loss.detach(), h.grad, w.grad))
        (loss, g_h, g_w), (ref_loss, ref_g_h, ref_g_w) = results
        assert g_w.dtype == head.dtype
        assert_close(loss, ref_loss, torch.float32, "loss")
        assert_close(g_h.float(), ref_g_h.float(), torch.bfloat16, "grad hidden")
        assert_close(g_w.float(), ref_g_w.float(), torch.bfloat16, "grad weight")


def test_int32_labels_give_the_int64_result_in_op_and_reference(small_chunks):
    hidden_TD, weight_VD, labels_T = _inputs(23, 16, 131, torch.float32)
    for fn in (linear_cross_entropy, linear_cross_entropy_reference):
        got, count = fn(hidden_TD, weight_VD, labels_T.int())
        want, want_count = fn(hidden_TD, weight_VD, labels_T)
        assert torch.equal(got, want) and int(count) == int(want_count)


def test_narrow_integer_labels_give_the_int64_result_and_other_dtypes_are_refused(small_chunks):
    # int16 / uint8 labels crashed the op in gather ("Expected dtype int32/int64 for
    # index"); float labels were truncated by the reference, bool ones taken as ids 0 / 1.
    hidden_TD, weight_VD, labels_T = _inputs(23, 16, 131, torch.float32)
    kept_T = labels_T.clamp(min=0)  # uint8 holds no -100
    for fn in (linear_cross_entropy, linear_cross_entropy_reference):
        want, want_count = fn(hidden_TD, weight_VD, kept_T)
        for dtype in (torch.int16, torch.uint8):
            got, count = fn(hidden_TD, weight_VD, kept_T.to(dtype))
            assert torch.equal(got, want) and int(count) == int(want_count), (fn, dtype)
        for bad in (labels_T.float(), labels_T > 0):
            with pytest.raises(ValueError, match=rf"labels dtype \({bad.dtype}\) must be an int"):
                fn(hidden_TD, weight_VD, bad)
