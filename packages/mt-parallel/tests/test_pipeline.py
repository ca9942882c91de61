"""The DualPipeV executor: a split model runs one step to the one-process loss and gradients.

Each comparison (`compare_dualpipev`) runs `run_microbatches` on a whole tiny Qwen3-MoE
(DeepSeek-V2 and GPT-OSS too at pp = 1) and the executor on the pipeline ranks' stages of a
second copy, over the same global
batch (4-10 micro-batches, a few labels ignored), and asserts ce_sum and token counts,
the aux loss and its terms within LOSS_TOL, every parameter gradient within GRAD_TOL,
each (chunk, micro-batch)'s weight gradients flushed exactly once and none left queued.

Tolerances: all fp32 on the CPU. The executor runs each stage's ops on the same inputs as
one process, and each parameter's gradient accumulates over micro-batches in the same
order (a chunk's W run in micro-batch order; the deferred dW is the g^T·x autograd's
linear computes), so the results have been bitwise equal (worst errors 0.0 at pp = 1, 2
and 4), except a tied embedding at pp = 2 (5.7e-8): its embedding and head contributions
come from two stages and add up across micro-batches in another order. The bounds leave
room for such a reordering, a few fp32 ulps (eps 1.2e-7), no more: a missing or doubled
micro-batch, a dropped aux-loss gradient or a W flushed twice is off by far more (1e-3
and up; see the test that drops the aux-loss gradient). The 2-GPU test keeps them: its
reference runs the same kernels on the same shapes on the same GPU.
"""

import gc
import weakref
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from mt_models import build_model, deepseek_v2, gpt_oss, qwen3_moe
from mt_parallel.fsdp import apply_fsdp_to_stages
from mt_parallel.pipeline import DualPipeVExecutor
from mt_parallel.pipeline_stages import rank_parameters, split_for_dualpipev, stage_layers
from mt_parallel.testing import spawn
from mt_parallel.testing_pipeline import check_dualpipev_cases, compare_dualpipev

GRAD_TOL = 1e-6
LOSS_TOL = 1e-7
SHAPES = {"rows": 2, "seq_len": 16, "grad_tol": GRAD_TOL, "loss_tol": LOSS_TOL}


def _qwen3(num_layers: int, **changes):
    # Layer 1 dense among MoE layers (8 experts top-2, aux coefficient 0.01).
    return replace(
        qwen3_moe.debug(), vocab_size=256, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_hidden_layers=num_layers, head_dim=8,
        mlp_only_layers=(1,), **changes,
    )  # fmt: skip


# The aux-loss variants of CausalLM.auxiliary_losses: "pooled" balancing is no sum of
# per-layer terms, so it needs every layer's statistics at the last stage.
VARIANTS = {
    "global_pooled": {},
    "sequence_per_layer_z": {
        "aux_loss_type": "sequence",
        "load_balancing": "per_layer",
        "router_z_loss_coef": 1e-3,
    },  # fmt: skip
    "tied_embeddings": {"tie_word_embeddings": True, "router_z_loss_coef": 1e-3},
}


def test_stage_layers_split_evenly_with_extras_at_the_bottom_of_the_v():
    assert [len(r) for r in stage_layers(9, 2)] == [2, 3, 2, 2]  # extras: stage pp−1 = 1,
    assert [len(r) for r in stage_layers(11, 2)] == [3, 3, 3, 2]  # then 2, 0, 3
    assert [len(r) for r in stage_layers(8, 2)] == [2, 2, 2, 2]
    assert [len(r) for r in stage_layers(2, 1)] == [1, 1]
    for pp in range(1, 5):
        for num_layers in range(2 * pp, 6 * pp):
            ranges = stage_layers(num_layers, pp)
            assert [i for r in ranges for i in r] == list(range(num_layers))
            sizes = [len(r) for r in ranges]
            assert max(sizes) - min(sizes) <= 1
            if num_layers % (2 * pp) < 2 * pp - 2:  # rank 0's stages get no extra layer
                assert sizes[0] == sizes[-1] == num_layers // (2 * pp), sizes


def test_split_refuses_fewer_layers_than_stages_naming_both():
    with pytest.raises(ValueError, match=r"has 3 decoder layers .* pp=2 has 4 stages"):
        stage_layers(3, 2)
    model = build_model(_qwen3(3))
    with pytest.raises(ValueError, match=r"has 3 decoder layers .* use pp <= 1"):
        split_for_dualpipev(model, 0, 2)


def test_split_refuses_a_router_stats_reducer():
    model = build_model(_qwen3(4))
    model.router_stats_reducer = lambda stats: stats
    with pytest.raises(ValueError, match="router_stats_reducer is set"):
        split_for_dualpipev(model, 0, 2)


def test_stage_parameters_keep_the_models_names_and_cover_it_once():
    model = build_model(_qwen3(5))
    names = {name for name, _ in model.named_parameters()}
    per_rank = [dict(rank_parameters(split_for_dualpipev(model, r, 2))) for r in range(2)]
    assert set(per_rank[0]) | set(per_rank[1]) == names
    assert not set(per_rank[0]) & set(per_rank[1])
    for rank_params in per_rank:
        for name, param in rank_params.items():
            assert param is model.get_parameter(name), name
    first, last = split_for_dualpipev(model, 0, 2)
    assert "model.embed_tokens.weight" in dict(first.named_parameters())
    assert {"model.norm.weight", "lm_head.weight"} <= set(dict(last.named_parameters()))
    assert last.layer_ids == (4,) and first.layer_ids == (0,)  # 5 layers: the extra one at
    assert split_for_dualpipev(model, 1, 2)[0].layer_ids == (1, 2)  # stage 1, the V's bottom


def test_stages_hold_the_layers_they_run_not_the_whole_model():
    # Rank 0's last stage needs the model's aux-loss rules: bound to the model, they kept
    # every other rank's layers alive after the split.
    model = build_model(_qwen3(4))
    alive = weakref.ref(model)
    stages = split_for_dualpipev(model, 0, 2)
    del model
    gc.collect()
    assert alive() is None
    assert stages[1].is_last and stages[1].layer_ids == (3,)


def test_sent_tensors_are_let_go_once_their_sends_complete():
    class Work:
        def __init__(self, done):
            self.done = done

        def is_completed(self):
            return self.done

    step = SimpleNamespace(sends=[([Work(True)], ["a"]), ([Work(True), Work(False)], ["b"]),
                                  ([Work(False)], ["c"])])  # fmt: skip
    DualPipeVExecutor._drop_finished_sends(step)
    assert [tensors for _, tensors in step.sends] == [["b"], ["c"]]


def test_executor_refuses_stages_of_another_rank():
    model = build_model(_qwen3(4))
    stages = split_for_dualpipev(model, 0, 1)
    with pytest.raises(ValueError, match=r"stages\[0\] is stage 0 of 2; rank 0 of pp=2"):
        DualPipeVExecutor(stages, 0, 2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_pp1_folded_v_matches_one_process(variant):
    compare_dualpipev(_qwen3(5, **VARIANTS[variant]), num_micro_batches=4, **SHAPES)


OTHER_FAMILIES = {
    # MLA with q LoRA, first layer dense, shared expert, group-limited routing,
    # per-sequence balancing.
    "deepseek_v2": lambda: replace(deepseek_v2.debug(), vocab_size=256, num_hidden_layers=3),
    # Sliding window shorter than the sequence, sinks, expert biases.
    "gpt_oss": lambda: replace(
        gpt_oss.debug(),
        vocab_size=256,
        num_hidden_layers=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),  # fmt: skip
}


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_pp1_matches_one_process_for_the_other_families(family):
    compare_dualpipev(OTHER_FAMILIES[family](), num_micro_batches=4, **SHAPES)


def test_pp1_with_packed_documents_matches_one_process():
    # Per-document positions [B, S] reach every stage's layers, not only the first.
    compare_dualpipev(_qwen3(4), num_micro_batches=4, packed=True, **SHAPES)


def _tampered_schedule(monkeypatch, change):
    from mt_parallel import pipeline

    original = pipeline.dualpipev_schedule
    monkeypatch.setattr(pipeline, "dualpipev_schedule", lambda pp, m: change(original(pp, m)))


def _one_step(model_config, num_micro_batches=4):
    from mt_parallel.testing_pipeline import _build, _micro_batches

    executor = DualPipeVExecutor(split_for_dualpipev(_build(model_config, 0), 0, 1), 0, 1)
    mbs = _micro_batches(model_config.vocab_size, num_micro_batches, 2, 8, 0)
    return executor.step(mbs, sum(int((mb.labels != -100).sum()) for mb in mbs))


def test_executor_refuses_a_weight_gradient_run_twice(monkeypatch):
    _tampered_schedule(monkeypatch, lambda s: [s[0] + [s[0][-1]]])  # the last W again
    with pytest.raises(RuntimeError, match=r"W\d\[\d\] without a pending F/B \(run twice"):
        _one_step(_qwen3(2))


def test_executor_refuses_to_end_a_step_with_weight_gradients_queued(monkeypatch):
    _tampered_schedule(monkeypatch, lambda s: [s[0][:-1]])  # the last W dropped
    with pytest.raises(
        RuntimeError, match=r"the step ended with work left: \['W\d\[\d\] \(\d+ pending"
    ):
        _one_step(_qwen3(2))


def test_pp1_check_fails_when_the_aux_loss_gradient_is_dropped(monkeypatch):
    # The comparison can fail: a stage that sent no router-statistics gradient back
    # leaves the routers of earlier stages without their aux-loss gradient.
    from mt_parallel import pipeline

    original = pipeline._unflatten_stats
    monkeypatch.setattr(pipeline, "_unflatten_stats",
                        lambda flat, *a: original(flat.detach(), *a))  # fmt: skip
    with pytest.raises(AssertionError, match=r"gradient of model\.\S+ differs by"):
        compare_dualpipev(_qwen3(4), num_micro_batches=4, **SHAPES)


# The spawned runs pass every point-to-point operation tag 0 (untagged=True), as NCCL has
# no tags: only their order can match sends with receives, and a wrong order shows up as
# a size mismatch (gloo aborts), wrong values (the comparison fails) or a hang (the
# timeout kills the ranks). A run takes 2-10 s here.
TIMEOUT_S = 300
PP2_CASES = [(_qwen3(5, **VARIANTS[v]), {"num_micro_batches": m, **SHAPES})
             for v, m in (("global_pooled", 6), ("sequence_per_layer_z", 4),
                          ("tied_embeddings", 5))]  # fmt: skip
# 256 KiB hidden states per message: gloo's blocking send waits for its receive at any
# size, as NCCL's may, so both ranks sending before receiving would hang.
LARGE_CASES = [(_qwen3(4), {"num_micro_batches": 4, **SHAPES, "rows": 4, "seq_len": 512})]


@pytest.mark.slow
def test_pp2_matches_one_process_over_two_ranks_without_tags():
    spawn(check_dualpipev_cases, 2, PP2_CASES, untagged=True, timeout_s=TIMEOUT_S)


@pytest.mark.slow
def test_pp2_with_large_activations_does_not_deadlock():
    spawn(check_dualpipev_cases, 2, LARGE_CASES, untagged=True, timeout_s=TIMEOUT_S)


@pytest.mark.slow
def test_pp4_matches_one_process_over_four_ranks_without_tags():
    # With the executor's former per-message tags forced to 0, this aborted at once
    # (gloo: "1248 vs 208. Received data size doesn't match expected size").
    cases = [(_qwen3(9, **VARIANTS["global_pooled"]), {"num_micro_batches": 10, **SHAPES})]
    spawn(check_dualpipev_cases, 4, cases, untagged=True, timeout_s=TIMEOUT_S)


def _with_receives_swapped(cases):
    """check_dualpipev_cases with the last rank posting two receives from the same peer in
    the wrong order: the first two it posts, both at the first one's place."""
    from mt_parallel import pipeline

    original = pipeline.message_plan

    def swapped(schedule, pp):
        plan = original(schedule, pp)
        rank_plan = plan[pp - 1]
        first = next(i for i, before in enumerate(rank_plan) if before)
        later = next(i for i in range(first + 1, len(rank_plan)) if rank_plan[i])
        rank_plan[first] = [rank_plan[later].pop(0), *rank_plan[first]]
        assert rank_plan[first][0].sender == rank_plan[first][1].sender, rank_plan[first]
        return plan

    pipeline.message_plan = swapped
    check_dualpipev_cases(cases, untagged=True)


@pytest.mark.slow
def test_pp2_comparison_fails_when_receives_are_posted_out_of_order(monkeypatch):
    # The untagged runs can fail: the last rank receiving two messages in the wrong order
    # gives some micro-batch another's hidden states (same shapes), and the loss and
    # gradients differ.
    from pathlib import Path

    from torch.multiprocessing import ProcessRaisedException

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # spawned ranks import this file
    targets = __import__(Path(__file__).stem)
    with pytest.raises(ProcessRaisedException, match=r"AssertionError: rank \d of pp=2: "):
        spawn(targets._with_receives_swapped, 2, PP2_CASES[:1], timeout_s=TIMEOUT_S)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_pp2_on_two_gpus_over_nccl_matches_one_process():
    # NCCL: no tags, and a send may wait for its receive. Each rank's reference runs on
    # its own GPU in fp32, with the same kernels on the same shapes as the stages (mt-ops'
    # MoE permute and combine keep a fixed order, no atomics), so the tolerances are the
    # CPU test's: a few ulps for a reordered sum (the tied embedding), far below a wrong,
    # missing or doubled message (1e-3 and up). The timeout leaves room for compiling the
    # Triton kernels on first use.
    cases = [(config, {**kwargs, "device": "cuda"}) for config, kwargs in PP2_CASES + LARGE_CASES]
    spawn(check_dualpipev_cases, 2, cases, backend="nccl", timeout_s=540)


def test_micro_batch_losses_sum_like_run_microbatches():
    # Sanity of the setup: the token count the comparison divides by is what labels hold.
    from mt_parallel.testing_pipeline import _micro_batches

    mbs = _micro_batches(256, 4, 2, 16, 0)
    assert sum(int((mb.labels != -100).sum()) for mb in mbs) == 4 * 2 * 16 - (0 + 1 + 2 + 0)
    assert all(mb.input_ids.dtype == torch.int64 for mb in mbs)


def _pp2_dp2_cases():
    # Untied (FSDP2 cannot shard rank 0's tied embedding under both of its stages); 4 rows a
    # micro-batch, 2 per replica: the router statistics must be the whole micro-batch's.
    return [(_qwen3(5, **VARIANTS[v]), {"num_micro_batches": m, **SHAPES, "rows": 4, "dp": 2})
            for v, m in (("global_pooled", 4), ("sequence_per_layer_z", 5))]  # fmt: skip


@pytest.mark.slow
def test_pp2_dp2_fsdp_matches_one_process_over_four_ranks():
    spawn(check_dualpipev_cases, 4, _pp2_dp2_cases(), untagged=True, timeout_s=TIMEOUT_S)


@pytest.mark.slow
def test_pp2_cp2_matches_one_process_over_four_ranks():
    # Each pipeline holds 2 of every sequence's 4 zigzag chunks (global positions); the
    # attention exchanges keys and values across the two pipelines.
    cases = [(_qwen3(5, **VARIANTS["sequence_per_layer_z"]),
              {"num_micro_batches": 4, **SHAPES, "cp": 2})]  # fmt: skip
    spawn(check_dualpipev_cases, 4, cases, untagged=True, timeout_s=TIMEOUT_S)


@pytest.mark.slow
def test_pp2_ep2_matches_one_process_over_four_ranks():
    # Each pipeline holds 4 of the 8 experts of every MoE layer and reads 2 of a
    # micro-batch's 4 rows; the layers' all-to-alls meet across the two pipelines.
    cases = [(_qwen3(5, **VARIANTS["sequence_per_layer_z"]),
              {"num_micro_batches": 4, **SHAPES, "rows": 4, "ep": 2})]  # fmt: skip
    spawn(check_dualpipev_cases, 4, cases, untagged=True, timeout_s=TIMEOUT_S)


def test_fsdp_of_stages_refuses_tied_embeddings_held_by_both_stages_naming_them():
    # pp=1 puts stage 0 (embedding) and the last stage (head = embedding) on one rank.
    stages = split_for_dualpipev(build_model(_qwen3(4, **VARIANTS["tied_embeddings"])), 0, 1)
    with pytest.raises(ValueError, match=r"\['model\.embed_tokens\.weight'\].*tie_word_embed"):
        apply_fsdp_to_stages(stages, mesh=None)


def test_a_micro_batch_of_2_to_the_24_tokens_is_refused_before_the_step_runs(monkeypatch):
    # An assert inside the first forward before: gone under python -O (token counts then
    # travel as inexact fp32), and at pp > 1 raised on some ranks mid-step.
    from mt_parallel.schedule import MicroBatch

    executor = DualPipeVExecutor(split_for_dualpipev(build_model(_qwen3(2)), 0, 1), 0, 1)
    ran = []
    monkeypatch.setattr(executor, "_run", lambda *args: ran.append(args))
    small = MicroBatch(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    ids = torch.zeros(1, 1, dtype=torch.long).expand(2, 2**23)  # 2**24 tokens, no memory
    big = MicroBatch(ids, ids)
    with pytest.raises(ValueError, match=r"^microbatches\[1\] holds 2 x 8388608 = 16777216 "
                       r"tokens; the pipeline sends token counts as fp32, exact below 2\*\*24 "
                       r"\(16777216\): use smaller micro-batches"):  # fmt: skip
        executor.step([small, big], 10)
    assert ran == []


def test_the_loss_of_a_stage_that_is_not_last_is_a_value_error():
    first, last = split_for_dualpipev(build_model(_qwen3(2)), 0, 1)
    hidden = torch.zeros(1, 4, 32)
    labels = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^PipelineStage.loss: stage 0 of 2 is not the last "
                       r"\(stage 1\), which holds the head"):  # fmt: skip
        first.loss(hidden, [], labels)
