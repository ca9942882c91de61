"""The training loop as importable functions: `setup`, `train_step`, `pretrain`.

One step: take the rank's slice of the next global batch, run the micro-batch schedule
(mt-parallel) with the loss normalized by the global number of labelled tokens, clip
the global gradient norm, check that loss and gradients are finite, step AdamW, log
metrics, and save a checkpoint every `checkpoint.interval` steps and at the end.

With ``parallel.pp`` > 1 (world_size = pp·dp·cp·ep) every rank builds the model on the
meta device (its slice of the experts under ep, context-parallel attention under cp),
keeps its two DualPipeV stages (`PipelineRank`), shards them with FSDP2 when dp·cp·ep > 1,
materializes and initializes them alone (with the values one process gives them; the
other stages never leave the meta device and are dropped once setup is done), and
optimizes and checkpoints only their parameters, under the model's canonical names (a
checkpoint is the same whatever the layout). The ranks of a pipeline read the same tokens
of every micro-batch and run them through `DualPipeVExecutor`; token counts and loss sums
are added over the pipelines (the dp·cp·ep ranks of distinct tokens), and the gradient
norm over every rank, each gradient element living on one rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from mt_data import DataExhausted, TokenDataset, default_corpus_dir
from mt_models import build_model
from mt_models.layers.rope import rope_type_of
from mt_ops import FP8WeightCache
from mt_parallel import (
    DualPipeVExecutor,
    MicroBatch,
    ParallelDims,
    ParallelMesh,
    check_batch_split,
    clip_grad_norm,
    parallelize,
    run_microbatches,
    zigzag_ranges,
)
from mt_parallel.context_parallel import split_sample
from mt_parallel.expert_parallel import apply_expert_parallel
from mt_parallel.fsdp import apply_fsdp_to_stages
from mt_parallel.mesh import build_mesh
from mt_parallel.parallelize import apply_context_parallel
from mt_parallel.pipeline_stages import PipelineStage, rank_parameters, split_for_dualpipev
from mt_parallel.stats import router_stats_reducer
from mt_train.checkpoint import (
    AsyncCheckpointer,
    Checkpoint,
    checkpoint_root,
    clear_leftovers,
    is_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    misnamed_checkpoints,
    save_checkpoint,
)
from mt_train.config import JobConfig, check_pipeline_micro_batch_tokens, family_of
from mt_train.convert import (
    _init_source_kind,
    init_config_differences,
    init_from_weights,
    is_hf_dir,
    shell_override,
    tensor_config_differences,
)
from mt_train.distributed import (
    Env,
    all_reduce,
    failing_together,
    from_all_ranks,
    init_distributed,
)
from mt_train.faults import (
    SCHEDULER_SIGNALS,
    NonFiniteError,
    agree_to_stop,
    stop_on_signals,
    write_exit_file,
)
from mt_train.files import lock_or_holder, write_holder, write_text_durably
from mt_train.metrics import MetricsLogger, build_sinks, peak_flops
from mt_train.optim import build_optimizer, lr_at, set_lr
from mt_train.overrides import flatten
from mt_train.precision import apply_fp8
from mt_train.profiling import StepProfiler, parse_trace_steps

log = logging.getLogger("mt_train")
IGNORE_INDEX = -100


class PipelineRank:
    """What a pipeline rank optimizes and checkpoints of the model: its stages' parameters.

    It stands for the model where the loop, the optimizer and the checkpoints ask for
    parameters (`named_parameters`, `to_canonical`): each parameter is on exactly one
    rank (a tied embedding on rank 0), under the model's own names.

    Args:
        whole: the whole model, this rank's stages materialized and the rest on the meta
            device (the stages share its modules; `release_other_stages` drops the rest
            once setup is done).
        stages: ``split_for_dualpipev(whole, rank, pp)``.
    """

    def __init__(self, whole: torch.nn.Module, stages: tuple[PipelineStage, PipelineStage]):
        self.whole, self.stages, self.config = whole, stages, whole.config

    def named_parameters(self):
        """This rank's ``(canonical name, parameter)`` pairs, each parameter once."""
        return rank_parameters(self.stages)

    def parameters(self):
        """This rank's parameters."""
        return (param for _, param in rank_parameters(self.stages))

    def to_canonical(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """As the whole model's `to_canonical` (the names are its own)."""
        return self.whole.to_canonical(tensors)

    def release_other_stages(self) -> None:
        """Drops the (meta-device) modules this rank does not run (other ranks' layers; the
        embedding, final norm and head off rank 0) once initialization, init_from and
        resume are done: each replaced by an ``nn.Identity`` in place, so the rank's own
        modules keep their names (``model.layers.<i>``) for `to_canonical`."""
        # By parameter: the stages share the model's modules (split_for_dualpipev swapped
        # their linears for deferrable ones in the model), whose parameters FSDP2 may have
        # replaced by its shards.
        kept = {id(param) for param in self.parameters()}

        def unused(module: torch.nn.Module) -> bool:
            return not any(id(param) in kept for param in module.parameters())

        layers = self.whole.model.layers
        for i, layer in enumerate(layers):
            if unused(layer):
                layers[i] = torch.nn.Identity()
        for owner, name in ((self.whole.model, "embed_tokens"), (self.whole.model, "norm"),
                            (self.whole, "lm_head")):  # fmt: skip
            module = getattr(owner, name)
            if module is not None and unused(module):
                setattr(owner, name, torch.nn.Identity())

    def flops_per_token(self, seq_len: int) -> float:
        """The whole model's training FLOPs per token."""
        return self.whole.flops_per_token(seq_len)


@dataclass
class TrainState:
    """Everything the loop owns: config, model, optimizer, data, layout and counters."""

    cfg: JobConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    dataset: TokenDataset
    env: Env
    dims: ParallelDims
    mesh: ParallelMesh | None
    autocast_dtype: torch.dtype | None
    val_dataset: TokenDataset | None = None
    val_start: dict[str, Any] | None = None
    flops_per_token: float = 0.0  # model training FLOPs per token at data.seq_len
    peak_flops: tuple[float | None, float | None] = (None, None)  # measured, spec
    # precision.fp8: the step's quantized weights, invalidated after every optimizer step.
    fp8_cache: FP8WeightCache | None = None
    step: int = 0
    skipped_steps: int = 0
    signal_received: bool = False  # this rank's, set by the signal handler
    stop_requested: bool = False  # agreed by all ranks at a step boundary
    losses: list[float] = field(default_factory=list)
    # parallel.pp > 1: the executor of this rank's stages (`model` is then a PipelineRank).
    pipeline: DualPipeVExecutor | None = None
    # The main rank's open <run_dir>/.lock (see `_lock_run_dir`); closing it frees the run_dir.
    run_lock: TextIO | None = None

    @property
    def device(self) -> torch.device:
        """The device of this rank."""
        return self.env.device

    def autocast(self):
        """The mixed-precision context of forward passes (a no-op in FP32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


def _resolve_device(cfg: JobConfig) -> tuple[str, torch.dtype | None]:
    want = cfg.training.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise ValueError("training.device='cuda' but no CUDA device is available; use 'auto'")
    dtype = cfg.training.dtype
    if dtype == "auto":
        dtype = "bfloat16" if want == "cuda" else "float32"
    return want, (torch.bfloat16 if dtype == "bfloat16" else None)


def _check_num_threads(num_threads: int) -> None:
    """Refuses more intra-op threads than this process has cores: each is an OpenMP thread
    started at once (100000 stalled the machine), and past the cores they only slow a step.

    Raises:
        ValueError: `num_threads` exceeds the cores this process may run on.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cores and num_threads > cores:
        raise ValueError(
            f"training.num_threads ({num_threads}) exceeds the {cores} CPU cores this process "
            f"may use; set at most {cores} (0 leaves PyTorch's default)"
        )


def setup(cfg: JobConfig) -> TrainState:
    """Builds data, model (meta → parallelize → init_weights) and optimizer, then resumes.

    Under torchrun the process joins the process group first; the layout comes from
    `cfg.parallel` and the world size. The main rank holds the run directory's lock
    (`_lock_run_dir`) in `TrainState.run_lock` from before the resume on; `pretrain`
    closes it at the end (a caller of `setup` alone closes it, or drops the state).

    Args:
        cfg: the resolved run config.

    Returns:
        The loop state, at step 0 or at the newest complete checkpoint's step.
    """
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():  # checked before the slow setup below
        raise ValueError(f"run_dir ({cfg.run_dir!r}) is a file; choose a directory path")
    _refuse_a_checkpoint_as_run_dir(cfg.run_dir)
    _refuse_a_foreign_config_json(cfg.run_dir)
    if cfg.init_from and latest_checkpoint(checkpoint_root(run_dir)) is None:
        _init_source_kind(Path(cfg.init_from))  # a wrong path fails before anything is built
    if cfg.training.num_threads:
        _check_num_threads(cfg.training.num_threads)
        torch.set_num_threads(cfg.training.num_threads)
    device_type, autocast_dtype = _resolve_device(cfg)
    env = init_distributed(device_type, cfg.parallel.timeout_s)
    par = cfg.parallel
    dims = ParallelDims(world_size=env.world_size, pp=par.pp, dp=par.dp, cp=par.cp, ep=par.ep)
    check_pipeline_sharding(dims, cfg.model)
    dims.validate_model(
        num_experts=getattr(cfg.model, "num_experts", 1),
        num_heads=cfg.model.num_attention_heads,
        seq_len=cfg.data.seq_len,
    )
    check_batch_split(cfg.training.global_batch_size, cfg.training.micro_batch_size, dims)
    check_pipeline_micro_batch_tokens(cfg, dims.dp)  # the config could not when dp = -1
    if env.is_main:
        _warn_if_all_warmup(cfg)
        _warn_if_seq_len_exceeds_context(cfg)
    if cfg.data.path:
        data_dir = Path(cfg.data.path)
    else:  # one rank builds the embedded corpus, the others wait and read it
        with failing_together("building the default corpus"):
            if env.is_main:
                default_corpus_dir(on_build=_log_default_corpus_build)
        data_dir = default_corpus_dir()
    with failing_together(f"reading the data in {data_dir}"):  # a node may lack a file
        dataset, val_dataset = _open_datasets(cfg, data_dir, env.is_main)
    with torch.device("meta"):
        model = build_model(cfg.model)
    # FP8 modules replace the linears before FSDP2 wraps them (it records the modules that
    # own each parameter); parameters and names stay, so initialization is unchanged.
    fp8_cache = apply_fp8(model, env.device) if cfg.precision.fp8 else None
    mesh, pipeline = None, None
    if dims.pp > 1:
        model, pipeline, mesh = _split_for_the_pipeline(
            model, dims, env, cfg.seed, autocast_dtype, par.reshard_after_forward,
            ep_async=par.ep_comm == "async",
        )  # fmt: skip
    elif env.world_size > 1:
        mesh = parallelize(
            model,
            dims,
            env.device,
            seed=cfg.seed,
            param_dtype=autocast_dtype,
            reshard_after_forward=par.reshard_after_forward,
            ep_async=par.ep_comm == "async",
        )
    else:
        model.to_empty(device=env.device)
        model.init_weights(cfg.seed)
    optimizer = build_optimizer(model, cfg.training)
    state = TrainState(
        cfg,
        model,
        optimizer,
        dataset,
        env,
        dims,
        mesh,
        autocast_dtype,
        val_dataset,
        val_dataset.state_dict() if val_dataset is not None else None,
        flops_per_token=model.flops_per_token(cfg.data.seq_len),
        peak_flops=(
            peak_flops(torch.cuda.get_device_name(env.device))
            if env.device.type == "cuda"
            else (None, None)
        ),
        fp8_cache=fp8_cache,
        pipeline=pipeline,
    )
    try:
        with failing_together(f"preparing the run directory {run_dir}"):
            if env.is_main:
                state.run_lock = _prepare_run_dir(run_dir)
        _resume_or_start(state, run_dir)
        if isinstance(model, PipelineRank):  # only its stages' weights from here on
            model.release_other_stages()
    except BaseException:  # free the run_dir now, not when the traceback is collected
        if state.run_lock is not None:
            state.run_lock.close()
            state.run_lock = None
        raise
    return state


def check_pipeline_sharding(dims: ParallelDims, model_config: Any) -> None:
    """Raises on every rank, before anything is built, when FSDP2 would shard a pipeline
    whose rank 0 holds a tied embedding in both its stages (dp·cp·ep > 1 shards them; the
    config cannot tell, as dp = -1 fills the world)."""
    sharded = dims.dp * dims.cp * dims.ep
    if dims.pp > 1 and sharded > 1 and getattr(model_config, "tie_word_embeddings", False):
        raise ValueError(
            f"model.tie_word_embeddings=true with parallel.pp={dims.pp} and dp*cp*ep = "
            f"{dims.dp}*{dims.cp}*{dims.ep} = {sharded}: FSDP2 shards the pipeline's stages "
            "whenever dp*cp*ep > 1, and pipeline rank 0's two stages (the embedding's and "
            "the head's) would hold the tied weight under two roots; set "
            "model.tie_word_embeddings=false, or run the pipeline alone (a world of pp ranks)"
        )


def _split_for_the_pipeline(
    model: torch.nn.Module, dims: ParallelDims, env: Env, seed: int,
    param_dtype: torch.dtype | None, reshard_after_forward: bool, *, ep_async: bool = True,
) -> tuple[PipelineRank, DualPipeVExecutor, ParallelMesh | None]:  # fmt: skip
    """Keeps this rank's DualPipeV stages of the meta-device `model` (with its slice of the
    experts when ep > 1, context-parallel attention when cp > 1, sharded by FSDP2 as
    `parallelize` shards when dp·cp·ep > 1, computing in `param_dtype`), materializes and
    initializes them alone, as one process would (initialization is a function of the
    seed and each parameter's name), and builds their executor; returns the mesh when
    dp·cp·ep > 1. The other stages' layers stay on the meta device: no rank ever holds
    the whole model."""
    mesh = build_mesh(dims, env.device.type) if dims.dp * dims.cp * dims.ep > 1 else None
    if dims.ep > 1:  # each pipeline of the ep ranks holds its slice of every layer's experts
        apply_expert_parallel(model, mesh.group("ep"), async_comm=ep_async)
    if dims.cp > 1:  # and of the cp ranks its zigzag chunks of every sequence
        apply_context_parallel(model, mesh.group("cp"))
    rank = mesh.rank("pp") if mesh else env.rank
    stages = split_for_dualpipev(model, rank, dims.pp)
    if mesh:  # sharded on the meta device, then each rank materializes its shards
        apply_fsdp_to_stages(
            stages, mesh, param_dtype=param_dtype, reshard_after_forward=reshard_after_forward
        )
    for stage in stages:
        stage.to_empty(device=env.device)
    model.init_weights(seed, skip_meta=True)
    # (Sharded, the stages compute in param_dtype: the executor reads it off FSDP2.)
    executor = DualPipeVExecutor(
        stages, rank, dims.pp, mesh.group("pp") if mesh else None,
        stats_reducer=router_stats_reducer(mesh) if mesh else None,
    )  # fmt: skip
    return PipelineRank(model, stages), executor, mesh


def _refuse_a_checkpoint_as_run_dir(run_dir: str) -> None:
    """Raises when `run_dir` is a checkpoint (a run's ``step_N``, a model-only one) or a
    run's ``checkpoints/`` directory: whoever gives one means to resume from it or start
    from its weights, and would get a new run from step 0 written in among its files."""
    path = Path(os.path.abspath(run_dir))
    if is_checkpoint(path):
        if path.parent.name != "checkpoints":  # a model-only one, or one moved out of its run
            what = "a checkpoint, not a run directory"
        else:
            run = path.parent.parent
            what = (
                f"the checkpoint {path.name} of the run in {run}, not a run directory: to "
                f"resume that run, give run_dir={run} (it resumes from its newest checkpoint)"
            )
        raise ValueError(
            f"run_dir ({run_dir!r}) is {what}; to start a new run from its weights, give "
            f"init_from={path} and a new run_dir"
        )
    if latest_checkpoint(path) is not None and latest_checkpoint(checkpoint_root(path)) is None:
        raise ValueError(
            f"run_dir ({run_dir!r}) is the checkpoints directory of the run in {path.parent}: "
            f"to resume that run, give run_dir={path.parent}"
        )


def _refuse_a_foreign_config_json(run_dir: str) -> None:
    """Raises when `run_dir` holds a config.json that no mt-train run wrote (a Hugging Face
    model directory, another project's): a run replaces it with its own. A directory with
    a ``checkpoints/`` directory is a run's, whatever its config.json holds."""
    path = Path(run_dir) / "config.json"
    if not path.is_file() or checkpoint_root(run_dir).is_dir():
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        saved = None
    if isinstance(saved, dict) and "model_family" in saved and "training" in saved:
        return
    if is_hf_dir(run_dir):
        whose = " (a Hugging Face model's)"
        fix = (
            f"to start a new run from its weights, give init_from={os.path.abspath(run_dir)} "
            "and a new run_dir"
        )
    else:
        whose, fix = "", "choose another run_dir"
    raise ValueError(
        f"run_dir ({run_dir!r}) holds a config.json mt-train did not write{whose}, which a run "
        f"would replace with its own; {fix}"
    )


def _open_datasets(
    cfg: JobConfig, data_dir: Path, is_main: bool = True
) -> tuple[TokenDataset, TokenDataset | None]:
    """The training corpus and, with validation enabled, the held-out one, checked
    against the model's vocabulary and each other's tokenization (`is_main`: the rank
    that warns)."""
    try:
        dataset = TokenDataset(
            data_dir, cfg.data.seq_len, seed=cfg.seed, on_exhausted=cfg.data.on_exhausted
        )
    except ValueError as e:
        raise ValueError(f"data.path: {e}") from None
    if dataset.vocab_size is not None and dataset.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"the corpus in {data_dir} uses a vocabulary of {dataset.vocab_size} tokens but "
            f"model.vocab_size is {cfg.model.vocab_size}; set model.vocab_size>="
            f"{dataset.vocab_size}"
        )
    val_dataset = None
    if cfg.validation.enabled:  # checked before the model is built
        try:
            val_dataset = TokenDataset(cfg.validation.path, cfg.data.seq_len, seed=cfg.seed)
        except ValueError as e:
            raise ValueError(f"validation.path: {e}") from None
        _check_same_tokenization(dataset, data_dir, val_dataset, cfg.validation.path)
        wanted = cfg.validation.steps * cfg.training.global_batch_size
        if wanted > val_dataset.num_samples and is_main:  # every rank would say it
            log.warning(
                "validation evaluates %d samples (validation.steps %d x global_batch_size %d) "
                "but %s holds %d of seq_len %d: some are evaluated more than once; lower "
                "validation.steps or give a larger held-out corpus",
                wanted, cfg.validation.steps, cfg.training.global_batch_size,
                cfg.validation.path, val_dataset.num_samples, cfg.data.seq_len,
            )  # fmt: skip
    return dataset, val_dataset


def _prepare_run_dir(run_dir: Path) -> TextIO:
    """Main rank: creates the run directory, locks it (`_lock_run_dir`), creates its
    checkpoint directory and removes what crashed saves left there (a torn one can be as
    large as a checkpoint); returns the open lock."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent is a file, no permission, ...
        raise ValueError(
            f"run_dir ({str(run_dir)!r}) cannot be created ({e}); choose another run_dir"
        ) from None
    lock = _lock_run_dir(run_dir)
    try:  # now, not at the first save after hours of steps
        checkpoint_root(run_dir).mkdir(exist_ok=True)
    except OSError as e:  # a file of that name, no permission, ...
        lock.close()
        raise ValueError(
            f"the checkpoint directory {checkpoint_root(run_dir)} cannot be created "
            f"({e}); move what is there away or choose another run_dir"
        ) from None
    try:
        clear_leftovers(checkpoint_root(run_dir))
    except BaseException:
        lock.close()
        raise
    return lock


def _resume_or_start(state: TrainState, run_dir: Path) -> None:
    """Resumes from the run_dir's newest checkpoint, else starts from `init_from` or the
    initialized weights; records the run's config (the end of `setup`)."""
    cfg, env, model = state.cfg, state.env, state.model
    latest = latest_checkpoint(checkpoint_root(run_dir))
    _check_every_rank_sees(latest, run_dir)
    for path, name in misnamed_checkpoints(checkpoint_root(run_dir)) if env.is_main else ():
        log.warning(
            "%s is a checkpoint that is not resumed: checkpoints are found by their step in 8 "
            "digits; if it is this run's, rename it to %s",
            path,
            name,
        )
    if latest is not None and not cfg.checkpoint.resume:
        # A fresh run here would mix its checkpoints and metrics with the earlier run's
        # (and retention, which keeps the highest steps, would delete the new ones).
        raise ValueError(
            f"checkpoint.resume=false but {run_dir} already holds checkpoints of a run (the "
            f"latest {latest.path.name}); choose a new run_dir, or resume with "
            "checkpoint.resume=true"
        )
    checkpoint = latest
    if checkpoint is not None:
        _resume(state, checkpoint)
    elif cfg.init_from:
        # Under the pipeline into the whole model, whose meta-device parameters (the other
        # ranks' stages) the loaders skip; the rank's stages share its modules.
        whole = model.whole if isinstance(model, PipelineRank) else model
        source_config = init_from_weights(whole, cfg.init_from)
        log.info("initialized the model from %s (fresh optimizer)", cfg.init_from)
        differences = init_config_differences(source_config, cfg.model)
        if differences and env.is_main:
            log.warning(
                "the model config differs from init_from %s; this run's config wins, so the "
                "model is not the source's (to match it, override %s): %s",
                cfg.init_from,
                " ".join(shell_override(f"model.{k}", v[0]) for k, v in differences.items()),
                ", ".join(f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in differences.items()),
            )
    with failing_together(f"writing {run_dir / 'config.json'}"):
        if env.is_main:
            write_text_durably(run_dir / "config.json", json.dumps(cfg.to_dict(), indent=2))


def _check_every_rank_sees(latest: Checkpoint | None, run_dir: Path) -> None:
    """Raises on every rank unless all ranks found the same newest checkpoint `latest`: with
    run_dir on node-local disks (or a file system that shows a rename to some nodes late),
    some ranks would resume and the others start afresh, their collectives mismatched."""
    seen = from_all_ranks(None if latest is None else latest.path.name)
    if len(set(seen)) == 1:
        return
    ranks: dict[str | None, list[int]] = {}
    for rank, name in enumerate(seen):
        ranks.setdefault(name, []).append(rank)
    described = "; ".join(
        f"{name or 'none'}: rank{'s' if found[1:] else ''} {', '.join(map(str, found[:4]))}"
        + (", ..." if found[4:] else "")
        for name, found in ranks.items()
    )
    raise ValueError(
        f"the ranks see different newest checkpoints in {checkpoint_root(run_dir)} "
        f"({described}): run_dir must be on a file system that every node shares and sees alike"
    )


def _lock_run_dir(run_dir: Path) -> TextIO:
    """Takes ``<run_dir>/.lock`` for this process, so that a second run started on the same
    run_dir (a job launched twice, a requeue while the first still runs) fails at once
    instead of resuming from the same checkpoint and overwriting the first run's
    checkpoints and metrics. The lock is an exclusive `flock`, which the OS drops when the
    process ends, a crash included; the file says who holds it.

    Args:
        run_dir: the run directory (it exists).

    Returns:
        The open lock file; closing it frees the run_dir.
    """
    path = run_dir / ".lock"
    try:
        lock = open(path, "a+")  # noqa: SIM115 (held for the run; closed by pretrain)
    except OSError as e:  # a read-only file system, no permission, ...
        raise ValueError(
            f"run_dir {run_dir} cannot be written ({e}); make it writable or choose another run_dir"
        ) from None
    try:
        holder = lock_or_holder(lock)
    except OSError as err:  # a filesystem without flock
        log.warning(
            "cannot lock %s (%s): make sure no other run uses this run_dir at the same time",
            path,
            err,
        )
        return lock
    if holder is not None:
        raise ValueError(
            f"run_dir {run_dir} is in use by another mt-train run ({holder}); wait for it "
            "to end or choose another run_dir"
        )
    write_holder(lock)
    return lock


def _warn_if_all_warmup(cfg: JobConfig) -> None:
    """Warn when the whole run is linear warm-up, with no decay (legal, but rarely meant)."""
    training = cfg.training
    if training.warmup_steps < training.max_steps:
        return
    log.warning(
        "training.warmup_steps (%d) >= training.max_steps (%d): the whole run is warm-up, "
        "the LR rises to %.3e (training.lr %.3e) and never decays; for it to reach "
        "training.lr and decay, set training.warmup_steps below %d (say %d)",
        training.warmup_steps,
        training.max_steps,
        lr_at(training.max_steps, training),
        training.lr,
        training.max_steps,
        training.max_steps // 10,
    )


def _warn_if_seq_len_exceeds_context(cfg: JobConfig) -> None:
    """Warn when ``data.seq_len`` is longer than the model's context: its
    ``max_position_embeddings``, or, with ``rope_scaling`` (YaRN, linear), ``factor`` ×
    ``original_max_position_embeddings`` (``max_position_embeddings`` where the dict has
    none, as `mt_models.layers.rope` reads it) when that is longer, as Qwen3's long-context
    YaRN setting leaves ``max_position_embeddings`` at 40960. A warning, not an error: RoPE
    computes any position, but a Hub config.json states the trained context there (inference
    engines cut sequences to it), and weights from ``init_from`` never saw positions past it."""
    seq_len, max_positions = cfg.data.seq_len, cfg.model.max_position_embeddings
    context, why = max_positions, f"model.max_position_embeddings ({max_positions})"
    scaling = cfg.model.rope_scaling or {}
    factor = scaling.get("factor") if rope_type_of(scaling) != "default" else None
    if factor is not None:
        original = scaling.get("original_max_position_embeddings") or max_positions
        if int(factor * original) > max_positions:
            context = int(factor * original)
            why = (
                f"{context} (model.rope_scaling factor {factor} × original_max_position_embeddings "
                f"{original}; model.max_position_embeddings {max_positions})"
            )
    if seq_len <= context:
        return
    log.warning(
        "data.seq_len (%d) is longer than the model's context, %s: a Hub config.json states "
        "the trained context there, inference engines cut sequences to it, and weights from "
        "init_from never saw later positions; raise model.max_position_embeddings to %d or "
        "lower data.seq_len to %d",
        seq_len,
        why,
        seq_len,
        context,
    )


def _log_default_corpus_build(path: Path) -> None:
    log.info(
        "data.path is empty: building the default corpus (this Python's standard library "
        "sources) into %s, once; later runs reuse it (set $MT_CACHE_DIR to move the cache)",
        path,
    )


def _resume(state: TrainState, checkpoint) -> None:
    # The data loader first: a changed data.* fails before minutes of loading tensors.
    # A damaged file raises naming it.
    saved_state = checkpoint.train_state(needed=("step", "data", "config"))
    _check_same_family(checkpoint, saved_state["config"], state.cfg)
    data_state = saved_state["data"]
    # Checked here to name the override (data.seq_len=N); mt-data names its own argument.
    saved_seq_len = data_state.get("seq_len") if isinstance(data_state, dict) else None
    if isinstance(saved_seq_len, int) and saved_seq_len != state.cfg.data.seq_len:
        raise ValueError(
            f"cannot resume from {checkpoint.path}: it was trained with data.seq_len="
            f"{saved_seq_len}, this run has data.seq_len={state.cfg.data.seq_len}; resume with "
            f"data.seq_len={saved_seq_len} or use a new run_dir"
        )
    try:
        state.dataset.load_state_dict(data_state)
    except ValueError as e:
        raise ValueError(
            f"cannot resume from {checkpoint.path}: {e}. The run's data.* values are in "
            "its train_state.json (config.data); use them, or a new run_dir"
        ) from None
    if state.val_dataset is not None:
        # The held-out batches are the run's own, drawn with its data seed (the checkpoint's,
        # as the training order is), not a changed `seed`: else val_loss jumps at the resume.
        state.val_dataset.load_state_dict({**state.val_start, "seed": state.dataset.seed})
        state.val_start = state.val_dataset.state_dict()
    saved = load_checkpoint(
        checkpoint, state.model, state.optimizer, _resume_fix(saved_state["config"], state.cfg)
    )
    if state.fp8_cache is not None:
        state.fp8_cache.invalidate()  # the weights were overwritten in place
    state.step = saved["step"]
    state.skipped_steps = saved.get("skipped_steps", 0)
    log.info("resumed from %s (step %d)", checkpoint.path, state.step)
    # Compare as JSON sees them (tuples and lists are one kind there).
    old = flatten(saved["config"])
    new = flatten(json.loads(json.dumps(state.cfg.to_dict())))
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if not state.env.is_main:
        return
    if changed:
        diff = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        log.warning("config differs from the checkpoint; the new config wins: %s", diff)
        if "seed" in changed:
            log.warning(
                "seed only seeds new runs: the data order, held-out batches and RNG state of a "
                "resumed run continue from the checkpoint (seed %r)", old.get("seed")
            )  # fmt: skip
        _warn_if_micro_batches_regroup_the_balancing_loss(state, old, new)
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


def _warn_if_micro_batches_regroup_the_balancing_loss(
    state: TrainState, old: dict[str, Any], new: dict[str, Any]
) -> None:
    """Warns when the resumed run groups the global batch into micro-batches of another
    size while the model's load-balancing loss is one per micro-batch (``global``): that
    loss, and so the gradient, then differs from the uninterrupted run's (a per-sequence
    loss, or none, does not depend on the grouping).

    Args:
        state: the resumed loop state.
        old: the checkpoint's config, flattened.
        new: this run's config, flattened.
    """
    key = "training.micro_batch_size"
    model = state.cfg.model
    coef = getattr(model, "router_aux_loss_coef", 0.0)
    if old.get(key) == new.get(key) or coef <= 0 or model.aux_loss_type != "global":
        return
    log.warning(
        "%s changed from %s to %s: the load-balancing loss (model.aux_loss_type='global', "
        "model.router_aux_loss_coef=%s) is computed over each micro-batch, so from step %d "
        "on this run differs from one that kept %s; to continue it exactly, keep %s=%s "
        "(any layout whose dp*ep divides it)",
        key, old.get(key), new.get(key), coef, state.step + 1, old.get(key), key, old.get(key),
    )  # fmt: skip


def _resume_fix(saved_config: Any, cfg: JobConfig) -> str | None:
    """The end of the error of a checkpoint whose tensors do not fit the run's model: the
    model.* overrides that give the checkpoint's tensors back (`tensor_config_differences`:
    not a changed rope_theta, which a resume may change), with their values; None when
    the configs do not tell (`load_checkpoint`'s own fix)."""
    try:
        saved_model = type(cfg.model)(**saved_config["model"])
    except (KeyError, TypeError, ValueError):  # a config this version cannot build
        return None
    differences = tensor_config_differences(saved_model, cfg.model)
    if not differences:
        return None
    return (
        "the run's model config differs from the checkpoint's in "
        + ", ".join(
            f"{k} ({json.dumps(v[0])} there, {json.dumps(v[1])} here)"
            for k, v in differences.items()
        )
        + ": to resume it, override "
        + " ".join(shell_override(f"model.{k}", v[0]) for k, v in differences.items())
        + ", or use a new run_dir"
    )


def _check_same_family(checkpoint, saved_config: Any, cfg: JobConfig) -> None:
    """Raises when the checkpoint's model is of another family than the run's (a recipe of
    another family: no model.* override can make the tensors match)."""
    from mt_train.recipes import RECIPES

    theirs = saved_config.get("model_family") if isinstance(saved_config, dict) else None
    ours = family_of(cfg.model)
    if theirs is None or theirs == ours:
        return
    recipes = [name for name, recipe in RECIPES.items() if family_of(recipe().model) == theirs]
    raise ValueError(
        f"checkpoint {checkpoint.path} holds a {theirs} model but this run builds a {ours} "
        f"one; resume with a {theirs} recipe ({', '.join(recipes)}) or use a new run_dir"
    )


def _check_same_tokenization(train: TokenDataset, train_dir, val: TokenDataset, val_dir) -> None:
    """Raises unless the validation corpus's manifest names the training corpus's
    vocabulary size and EOS id (its loss would mean nothing otherwise)."""
    for what, ours, theirs in (
        ("vocabulary size", train.vocab_size, val.vocab_size),
        ("EOS id", train.eos_id, val.eos_id),
    ):
        if ours is not None and theirs is not None and ours != theirs:
            raise ValueError(
                f"validation.path: the corpus in {val_dir} has {what} {theirs} but the "
                f"training corpus in {train_dir} has {ours}; build the validation corpus "
                "with the training corpus's tokenizer"
            )


def _peak_memory_gb(device: torch.device) -> float:
    """The step's peak CUDA memory allocated (stats reset as the step starts), or on CPU
    the process's largest resident size so far, in GB (10^9 bytes, as ``peak_memory_gb``
    and the console's ``GB`` say, and as the rest of mt-train counts GB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux


def next_microbatches(state: TrainState, dataset: TokenDataset | None = None) -> list[MicroBatch]:
    """Reads this rank's share of the next global batch, micro-batch by micro-batch.

    Each micro-batch holds `training.micro_batch_size` sequences over all dp·ep batch
    ranks; this rank gets its rows and, under context parallelism, its zigzag columns.

    Args:
        state: the loop state (the data loader advances).
        dataset: the loader to read (default: the training data).

    Returns:
        The micro-batches, on this rank's device.
    """
    cfg, dims = state.cfg, state.dims
    dataset = dataset if dataset is not None else state.dataset
    micro = cfg.training.micro_batch_size
    batch_rank = state.mesh.batch_rank if state.mesh else 0
    cp_rank = state.mesh.rank("cp") if state.mesh else 0
    ranges = zigzag_ranges(cfg.data.seq_len, dims.cp, cp_rank) if dims.cp > 1 else None
    microbatches = []
    position = dataset.state_dict()
    for _ in range(cfg.training.global_batch_size // micro):
        try:
            rows = dataset.take(
                micro, rank=batch_rank, world_size=dims.batch_ranks, token_ranges=ranges,
                return_positions=cfg.data.document_masking,
            )  # fmt: skip
        except DataExhausted:
            # The batch is not trained: leave its first micro-batches unread too, so a
            # checkpoint (or data.on_exhausted=repeat on resume) continues from here.
            dataset.load_state_dict(position)
            raise
        positions = None
        if cfg.data.document_masking:  # whole samples: the config refuses cp > 1
            rows, doc_positions = rows
            positions = torch.from_numpy(doc_positions[:, :-1]).to(state.device, non_blocking=True)
        tokens = torch.from_numpy(rows).to(state.device, non_blocking=True)
        if ranges is None:
            microbatches.append(MicroBatch(tokens[:, :-1], tokens[:, 1:], positions))
        else:
            inputs, labels, positions = split_sample(tokens, ranges)
            microbatches.append(MicroBatch(inputs, labels, positions))
    return microbatches


def _data_runs_out(state: TrainState) -> bool:
    """True when the run stops on exhausted data (``data.on_exhausted='stop'``) and the
    next global batch is not there, so the step just run is the run's last (nothing is
    read; every rank gets the same answer)."""
    dataset = state.dataset
    return dataset.on_exhausted == "stop" and not dataset.can_take(
        state.cfg.training.global_batch_size
    )


def train_step(
    state: TrainState, microbatches: list[MicroBatch], data_time_s: float = 0.0
) -> dict[str, Any]:
    """Runs one optimizer step on this rank's micro-batches.

    Args:
        state: the loop state (advanced in place).
        microbatches: from `next_microbatches`.
        data_time_s: how long reading them took; it counts in the step time and so in
            tokens/s and MFU (as torchtitan counts it), and is reported as ``data_time_s``.

    Returns:
        The step's metrics (global values, equal on every rank).
    """
    cfg = state.cfg
    if state.device.type == "cuda":  # peak_memory_gb is this step's (validation's apart)
        torch.cuda.reset_peak_memory_stats(state.device)
    start = time.perf_counter()
    step = state.step + 1
    lr = lr_at(step, cfg.training)
    set_lr(state.optimizer, lr)
    local_tokens = torch.stack([(mb.labels != IGNORE_INDEX).sum() for mb in microbatches])
    pipeline = state.pipeline
    # Under the pipeline the ranks of a replica hold the same tokens: counts and loss sums
    # are added over the replicas (the dp·cp·ep ranks of distinct tokens), not the world.
    replicas = state.mesh.group("dp_cp_ep") if pipeline is not None and state.mesh else None
    if pipeline is not None and replicas is None:  # one replica: the whole global batch
        global_num_tokens = int(local_tokens.sum())
    else:
        global_num_tokens = int(all_reduce(local_tokens.sum(), group=replicas))
    with state.autocast():
        if pipeline is not None:
            result = pipeline.step(microbatches, global_num_tokens, ignore_index=IGNORE_INDEX)
        else:
            result = run_microbatches(
                state.model, microbatches, global_num_tokens, ignore_index=IGNORE_INDEX,
                grad_reduce=cfg.parallel.grad_reduce,
            )  # fmt: skip
    if pipeline is not None:  # each gradient element lives on one rank of the world
        group = dist.group.WORLD
    else:
        group = state.mesh.group("dp_cp_ep") if state.mesh else None
    max_norm = cfg.training.grad_clip if cfg.training.grad_clip > 0 else math.inf
    grad_norm = clip_grad_norm(state.model.parameters(), max_norm, group)
    # The pipeline's result is its replica's, the same on every rank of the replica.
    if pipeline is not None and replicas is None:
        ce_sum = result.ce_sum
    else:
        ce_sum = all_reduce(result.ce_sum.to(state.device), group=replicas)
    loss = float(ce_sum) / global_num_tokens
    # loss and grad_norm are global (all-reduced), so every rank takes the same branch.
    if math.isfinite(loss) and math.isfinite(grad_norm):
        state.optimizer.step()
    elif cfg.training.on_nonfinite == "stop":
        state.optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(
            f"step {step}: the loss ({loss}) or gradient norm ({grad_norm}) is not finite; "
            "training.on_nonfinite='stop' ended the run without saving"
        )
    else:
        state.skipped_steps += 1
        if state.env.is_main:  # the values are global: every rank would say the same
            log.warning(
                "step %d: non-finite loss (%s) or grad norm (%s); step skipped",
                step, loss, grad_norm,
            )  # fmt: skip
    state.optimizer.zero_grad(set_to_none=True)
    if state.fp8_cache is not None:
        # Quantize afresh next step; FSDP2 and fused AdamW hide the update from the version check.
        state.fp8_cache.invalidate()
    if state.device.type == "cuda":
        torch.cuda.synchronize(state.device)
    elapsed = time.perf_counter() - start + data_time_s
    state.step = step
    state.losses.append(loss)
    num_tokens = cfg.training.global_batch_size * cfg.data.seq_len
    tokens_per_s = num_tokens / elapsed
    flops = state.flops_per_token * tokens_per_s
    measured_peak, spec_peak = state.peak_flops
    world = state.env.world_size
    return {
        "step": step,
        "loss": loss,
        "aux_loss": float(result.aux_loss),
        # Unweighted router terms (equal on every rank: their statistics are global).
        **result.losses,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / world,
        "tflops_per_device": flops / 1e12 / world,
        "mfu": flops / world / measured_peak if measured_peak else None,
        "mfu_spec": flops / world / spec_peak if spec_peak else None,
        "step_time_s": elapsed,
        "data_time_s": data_time_s,
        "peak_memory_gb": _peak_memory_gb(state.device),
        "skipped_steps": state.skipped_steps,
    }


def validate(state: TrainState) -> float:
    """Mean token loss on `validation.steps` held-out global batches (no gradients).

    The held-out loader restarts every time, so each evaluation sees the same batches.

    Args:
        state: the loop state (with `val_dataset`).

    Returns:
        Summed cross-entropy over all ranks divided by the labelled tokens.
    """
    assert state.val_dataset is not None, "validation is not configured"
    state.val_dataset.load_state_dict(state.val_start)
    ce_sum = torch.zeros((), dtype=torch.float64, device=state.device)
    num_tokens = torch.zeros((), dtype=torch.int64, device=state.device)
    # Under the pipeline the rank's stages, each micro-batch's loss on the last stage's rank
    # (zeros elsewhere, so the sum over the world adds up the replicas).
    pipeline = state.pipeline
    modules = list(state.model.stages) if pipeline is not None else [state.model]
    was_training = [module.training for module in modules]
    for module in modules:
        module.eval()
    with torch.no_grad(), state.autocast():
        for _ in range(state.cfg.validation.steps):
            microbatches = next_microbatches(state, state.val_dataset)
            if pipeline is not None:
                ce, count = pipeline.evaluate(microbatches, ignore_index=IGNORE_INDEX)
                ce_sum += ce
                num_tokens += count
                continue
            for mb in microbatches:
                kwargs = {} if mb.positions is None else {"position_ids": mb.positions}
                out = state.model.loss(mb.input_ids, mb.labels, ignore_index=IGNORE_INDEX, **kwargs)
                ce_sum += out.ce_sum.double()
                num_tokens += out.num_tokens
    for module, mode in zip(modules, was_training, strict=True):
        module.train(mode)
    # FSDP2 keeps a module's parameters gathered after its forward when it does not
    # reshard after forward (the root; every layer with parallel.reshard_after_forward=false)
    # until a backward reshards them, and none follows here: a checkpoint saved next read
    # the gathered tensors in place of the sharded ones the optimizer holds. Reshard (and
    # free the gathered copies) now.
    for module in (m for root in modules for m in root.modules()):
        if isinstance(module, FSDPModule):
            module.reshard()
    return float(all_reduce(ce_sum)) / max(int(all_reduce(num_tokens)), 1)


def _save(state: TrainState, writer: AsyncCheckpointer | None) -> None:
    cfg = state.cfg
    train_state = {
        "data": state.dataset.state_dict(),
        "skipped_steps": state.skipped_steps,
        "config": cfg.to_dict(),
    }
    root = checkpoint_root(cfg.run_dir)
    if writer is not None:
        _finish_pending_save(writer)
        writer.save(state.step, state.model, state.optimizer, train_state)
        log.info("saving checkpoint of step %d in the background", state.step)
        return
    checkpoint = save_checkpoint(
        root,
        state.step,
        state.model,
        state.optimizer,
        train_state,
        keep_last=cfg.checkpoint.keep_last,
    )
    log.info("saved checkpoint %s", checkpoint.path)


def _finish_pending_save(writer: AsyncCheckpointer | None) -> None:
    checkpoint = writer.wait() if writer is not None else None
    if checkpoint is not None:
        log.info("saved checkpoint %s", checkpoint.path)


def _complete_staged_save_alone(state: TrainState, writer: AsyncCheckpointer | None) -> None:
    """After a crash of a one-process run, completes the background save it had started.

    Its tensors were copied at its step, so the steps after it do not change it; without
    this, the crash left it a temporary directory and the resume went back a whole
    checkpoint interval. With more processes completing a save is collective and the
    others may be gone, so it stays unfinished there.
    """
    if writer is None or not writer.pending or state.env.world_size > 1:
        return
    try:
        _finish_pending_save(writer)
    except Exception as err:  # the crash's own error is the one to raise
        log.warning("the background save could not be completed after the crash: %s", err)


def _finish_written_save(state: TrainState, writer: AsyncCheckpointer | None) -> None:
    """Completes a background save once every rank has written its files, so a crash
    after that loses nothing (all ranks agree, as completing it is collective)."""
    if writer is None or not writer.pending:
        return
    unfinished = torch.tensor(0 if writer.written() else 1, device=state.device)
    if int(all_reduce(unfinished, "max")) == 0:
        _finish_pending_save(writer)


def pretrain(cfg: JobConfig, *, stream: TextIO | None = None) -> TrainState:
    """Trains to `training.max_steps`, resuming from the run directory when it can.

    Args:
        cfg: the resolved run config.
        stream: where console lines go (default stdout).

    Returns:
        The final loop state (`state.losses` holds this invocation's losses).
    """
    # A preemption during setup (minutes, for a large resume) stops the run before its
    # first step, exiting 0 with the last checkpoint kept, instead of killing it.
    during_setup = SimpleNamespace(signal_received=False)
    with stop_on_signals(during_setup, SCHEDULER_SIGNALS):
        state = setup(cfg)
        try:
            return _train(state, stream, during_setup)
        finally:
            if state.run_lock is not None:
                state.run_lock.close()  # the run_dir is free for the next run
                state.run_lock = None


def _train(
    state: TrainState, stream: TextIO | None, during_setup: SimpleNamespace | None = None
) -> TrainState:
    """The loop of `pretrain` on a set-up state; `during_setup` holds whether a signal
    came before the loop's own handlers were set."""
    cfg = state.cfg
    max_steps = cfg.training.max_steps
    if state.step >= max_steps and state.env.is_main:  # said once, not by every rank
        log.warning(
            "the run in %s is already at step %d (training.max_steps=%d); nothing to do. "
            "Raise training.max_steps to continue it.",
            cfg.run_dir,
            state.step,
            max_steps,
        )
    if state.step >= max_steps:
        write_exit_file(state)  # a clean end, for tools/launch/torchrun.sh
        return state
    metrics = None
    with failing_together("opening the metrics sinks"):  # a missing tensorboard, ...
        if state.env.is_main:
            sinks = build_sinks(
                cfg.run_dir, cfg.metrics.tensorboard, cfg.metrics.wandb_project, cfg.to_dict(),
                state.step,
            )  # fmt: skip
            metrics = MetricsLogger(
                cfg.run_dir, max_steps, state.step, cfg.log_every, stream, sinks
            )
    last_saved = state.step
    prof = cfg.profile
    profiler = StepProfiler(
        cfg.run_dir,
        state.env.rank,
        parse_trace_steps(prof.trace_steps),
        prof.memory_snapshot,
        prof.nvtx,
    )
    writer = (
        AsyncCheckpointer(checkpoint_root(cfg.run_dir), cfg.checkpoint.keep_last)
        if cfg.checkpoint.async_save
        else None
    )
    try:
        with stop_on_signals(state):
            if during_setup is not None and during_setup.signal_received:
                state.signal_received = True
            state.stop_requested = agree_to_stop(state)  # a signal during setup, on any rank
            while state.step < max_steps and not state.stop_requested:
                data_start = time.perf_counter()
                try:
                    microbatches = next_microbatches(state)
                except DataExhausted:
                    if state.env.is_main:  # every rank runs out at the same step
                        log.warning(
                            "the data ran out at step %d (data.on_exhausted='stop')", state.step
                        )
                    break
                # Read before the profiler starts (its start is neither data nor step time).
                data_time_s = time.perf_counter() - data_start
                with profiler.step(state.step + 1):
                    try:
                        step_metrics = train_step(state, microbatches, data_time_s)
                    except NonFiniteError as err:
                        _finish_pending_save(writer)  # the last good state is complete
                        last = latest_checkpoint(checkpoint_root(cfg.run_dir))
                        kept = (
                            f"the newest checkpoint is {last.path} (step {last.step})"
                            if last
                            else "there is no checkpoint yet"
                        )
                        raise NonFiniteError(
                            f"{err}, so {kept}. Rerun to resume from it (perhaps with a "
                            "lower training.lr), or set training.on_nonfinite=skip to drop "
                            "such steps"
                        ) from None
                val = cfg.validation
                if val.enabled and (
                    state.step % val.interval == 0
                    or state.step == max_steps
                    or _data_runs_out(state)  # the run's last step too
                ):
                    step_metrics["val_loss"] = validate(state)
                failure = None
                try:  # rank 0 alone: its failure must reach the others (agree_to_stop)
                    if metrics is not None:
                        metrics.log(step_metrics)
                except Exception as err:
                    failure = err
                state.stop_requested = agree_to_stop(state, failure)
                _finish_written_save(state, writer)
                interval = cfg.checkpoint.interval
                if interval and state.step % interval == 0:
                    _save(state, writer)
                    last_saved = state.step
                    if not state.stop_requested:  # (agreed, so every rank asks or none)
                        # A signal during the save: it holds this step, so stop now
                        # rather than train and save once more within torchrun's grace.
                        state.stop_requested = agree_to_stop(state)
            # Still under the handlers: a repeated SIGTERM (the scheduler's, then
            # torchrun's forward) during this save must not kill it half-written.
            if state.step != last_saved:
                _save(state, writer)
            _finish_pending_save(writer)
        write_exit_file(state)
    except Exception:
        _complete_staged_save_alone(state, writer)
        raise
    finally:
        try:
            profiler.close()
        finally:  # the sinks' last events and W&B's finish, whatever the profiler did
            if metrics is not None:
                metrics.close()
    return state
