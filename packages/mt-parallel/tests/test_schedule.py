"""The plain micro-batch schedule accumulates the gradient of the global-batch mean loss."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from mt_parallel import MicroBatch, run_microbatches


@dataclass
class _Out:
    ce_sum: torch.Tensor
    num_tokens: torch.Tensor
    aux_loss: torch.Tensor


class _TinyLM(nn.Module):
    """Embedding + linear head with the `loss` interface of mt-models."""

    def __init__(self, vocab: int = 11, dim: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def loss(self, input_ids, labels, ignore_index=-100):
        logits = self.head(self.embed(input_ids)).flatten(0, 1)
        ce = nn.functional.cross_entropy(
            logits, labels.flatten(), ignore_index=ignore_index, reduction="sum"
        )
        aux = self.embed.weight.square().mean()  # any differentiable per-batch term
        return _Out(ce, (labels != ignore_index).sum(), aux)


def test_microbatch_gradients_equal_one_full_batch_with_ignored_labels():
    torch.manual_seed(0)
    model = _TinyLM()
    ids = torch.randint(0, 11, (6, 7))
    labels = torch.randint(0, 11, (6, 7))
    labels[0, :5] = -100  # micro-batches hold different numbers of valid tokens
    labels[3, 2] = -100
    total = int((labels != -100).sum())

    run_microbatches(model, [MicroBatch(ids, labels)], total)
    full = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    mbs = [MicroBatch(ids[i : i + 2], labels[i : i + 2]) for i in range(0, 6, 2)]
    result = run_microbatches(model, mbs, total)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, full[name], rtol=1e-6, atol=1e-7)
    assert int(result.num_tokens) == total
    expected_mean = nn.functional.cross_entropy(
        model.head(model.embed(ids)).flatten(0, 1), labels.flatten(), ignore_index=-100
    )
    torch.testing.assert_close(result.ce_sum.float() / total, expected_mean.detach())


def test_step_result_holds_fp64_loss_sums_and_an_int64_token_count_on_the_cpu():
    # StepResult's docstring said fp32; the sums are accumulated in fp64.
    ids = torch.randint(0, 11, (2, 7), generator=torch.Generator().manual_seed(0))
    for mbs in ([MicroBatch(ids, ids)], []):
        result = run_microbatches(_TinyLM(), mbs, 14)
        assert (result.ce_sum.dtype, result.aux_loss.dtype) == (torch.float64, torch.float64)
        assert result.num_tokens.dtype == torch.int64
        assert {t.device.type for t in (result.ce_sum, result.num_tokens, result.aux_loss)} == {
            "cpu"
        }


def test_zero_global_tokens_is_rejected():
    import pytest

    # The message named the value only, not what it counts or what 0 means.
    with pytest.raises(ValueError, match="global_num_tokens") as err:
        run_microbatches(_TinyLM(), [], 0, ignore_index=-1)
    assert "not ignore_index (-1)" in str(err.value), err.value
    assert "every label of the step is ignored" in str(err.value), err.value


class _SyncRecordingLM(_TinyLM, FSDPModule):
    """A _TinyLM that passes for an FSDP2 root and records its gradient-sync flag."""

    def __new__(cls, *args, **kwargs):  # FSDPModule.__new__ builds the unwrapped class
        return object.__new__(cls)

    def __init__(self):
        super().__init__()
        self.syncs = True
        self.calls = []  # every flag set, in order

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        self.syncs = requires_gradient_sync
        self.calls.append(requires_gradient_sync)


def test_a_micro_batch_that_raises_under_step_reduction_leaves_gradient_sync_on():
    # grad_reduce="step" switched the sync off for all but the last micro-batch; an error
    # in between left it off, so the next step (any grad_reduce) never reduced gradients.
    import pytest

    model = _SyncRecordingLM()
    ids = torch.randint(0, 11, (2, 7), generator=torch.Generator().manual_seed(0))
    bad = MicroBatch(ids, ids[:, :3])  # labels of another length: cross_entropy raises
    with pytest.raises(ValueError, match="batch_size"):  # cross_entropy's, not another
        run_microbatches(model, [MicroBatch(ids, ids), bad, MicroBatch(ids, ids)], 42,
                         grad_reduce="step")  # fmt: skip
    # The failure came with the sync off (else this test checks nothing), then it was reset.
    assert model.calls == [False, False, True], model.calls
    assert model.syncs, "gradient sync left off after a failed step"
    model.calls.clear()
    run_microbatches(model, [MicroBatch(ids, ids), MicroBatch(ids, ids)], 28, grad_reduce="step")
    assert model.calls == [False, True, True], model.calls  # only the last one reduces


def test_loss_sums_keep_only_detached_terms_and_reduce_them():
    from types import SimpleNamespace

    from mt_parallel.schedule import LossSums

    sums = LossSums()
    assert len(sums) == 0 and float(sums.result().ce_sum) == 0.0
    weights = torch.ones(2, requires_grad=True)
    for scale in (1.0, 3.0):
        term = (weights * scale).sum()  # part of a graph, as a micro-batch's loss is
        sums.add(SimpleNamespace(ce_sum=term, num_tokens=torch.tensor(5), aux_loss=term / 10,
                                 losses={"router_z_loss": term / 100}))  # fmt: skip
    kept = [*sums._ce_sums, *sums._aux_losses, *sums._terms["router_z_loss"]]
    assert len(sums) == 2 and not any(t.requires_grad for t in kept)
    result = sums.result()
    assert float(result.ce_sum) == 8.0 and int(result.num_tokens) == 10
    # The terms were fp32 (0.4 and 0.04 are not exact there): means within fp32 rounding.
    assert abs(float(result.aux_loss) - 0.4) < 1e-7
    assert abs(result.losses["router_z_loss"] - 0.04) < 1e-8 and list(result.losses) == [
        "router_z_loss"
    ]
