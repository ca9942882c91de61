"""The training loop as importable functions: `setup`, `train_step`, `pretrain`.

One step: take the rank's slice of the next global batch, run the micro-batch schedule
(mt-parallel) with the loss normalized by the global number of labelled tokens, clip
the global gradient norm, check that loss and gradients are finite, step AdamW, log
metrics, and save a checkpoint every `checkpoint.interval` steps and at the end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from mt_data import DataExhausted, TokenDataset, default_corpus_dir
from mt_models import build_model
from mt_parallel import MicroBatch, ParallelDims, run_microbatches
from mt_train.checkpoint import checkpoint_root, latest_checkpoint, load_checkpoint, save_checkpoint
from mt_train.config import JobConfig
from mt_train.metrics import MetricsLogger, peak_flops
from mt_train.optim import build_optimizer, lr_at, set_lr
from mt_train.overrides import flatten

log = logging.getLogger("mt_train")
IGNORE_INDEX = -100


@dataclass
class TrainState:
    """Everything the loop owns: config, model, optimizer, data and counters."""

    cfg: JobConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    dataset: TokenDataset
    device: torch.device
    autocast_dtype: torch.dtype | None
    step: int = 0
    skipped_steps: int = 0
    stop_requested: bool = False
    losses: list[float] = field(default_factory=list)


def _resolve_device(cfg: JobConfig) -> tuple[torch.device, torch.dtype | None]:
    want = cfg.training.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise ValueError("training.device='cuda' but no CUDA device is available; use 'auto'")
    dtype = cfg.training.dtype
    if dtype == "auto":
        dtype = "bfloat16" if want == "cuda" else "float32"
    return torch.device(want), (torch.bfloat16 if dtype == "bfloat16" else None)


def setup(cfg: JobConfig) -> TrainState:
    """Builds data, model (meta → materialize → init_weights) and optimizer, then resumes.

    Args:
        cfg: the resolved run config.

    Returns:
        The loop state, at step 0 or at the newest complete checkpoint's step.
    """
    if cfg.training.num_threads:
        torch.set_num_threads(cfg.training.num_threads)
    dims = ParallelDims(world_size=1, **vars(cfg.parallel))
    dims.validate_model(
        num_experts=getattr(cfg.model, "num_experts", 1),
        num_heads=cfg.model.num_attention_heads,
        seq_len=cfg.data.seq_len,
    )
    device, autocast_dtype = _resolve_device(cfg)
    data_dir = Path(cfg.data.path) if cfg.data.path else default_corpus_dir()
    dataset = TokenDataset(
        data_dir, cfg.data.seq_len, seed=cfg.seed, on_exhausted=cfg.data.on_exhausted
    )
    if dataset.vocab_size is not None and dataset.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"the corpus in {data_dir} uses a vocabulary of {dataset.vocab_size} tokens but "
            f"model.vocab_size is {cfg.model.vocab_size}; set model.vocab_size>="
            f"{dataset.vocab_size}"
        )
    with torch.device("meta"):
        model = build_model(cfg.model)
    model.to_empty(device=device)
    model.init_weights(cfg.seed)
    optimizer = build_optimizer(model, cfg.training)
    state = TrainState(cfg, model, optimizer, dataset, device, autocast_dtype)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.checkpoint.resume:
        checkpoint = latest_checkpoint(checkpoint_root(run_dir))
        if checkpoint is not None:
            _resume(state, checkpoint)
    _write_json_atomic(run_dir / "config.json", cfg.to_dict())
    return state


def _resume(state: TrainState, checkpoint) -> None:
    saved = load_checkpoint(checkpoint, state.model, state.optimizer)
    state.step = saved["step"]
    state.dataset.load_state_dict(saved["data"])
    state.skipped_steps = saved.get("skipped_steps", 0)
    log.info("resumed from %s (step %d)", checkpoint.path, state.step)
    old, new = flatten(saved["config"]), flatten(state.cfg.to_dict())
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if changed:
        diff = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        log.warning("config differs from the checkpoint; the new config wins: %s", diff)
    try:
        old_lr = lr_at(state.step + 1, JobConfig.from_dict(saved["config"]).training)
    except (ValueError, TypeError, KeyError):
        old_lr = None
    new_lr = lr_at(state.step + 1, state.cfg.training)
    if old_lr is not None and not math.isclose(old_lr, new_lr, rel_tol=1e-12):
        log.warning(
            "the LR schedule is recomputed from the new config: step %d now uses lr %.3e "
            "(the checkpoint's config gave %.3e)",
            state.step + 1,
            new_lr,
            old_lr,
        )


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def train_step(state: TrainState, tokens: np.ndarray) -> dict[str, Any]:
    """Runs one optimizer step on the rank's sequences.

    Args:
        state: the loop state (advanced in place).
        tokens: int64 array [batch, seq_len + 1]; inputs are tokens[:, :-1], labels
            tokens[:, 1:].

    Returns:
        The step's metrics.
    """
    cfg = state.cfg
    start = time.perf_counter()
    step = state.step + 1
    lr = lr_at(step, cfg.training)
    set_lr(state.optimizer, lr)
    batch = torch.from_numpy(tokens).to(state.device, non_blocking=True)
    inputs, labels = batch[:, :-1], batch[:, 1:]
    mbs = cfg.training.micro_batch_size
    microbatches = [
        MicroBatch(inputs[i : i + mbs], labels[i : i + mbs]) for i in range(0, len(batch), mbs)
    ]
    global_num_tokens = int((labels != IGNORE_INDEX).sum())
    autocast = (
        torch.autocast(state.device.type, dtype=state.autocast_dtype)
        if state.autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with autocast:
        result = run_microbatches(
            state.model, microbatches, global_num_tokens, ignore_index=IGNORE_INDEX
        )
    params = [p for p in state.model.parameters() if p.grad is not None]
    max_norm = cfg.training.grad_clip if cfg.training.grad_clip > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    loss = float(result.ce_sum) / global_num_tokens
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite:
        state.optimizer.step()
    else:
        state.skipped_steps += 1
        log.warning("step %d: non-finite loss (%s) or grad norm (%s); step skipped",
                    step, loss, grad_norm)
    state.optimizer.zero_grad(set_to_none=True)
    if state.device.type == "cuda":
        torch.cuda.synchronize(state.device)
    elapsed = time.perf_counter() - start
    state.step = step
    state.losses.append(loss)
    num_tokens = tokens.shape[0] * (tokens.shape[1] - 1)
    tokens_per_s = num_tokens / elapsed
    flops = state.model.flops_per_token(cfg.data.seq_len) * tokens_per_s
    measured_peak, spec_peak = (
        peak_flops(torch.cuda.get_device_name(state.device))
        if state.device.type == "cuda"
        else (None, None)
    )
    return {
        "step": step,
        "loss": loss,
        "aux_loss": float(result.aux_loss),
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": tokens_per_s,
        "tflops": flops / 1e12,
        "mfu": flops / measured_peak if measured_peak else None,
        "mfu_spec": flops / spec_peak if spec_peak else None,
        "step_time_s": elapsed,
        "peak_memory_gb": _peak_memory_gb(state.device),
        "skipped_steps": state.skipped_steps,
    }


def _save(state: TrainState) -> None:
    cfg = state.cfg
    checkpoint = save_checkpoint(
        checkpoint_root(cfg.run_dir),
        state.step,
        state.model,
        state.optimizer,
        {
            "data": state.dataset.state_dict(),
            "skipped_steps": state.skipped_steps,
            "config": cfg.to_dict(),
        },
        keep_last=cfg.checkpoint.keep_last,
    )
    log.info("saved checkpoint %s", checkpoint.path)


@contextlib.contextmanager
def _stop_on_signals(state: TrainState):
    """SIGTERM/SIGINT ask the loop to save and stop at the next step boundary."""

    def request_stop(signum, frame):
        if state.stop_requested:  # a second signal: give up at once
            raise KeyboardInterrupt
        state.stop_requested = True
        log.warning("received %s; saving a checkpoint after this step",
                    signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def pretrain(cfg: JobConfig, *, stream: TextIO | None = None) -> TrainState:
    """Trains to `training.max_steps`, resuming from the run directory when it can.

    Args:
        cfg: the resolved run config.
        stream: where console lines go (default stdout).

    Returns:
        The final loop state (`state.losses` holds this invocation's losses).
    """
    state = setup(cfg)
    max_steps = cfg.training.max_steps
    if state.step >= max_steps:
        log.warning(
            "the run in %s is already at step %d (training.max_steps=%d); nothing to do. "
            "Raise training.max_steps to continue it.", cfg.run_dir, state.step, max_steps,
        )
        return state
    metrics = MetricsLogger(cfg.run_dir, max_steps, state.step, cfg.log_every, stream)
    last_saved = state.step
    try:
        with _stop_on_signals(state):
            while state.step < max_steps and not state.stop_requested:
                try:
                    tokens = state.dataset.take(cfg.training.global_batch_size)
                except DataExhausted:
                    log.warning("the data ran out at step %d (data.on_exhausted='stop')",
                                state.step)
                    break
                metrics.log(train_step(state, tokens))
                interval = cfg.checkpoint.interval
                if interval and state.step % interval == 0:
                    _save(state)
                    last_saved = state.step
        if state.step != last_saved:
            _save(state)
    finally:
        metrics.close()
    return state
