"""A run saved under one layout continues under another as if never interrupted.

For the debug recipes of the three families (short sequences), one process trains 4 steps as
the reference. Two gloo ranks train the same run to step 2 under one layout, save, and resume
it under another to step 4: GPT-OSS from dp = 2 (experts split by FSDP2) to ep = 2,
DeepSeek-V2 from ep = 2 to cp = 2 (every expert on both ranks, sequences split); Qwen3-MoE
saved under ep = 2 resumes in one process (another world size, no sharding). The step-4
checkpoints must agree: every parameter and both AdamW moments of every
canonical tensor (each expert by its global id) within reduction-order noise, AdamW's
step count and the data loader's position exactly, and every step's loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mt_parallel.testing import rel_err, spawn
from mt_train.checkpoint import checkpoint_root, latest_checkpoint
from mt_train.overrides import resolve_config
from mt_train.recipes import get_recipe
from mt_train.train import pretrain

pytestmark = pytest.mark.slow

# (recipe, saved layout, resumed layout; None: in one process)
CASES = [
    ("debug-gpt-oss", ["parallel.dp=2"], ["parallel.ep=2"]),
    ("debug-deepseek-v2", ["parallel.ep=2"], ["parallel.cp=2"]),
    ("debug", ["parallel.ep=2"], None),
]
# Small runs whose LR changes every step (warm-up, then cosine decay to step 4).
RUN = [
    "data.seq_len=32", "training.global_batch_size=4", "training.micro_batch_size=4",
    "training.max_steps=4", "training.warmup_steps=2", "training.num_threads=1",
    "checkpoint.interval=2", "checkpoint.keep_last=4",
]  # fmt: skip
# Every tensor after 4 AdamW steps: Adam's normalization magnifies the float
# reduction-order differences of the gradients (~1e-7) to ~1e-5 in small tensors; a
# tensor loaded into the wrong place or not at all is off by O(1).
TOLERANCE = 1e-4


def _cfg(recipe: str, run_dir: Path, *overrides: str):
    return resolve_config(get_recipe(recipe), overrides=[*RUN, f"run_dir={run_dir}", *overrides])


def _save_then_resume(root: str) -> None:
    for recipe, saved, resumed in CASES:
        run_dir = Path(root) / recipe
        pretrain(_cfg(recipe, run_dir, *saved, "training.max_steps=2"))
        if resumed is not None:
            _resume(recipe, run_dir, resumed)


def _resume(recipe: str, run_dir: Path, layout: list[str]) -> None:
    state = pretrain(_cfg(recipe, run_dir, *layout))
    assert len(state.losses) == 2, f"{recipe}: the resumed run must start at step 3"


def _final(run_dir: Path) -> tuple[dict[str, torch.Tensor], dict, list[float]]:
    checkpoint = latest_checkpoint(checkpoint_root(run_dir))
    assert checkpoint is not None and checkpoint.step == 4
    dcp_to_torch_save(checkpoint.path, run_dir / "step_4.pt")
    tensors = torch.load(run_dir / "step_4.pt")
    data = checkpoint.train_state(needed=("data",))["data"]
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    return tensors, data, [json.loads(row)["loss"] for row in rows]


def test_a_run_resumed_under_another_layout_ends_with_the_one_process_weights_and_adam_state(
    tmp_path, monkeypatch
):
    for recipe, _, _ in CASES:
        pretrain(_cfg(recipe, tmp_path / "reference" / recipe))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    spawn(_save_then_resume, 2, str(tmp_path / "layouts"))
    for recipe, _, resumed in CASES:
        if resumed is None:
            _resume(recipe, tmp_path / "layouts" / recipe, [])
    for recipe, saved, resumed in CASES:
        ref_tensors, ref_data, ref_losses = _final(tmp_path / "reference" / recipe)
        tensors, data, losses = _final(tmp_path / "layouts" / recipe)
        case = f"{recipe} {saved} -> {resumed or 'one process'}"
        assert data == ref_data, case
        assert len(losses) == len(ref_losses) == 4
        for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True), start=1):
            assert abs(got - want) <= 1e-5 * abs(want), f"{case}: step {step} loss {got}, {want}"
        compared = {k for k in ref_tensors if k.startswith(("model/", "optim/"))}
        assert compared == {k for k in tensors if k.startswith(("model/", "optim/"))}, case
        assert any(".experts.7." in k and k.endswith("exp_avg_sq") for k in compared)
        assert torch.equal(tensors["optim/step"], ref_tensors["optim/step"]), case
        assert int(tensors["optim/step"]) == 4
        for key in sorted(compared - {"optim/step"}):
            error = rel_err(tensors[key], ref_tensors[key])
            assert error <= TOLERANCE, f"{case}: {key} differs by {error:.2e} (relative)"
