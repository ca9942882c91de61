"""model.loss: summed CE via the chunked op, token count, load-balancing loss; training."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mt_models import LossOutput, RouterStats
from mt_models.layers import load_balancing_loss, router_z_loss, sequence_load_balancing_loss


def _batch(seed=0, vocab=4096):
    gen = torch.Generator().manual_seed(seed)
    input_ids_BS = torch.randint(0, vocab, (2, 24), generator=gen)
    labels_BS = torch.roll(input_ids_BS, -1, dims=1)
    labels_BS[:, -1] = -100
    labels_BS[0, :5] = -100
    return input_ids_BS, labels_BS


def test_loss_matches_cross_entropy_sum_of_logits_and_ignores_minus_100(build_debug_model):
    model = build_debug_model()
    input_ids_BS, labels_BS = _batch()
    out = model.loss(input_ids_BS, labels_BS)
    assert isinstance(out, LossOutput)
    logits_BSV = model(input_ids_BS)
    assert logits_BSV.shape == (2, 24, 4096)
    expected = F.cross_entropy(
        logits_BSV.reshape(-1, 4096).float(), labels_BS.reshape(-1), reduction="sum"
    )
    torch.testing.assert_close(out.ce_sum, expected, rtol=1e-5, atol=1e-4)
    assert out.ce_sum.dtype == torch.float32
    assert out.num_tokens.dtype == torch.int64 and int(out.num_tokens) == 2 * 23 - 5


def test_aux_loss_is_nonnegative_and_its_gradient_reaches_the_router(build_debug_model):
    model = build_debug_model()
    out = model.loss(*_batch(1))
    assert out.aux_loss.dtype == torch.float32 and float(out.aux_loss.detach()) >= 0
    assert len(out.router_stats) == 4
    out.aux_loss.backward()
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad.abs().sum() > 0
    # The last layer's experts feed no later router, so the aux loss cannot reach them.
    assert model.model.layers[-1].mlp.experts.gate_proj.weight.grad is None


def test_load_balancing_loss_equals_hugging_face_formula(build_debug_model):
    model = build_debug_model()
    layer = model.model.layers[0]
    routed = layer.attend(model.model.embed_tokens(_batch(2)[0]))
    probs_TE = torch.softmax(F.linear(routed.hidden_TD, layer.mlp.gate.weight), dim=-1)
    mask_TKE = F.one_hot(routed.topk_ids_TK, 8).float()
    # transformers' load_balancing_loss_func for one layer: E · Σ mean(mask) · mean(probs).
    expected = 8 * (mask_TKE.mean(0) * probs_TE.mean(0)[None]).sum()
    torch.testing.assert_close(load_balancing_loss(routed.router_stats), expected)
    assert int(routed.router_stats.tokens_per_expert_E.sum()) == 48 * 2


def test_router_stats_of_two_halves_sum_to_the_stats_of_the_whole(build_debug_model):
    """What a cross-rank all-reduce of the statistics relies on (one sequence split in two,
    as context parallelism splits it: every field, per-sequence ones included, adds up)."""
    router = build_debug_model().model.layers[0].mlp.gate
    hidden_TD = torch.randn(40, 128)
    whole = router(hidden_TD).stats
    first, second = router(hidden_TD[:17]).stats, router(hidden_TD[17:]).stats
    summed = RouterStats(
        **{
            f.name: getattr(first, f.name) + getattr(second, f.name)
            for f in dataclasses.fields(RouterStats)
        }
    )
    torch.testing.assert_close(load_balancing_loss(summed), load_balancing_loss(whole))
    torch.testing.assert_close(
        sequence_load_balancing_loss(summed), sequence_load_balancing_loss(whole)
    )
    torch.testing.assert_close(router_z_loss(summed), router_z_loss(whole))


def test_a_few_adamw_steps_lower_the_loss_on_a_fixed_batch(build_debug_model):
    torch.manual_seed(0)
    model = build_debug_model()
    input_ids_BS, labels_BS = _batch(3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        out = model.loss(input_ids_BS, labels_BS)
        loss = out.ce_sum / out.num_tokens + out.aux_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_layers_balancing_losses_combine_as_each_family_hub_code_does(build_debug_model):
    """Qwen3 pools every layer's statistics (transformers' load_balancing_loss_func over
    the concatenated router logits); DeepSeek-V2 sums per-layer losses normalized by K."""
    for family, mode in (("qwen3_moe", "pooled"), ("deepseek_v2", "per_layer")):
        model = build_debug_model(family=family, aux_loss_type="global")
        assert model.config.load_balancing == mode
        out = model.loss(*_batch(2))
        stats = out.router_stats
        assert len(stats) >= 2
        num_experts = stats[0].tokens_per_expert_E.numel()
        topk = model.config.num_experts_per_tok
        count_LE = torch.stack([s.tokens_per_expert_E for s in stats])
        prob_LE = torch.stack([s.prob_sum_E for s in stats]).detach()
        tokens_L = torch.stack([s.num_tokens for s in stats]).float()
        if mode == "pooled":
            total = tokens_L.sum()
            expected = num_experts * ((count_LE.sum(0) / total) * (prob_LE.sum(0) / total)).sum()
        else:  # DeepSeek MoEGate: f_i = count_i · E / (K · T), P_i = mean prob; Σ f·P per layer
            f_LE = count_LE * num_experts / (topk * tokens_L[:, None])
            expected = (f_LE * prob_LE / tokens_L[:, None]).sum()
        torch.testing.assert_close(out.losses["load_balancing_loss"], expected)


@pytest.mark.parametrize(
    ("field", "change", "message"),
    [
        ("input_ids", lambda t: t[0], r"input_ids \(torch.int64 \(24,\)\) must be"),
        ("input_ids", lambda t: t.float(), r"input_ids \(torch.float32 \(2, 24\)\) must be"),
        ("labels", lambda t: t.float(), r"labels dtype \(torch.float32\)"),
        ("labels", lambda t: t[:, 1:], r"labels shape \(\(2, 23\)\)"),
        ("position_ids", lambda t: t[:, :20], r"position_ids \(torch.int64 \(2, 20\)\)"),
        ("position_ids", lambda t: t[:1].expand(3, -1), r"position_ids \(torch.int64 \(3, 24\)\)"),
        ("position_ids", lambda t: t.float(), r"position_ids \(torch.float32 \(2, 24\)\)"),
    ],
)
def test_inputs_of_a_wrong_shape_or_dtype_fail_naming_them(
    build_debug_model, field, change, message
):
    model = build_debug_model()
    input_ids_BS, labels_BS = _batch()
    inputs = {
        "input_ids": input_ids_BS,
        "labels": labels_BS,
        "position_ids": torch.arange(24).expand(2, -1),
    }
    inputs[field] = change(inputs[field])
    with pytest.raises(ValueError, match=message):
        model(inputs["input_ids"], inputs["labels"], position_ids=inputs["position_ids"])


def test_position_ids_of_one_row_broadcast_over_the_batch(build_debug_model):
    model = build_debug_model()
    input_ids_BS, _ = _batch()
    logits_BSV = model(input_ids_BS, position_ids=torch.arange(24)[None])
    torch.testing.assert_close(logits_BSV, model(input_ids_BS), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "gpt_oss"])
def test_an_empty_batch_gives_empty_logits_and_zero_losses(build_debug_model, family):
    # Views with an inferred (-1) dim failed on zero tokens ("cannot reshape tensor of 0
    # elements ... ambiguous"), and the sequence-wise balancing loss of no sequence was NaN.
    model = build_debug_model(family=family)
    for shape in ((2, 0), (0, 5)):
        ids = torch.zeros(shape, dtype=torch.int64)
        assert model(ids).shape == (*shape, model.config.vocab_size)
        for aux_loss_type in ("global", "sequence"):
            model.config.aux_loss_type = aux_loss_type
            out = model.loss(ids, ids)
            assert int(out.num_tokens) == 0 and float(out.ce_sum.detach()) == 0.0
            assert float(out.aux_loss.detach()) == 0.0, (shape, aux_loss_type)
            (out.ce_sum + out.aux_loss).backward()


@pytest.mark.parametrize("bad_id", [4096, 5000, -1])
def test_token_ids_outside_the_vocabulary_fail_naming_the_id_and_its_position(
    build_debug_model, bad_id
):
    # The embedding raised "IndexError: index out of range in self", naming neither the id
    # nor the vocabulary size.
    model = build_debug_model()
    assert model.config.vocab_size == 4096
    input_ids_BS, labels_BS = _batch()
    input_ids_BS[1, 7] = bad_id
    message = rf"input_ids\[1, 7\] is {bad_id}, outside \[0, vocab_size=4096\)"
    with pytest.raises(ValueError, match=message):
        model(input_ids_BS)
    with pytest.raises(ValueError, match=message):
        model.loss(input_ids_BS, labels_BS)
