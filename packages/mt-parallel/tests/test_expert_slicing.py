"""A model cut to one EP rank's experts still counts as the whole model."""

import pytest

from mt_models import build_model, deepseek_v2, gpt_oss, qwen3_moe
from mt_models.accounting import FlopsAndParams
from mt_models.layers.experts import MoEBlock
from mt_parallel.expert_parallel import _slice_experts


@pytest.mark.parametrize("family", [qwen3_moe, deepseek_v2, gpt_oss])
@pytest.mark.parametrize("ep", [2, 4])
def test_flops_and_parameter_counts_of_one_ep_rank_equal_the_whole_models(family, ep):
    whole = build_model(family.debug())
    sliced = build_model(family.debug())
    for layer in sliced.model.layers:
        if isinstance(layer.mlp, MoEBlock):
            local = layer.mlp.experts.num_experts // ep
            _slice_experts(layer.mlp.experts, local, local)  # EP rank 1's experts
    expected, got = FlopsAndParams.of(whole, 64), FlopsAndParams.of(sliced, 64)
    assert sum(p.numel() for p in sliced.parameters()) < expected.total_params
    assert (got.total_params, got.active_params) == (expected.total_params, expected.active_params)
    assert got.forward_matmul_flops == pytest.approx(expected.forward_matmul_flops, rel=1e-12)
    assert got.forward_attention_flops == expected.forward_attention_flops


def test_sliced_experts_keep_frozen_parameters_frozen():
    # The slice was a new nn.Parameter, trainable whatever the original was: experts frozen
    # before parallelize (fine-tuning the rest) came back into the optimizer.
    model = build_model(qwen3_moe.debug())
    experts = next(
        layer.mlp.experts for layer in model.model.layers if isinstance(layer.mlp, MoEBlock)
    )
    frozen = dict(experts.named_parameters())
    first = next(iter(frozen))
    frozen[first].requires_grad_(False)
    local = experts.num_experts // 2
    _slice_experts(experts, local, local)
    for name, param in experts.named_parameters():
        assert param.requires_grad == (name != first), name
        assert param.shape[0] == local and param.dtype == frozen[name].dtype, name


def test_a_second_apply_expert_parallel_is_refused_not_sliced_again(monkeypatch):
    # Before: a second call (parallelize run twice on one model) cut each rank's 4 experts
    # to 2 and planned dispatch for 4 experts in all, without a word.
    import torch.distributed as dist

    from mt_parallel.expert_parallel import apply_expert_parallel

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    model = build_model(qwen3_moe.debug())
    apply_expert_parallel(model, group=None)
    counts = [m.mlp.experts.num_experts for m in model.model.layers if isinstance(m.mlp, MoEBlock)]
    with pytest.raises(ValueError, match=r"already has an expert-parallel dispatcher"):
        apply_expert_parallel(model, group=None)
    assert counts == [
        m.mlp.experts.num_experts for m in model.model.layers if isinstance(m.mlp, MoEBlock)
    ]


def test_expert_parallel_dispatch_of_a_dense_layers_routed_is_a_value_error(monkeypatch):
    # An assert before (gone under python -O: plan_dispatch(None, ...) failed inside mt-ops).
    import torch
    import torch.distributed as dist

    from mt_models import Routed
    from mt_parallel.expert_parallel import ExpertParallelDispatcher

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    dispatcher = ExpertParallelDispatcher(8, group=None)
    dense = Routed(torch.zeros(4, 16), torch.zeros(4, 16), (1, 4))
    with pytest.raises(ValueError, match=r"^ExpertParallelDispatcher.dispatch: routed has no "
                       r"top-k \(topk_ids_TK None, topk_weights_TK None\)"):  # fmt: skip
        dispatcher.dispatch(dense)
