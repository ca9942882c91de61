"""Typed run configuration: one small dataclass per concern, validated at construction.

A run's configuration is a `JobConfig`: a recipe (a Python function in
`mt_train.recipes`) returns one, a TOML file and ``key=value`` overrides adjust it
(`mt_train.overrides`), and the result is rebuilt from scratch so every
`__post_init__` check runs on the final values.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from mt_models import MODEL_FAMILIES
from mt_parallel.pipeline import MICRO_BATCH_TOKEN_LIMIT
from mt_parallel.schedule import GRAD_REDUCE


@dataclass
class DataConfig:
    """Where training tokens come from.

    Attributes:
        path: a directory of `.bin`/`.idx` shards built by `mt-data build` (a leading ``~``
            is the home directory); empty means the embedded default corpus (the Python
            standard library sources).
        seq_len: tokens per training sequence; longer than the model's context
            (model.max_position_embeddings, or what model.rope_scaling extends it to) warns
            at setup.
        on_exhausted: "repeat" starts a new epoch with a new shuffle, "stop" ends
            the run when the data runs out.
        document_masking: attention stays inside each document of a packed sample and
            positions (RoPE) restart at each document's first token, as Megatron's
            `--reset-position-ids --reset-attention-mask`; off, a sample attends across
            the documents packed into it. Documents are the corpus index's (mt-data's
            `take(return_positions=True)`). Needs context parallelism off
            (parallel.cp=1). On GPU the masked attention runs through flex_attention
            instead of the plain causal kernel where flex compiles (head dims a power of
            two, 16 to 256), else through SDPA with a dense [S, S] mask (DeepSeek's
            192). MFU still counts every token's full causal context.
    """

    path: str = ""
    seq_len: int = 256
    on_exhausted: str = "repeat"
    document_masking: bool = False

    def __post_init__(self) -> None:
        _check_path(
            "data.path", self.path, "give a corpus directory built by mt-data build "
            "(data.path=DIR) or data.path='' for the embedded default corpus"
        )  # fmt: skip
        self.path = os.path.expanduser(self.path)  # as JobConfig.run_dir: no shell expands it
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len ({self.seq_len}) must be at least 2")
        if self.on_exhausted not in ("repeat", "stop"):
            raise ValueError(
                f"data.on_exhausted ({self.on_exhausted!r}) must be 'repeat' or 'stop'"
            )


@dataclass
class TrainingConfig:
    """The optimization: steps, batch, AdamW, LR schedule and precision.

    Attributes:
        max_steps: optimizer steps of the whole run.
        global_batch_size: sequences per optimizer step, over all ranks; fixed
            whatever the parallel layout.
        micro_batch_size: sequences per forward/backward, counted over all dp·ep batch
            ranks (each runs micro_batch_size / (dp·ep)), so a micro-batch, and its
            load-balancing loss, holds the same sequences whatever the layout.
        lr: peak learning rate.
        min_lr_ratio: the cosine decay ends at lr * min_lr_ratio.
        warmup_steps: linear warm-up steps from 0 to lr.
        weight_decay: AdamW decoupled weight decay, on weight matrices only (embeddings and
            routers included; not norms, biases or GPT-OSS's attention sinks).
        beta1: AdamW first-moment decay.
        beta2: AdamW second-moment decay.
        eps: AdamW epsilon.
        grad_clip: clip the global gradient norm to this; 0 disables clipping.
        dtype: "auto" (BF16 autocast on GPU, FP32 on CPU), "float32" or "bfloat16".
        device: "auto", "cpu" or "cuda".
        num_threads: CPU threads for intra-op parallelism (0 leaves PyTorch's
            default; at most the cores the process may use, checked at setup); fix it for
            bit-exact resume on CPU.
        on_nonfinite: what a non-finite loss or gradient norm (on any rank) does, checked
            before the optimizer step: "skip" drops the step's update and counts it
            (`skipped_steps` in the metrics); "stop" ends the run with an error and keeps
            the last good checkpoint as the newest.
    """

    max_steps: int = 100
    global_batch_size: int = 8
    micro_batch_size: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    dtype: str = "auto"
    device: str = "auto"
    num_threads: int = 0
    on_nonfinite: str = "skip"

    def __post_init__(self) -> None:
        if self.on_nonfinite not in ("skip", "stop"):
            raise ValueError(
                f"training.on_nonfinite ({self.on_nonfinite!r}) must be 'skip' or 'stop'"
            )
        if self.max_steps < 1:
            raise ValueError(f"training.max_steps ({self.max_steps}) must be >= 1")
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            raise ValueError(
                f"training.global_batch_size ({self.global_batch_size}) and "
                f"training.micro_batch_size ({self.micro_batch_size}) must be >= 1"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"training.micro_batch_size ({self.micro_batch_size}) must divide "
                f"training.global_batch_size ({self.global_batch_size})"
            )
        if not 0 < self.lr < math.inf or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(
                f"training.lr ({self.lr}) must be finite and > 0 and training.min_lr_ratio "
                f"({self.min_lr_ratio}) within [0, 1]"
            )
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and 0 < self.eps < math.inf):
            raise ValueError(
                f"training.beta1 ({self.beta1}) and training.beta2 ({self.beta2}) must be in "
                f"[0, 1) and training.eps ({self.eps}) finite and > 0"
            )
        if self.num_threads < 0 or not 0 <= self.weight_decay < math.inf:
            raise ValueError(
                f"training.num_threads ({self.num_threads}) and training.weight_decay "
                f"({self.weight_decay}) must be >= 0 (num_threads 0: PyTorch's default)"
            )
        if self.warmup_steps < 0 or not 0 <= self.grad_clip < math.inf:  # NaN fails too
            raise ValueError(
                f"training.warmup_steps ({self.warmup_steps}) must be >= 0 and "
                f"training.grad_clip ({self.grad_clip}) finite and >= 0 (0 disables clipping)"
            )
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(
                f"training.dtype ({self.dtype!r}) must be 'auto', 'float32' or 'bfloat16'"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"training.device ({self.device!r}) must be 'auto', 'cpu' or 'cuda'")


@dataclass
class PrecisionConfig:
    """Low-precision GEMMs of the run (ARCHITECTURE.md §4, §7).

    Attributes:
        fp8: block-scaled FP8 training (DeepSeek-V3's recipe, `mt_ops.convert_to_fp8`):
            forward, input-gradient and weight-gradient GEMMs of the attention projections,
            dense MLPs and experts run in FP8 (E4M3, 1×128 activation and 128×128 weight
            scales); embedding, output head, router, norms and attention scores keep
            `training.dtype`, and master weights stay FP32. Layers whose in/out features are
            not multiples of 16 stay unconverted. Each weight is quantized once per optimizer
            step (under FSDP from the gathered BF16 weight). Needs a GPU with FP8 tensor
            cores (compute capability 8.9 or newer: H100/H200, L40S, B200); on CPU the
            GEMMs run through mt-ops' exact emulation, slowly (tests and debugging).
    """

    fp8: bool = False


@dataclass
class CheckpointConfig:
    """When to save and whether to resume.

    Attributes:
        interval: save every this many steps (0: only at the end of the run).
        keep_last: complete checkpoints to keep (older ones are deleted).
        resume: resume from the newest complete checkpoint in the run directory (false
            refuses a run directory that already holds checkpoints).
        async_save: write checkpoints in a background thread while training goes on
            (the tensors are copied to CPU memory first; the checkpoint becomes complete,
            renamed into place, at the first step boundary after every rank's files are
            written).
    """

    interval: int = 0
    keep_last: int = 2
    resume: bool = True
    async_save: bool = False

    def __post_init__(self) -> None:
        if self.interval < 0 or self.keep_last < 1:
            raise ValueError(
                f"checkpoint.interval ({self.interval}) must be >= 0 and "
                f"checkpoint.keep_last ({self.keep_last}) >= 1"
            )


@dataclass
class ValidationConfig:
    """Loss on held-out data every few steps.

    The held-out data is a separate corpus directory (build it with `mt-data build` from
    documents kept out of training): a slice of the training corpus is not used, because
    packed samples span document boundaries and the shuffled loader would still visit it.

    Attributes:
        path: a corpus directory (a leading ``~`` is the home directory); empty disables
            validation.
        interval: evaluate every this many steps and after the last (`training.max_steps`,
            or the last the data allows under `data.on_exhausted='stop'`); set exactly when
            `path` is (0 with a path, or a positive interval without one, is an error).
        steps: global batches (of `training.global_batch_size` sequences) per
            evaluation; the same batches every time, so values are comparable (a
            resumed run keeps its checkpoint's seed for them, as for its data order).
    """

    path: str = ""
    interval: int = 0
    steps: int = 1

    def __post_init__(self) -> None:
        _check_path(
            "validation.path", self.path, "give a held-out corpus directory "
            "(validation.path=DIR) or validation.path='' to turn validation off"
        )  # fmt: skip
        self.path = os.path.expanduser(self.path)  # as JobConfig.run_dir: no shell expands it
        if self.interval < 0 or self.steps < 1:
            raise ValueError(
                f"validation.interval ({self.interval}) must be >= 0 and validation.steps "
                f"({self.steps}) >= 1"
            )
        if self.interval and not self.path:
            raise ValueError(
                f"validation.interval ({self.interval}) needs validation.path, a held-out "
                "corpus directory (mt-data build); set it or validation.interval=0"
            )
        if self.path and not self.interval:
            raise ValueError(
                f"validation.path ({self.path!r}) is set but validation.interval is 0, so "
                "no validation would run; set validation.interval=N (evaluate every N "
                "steps) or validation.path=''"
            )

    @property
    def enabled(self) -> bool:
        """True when validation runs."""
        return bool(self.interval and self.path)


@dataclass
class MetricsConfig:
    """Where metrics go besides the console and ``<run_dir>/metrics.jsonl``.

    Attributes:
        tensorboard: also write TensorBoard event files to ``<run_dir>/tensorboard``
            (needs ``pip install mt-train[tensorboard]``).
        wandb_project: also log to this Weights & Biases project; empty disables it
            (needs ``pip install mt-train[wandb]``). A resumed run logs to the same W&B
            run, whose id is kept in ``<run_dir>/wandb_run_id``.
    """

    tensorboard: bool = False
    wandb_project: str = ""

    def __post_init__(self) -> None:
        if self.wandb_project and not self.wandb_project.strip():  # W&B takes ' ' offline
            raise ValueError(
                f"metrics.wandb_project ({self.wandb_project!r}) is blank; name a W&B project "
                "(metrics.wandb_project=my-project) or turn W&B off with "
                "metrics.wandb_project=''"
            )


@dataclass
class ProfileConfig:
    """Profiling (files under ``<run_dir>/profile/``, see `mt_train.profiling`).

    Attributes:
        trace_steps: "a,b" writes a PyTorch profiler trace of steps a..b; "" for none.
        memory_snapshot: record CUDA allocations and dump a snapshot after the traced
            steps (or at the end of the run).
        nvtx: an NVTX range around every step, for Nsight Systems.
    """

    trace_steps: str = ""
    memory_snapshot: bool = False
    nvtx: bool = False

    def __post_init__(self) -> None:
        from mt_train.profiling import parse_trace_steps

        parse_trace_steps(self.trace_steps)


@dataclass
class ParallelConfig:
    """The parallel layout (ARCHITECTURE.md §5) and how collectives behave.

    Attributes:
        pp: pipeline-parallel size; > 1 runs mt-parallel's DualPipeV executor (with data,
            context and expert parallelism: world_size = pp·dp·cp·ep), at least 2·pp
            micro-batches per step, each pipeline's under 2**24 tokens (see
            `check_pipeline_micro_batch_tokens`).
        dp: data-parallel (FSDP) size; -1 takes world_size // (pp·cp·ep).
        cp: context-parallel size (zigzag sequence chunks).
        ep: expert-parallel size; must divide the number of experts.
        reshard_after_forward: FSDP2 frees gathered layer weights after forward.
        ep_comm: "async" overlaps the expert-parallel all-to-alls (a side CUDA stream on
            GPU); "sync" runs each to completion in turn (a fallback; same numbers).
        timeout_s: a collective that waits longer than this ends the run with an error.
        grad_reduce: "microbatch" reduce-scatters FSDP2 gradients after every micro-batch
            (sharded gradient memory); "step" once per step, after the last micro-batch
            (less traffic; holds the rank's unsharded gradients between micro-batches).
            With pp > 1 the pipeline always reduces once per step (its weight gradients
            arrive after the backward passes), whatever this says.
    """

    pp: int = 1
    dp: int = -1
    cp: int = 1
    ep: int = 1
    reshard_after_forward: bool = True
    ep_comm: str = "async"
    timeout_s: float = 600.0
    grad_reduce: str = "microbatch"

    def __post_init__(self) -> None:
        for name in ("pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} ({getattr(self, name)}) must be >= 1")
        if self.dp < 1 and self.dp != -1:
            raise ValueError(f"parallel.dp ({self.dp}) must be >= 1, or -1 to fill the world")
        if self.ep_comm not in ("async", "sync"):
            raise ValueError(f"parallel.ep_comm ({self.ep_comm!r}) must be 'async' or 'sync'")
        if not 0 < self.timeout_s < math.inf:  # NaN fails too
            raise ValueError(f"parallel.timeout_s ({self.timeout_s}) must be finite and > 0")
        if self.grad_reduce not in GRAD_REDUCE:
            raise ValueError(
                f"parallel.grad_reduce ({self.grad_reduce!r}) must be one of {GRAD_REDUCE}"
            )


@dataclass
class JobConfig:
    """Everything a run needs; `model` is the config dataclass of one model family.

    Attributes:
        model: a model-family config (for example `mt_models.Qwen3MoeConfig`).
        run_dir: where metrics, checkpoints and the resolved config go; not empty or blank (use
            "." for the current directory). A leading ``~`` is the home directory here and
            in `init_from` (no shell expands it in a TOML file).
        seed: seeds weight initialization and data shuffling.
        log_every: print a console line every this many steps (and at the last step and
            every validation); metrics.jsonl gets every step.
        init_from: start a new run from these weights: a Hugging Face directory
            (config.json + safetensors) or an mt checkpoint (a ``step_N`` directory or
            one written by ``mt-train convert hf-to-mt``). Model weights only; the
            optimizer starts fresh and the model config must match the source's
            (shapes raise; other differences, such as ``rope_theta``, warn).
            Ignored when the run directory has a checkpoint to resume.
    """

    model: Any
    run_dir: str = "runs/debug"
    seed: int = 0
    log_every: int = 1
    init_from: str = ""
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)

    def __post_init__(self) -> None:
        _check_path(
            "run_dir", self.run_dir,
            "set run_dir=runs/NAME (or run_dir=. for the current directory)",
        )  # fmt: skip
        _check_path(
            "init_from", self.init_from, "give a Hugging Face directory or an mt checkpoint "
            "(init_from=DIR) or init_from='' to start from fresh weights"
        )  # fmt: skip
        # Not a directory named "~" in the current one (`rm -rf ~` would then clean it up).
        self.run_dir = os.path.expanduser(self.run_dir)
        self.init_from = os.path.expanduser(self.init_from)
        if family_of(self.model) is None:
            raise ValueError(
                f"model ({type(self.model).__name__}) is not a known model family config; "
                f"known: {sorted(MODEL_FAMILIES)}"
            )
        _check_finite(dataclasses.asdict(self))
        if not self.run_dir:  # Path("") is the current directory
            raise ValueError(
                f"run_dir ({self.run_dir!r}) is empty, which would put checkpoints and "
                "metrics in the current directory; set run_dir=runs/NAME (or run_dir=. to "
                "mean the current directory)"
            )
        if self.log_every < 1:
            raise ValueError(f"log_every ({self.log_every}) must be >= 1")
        if self.seed < 0:  # numpy's shuffle takes no negative seed
            raise ValueError(f"seed ({self.seed}) must be >= 0")
        from mt_train.profiling import parse_trace_steps

        trace_steps = parse_trace_steps(self.profile.trace_steps)
        if trace_steps is not None and trace_steps[0] > self.training.max_steps:
            raise ValueError(
                f"profile.trace_steps ({self.profile.trace_steps!r}) starts after "
                f"training.max_steps ({self.training.max_steps}), so no step would be traced; "
                f"choose steps from 1 to {self.training.max_steps}"
            )
        if self.data.document_masking and self.parallel.cp > 1:
            raise ValueError(
                f"data.document_masking needs parallel.cp=1 (got {self.parallel.cp}): the "
                "context-parallel attention masks by global position only; turn one of them off"
            )
        if self.parallel.pp > 1:
            self._check_pipeline()

    def _check_pipeline(self) -> None:
        """Refuses too few micro-batches or layers for the pipeline's (parallel.pp > 1)
        schedule, and micro-batches it cannot count (with parallel.dp given; dp = -1 is
        known only with the world size, and setup checks then)."""
        pp, training = self.parallel.pp, self.training
        micro_batches = training.global_batch_size // max(training.micro_batch_size, 1)
        if micro_batches < 2 * pp:
            raise ValueError(
                f"parallel.pp={pp} needs at least 2*pp = {2 * pp} micro-batches per step "
                f"(DualPipeV's schedule), but training.global_batch_size "
                f"({training.global_batch_size}) / training.micro_batch_size "
                f"({training.micro_batch_size}) = {micro_batches}; raise "
                f"training.global_batch_size to at least {2 * pp * training.micro_batch_size} "
                "or lower training.micro_batch_size"
            )
        layers = self.model.num_hidden_layers
        if layers < 2 * pp:
            raise ValueError(
                f"parallel.pp={pp} cuts the model into 2*pp = {2 * pp} stages of at least one "
                f"layer, but model.num_hidden_layers is {layers}; use parallel.pp <= "
                f"{max(layers // 2, 1)} or more layers"
            )
        if self.parallel.dp != -1:
            check_pipeline_micro_batch_tokens(self, self.parallel.dp)

    def to_dict(self) -> dict[str, Any]:
        """Returns the config as nested plain data, with the model family named."""
        out = dataclasses.asdict(self)
        out["model_family"] = family_of(self.model)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        """Builds (and so validates) a config from `to_dict()` output."""
        data = dict(data)
        family = data.pop("model_family")
        model_cls = MODEL_FAMILIES[family][0]
        return cls(
            model=_build_model_config(model_cls, data.pop("model")),
            data=_build(DataConfig, data.pop("data")),
            training=_build(TrainingConfig, data.pop("training")),
            checkpoint=_build(CheckpointConfig, data.pop("checkpoint")),
            parallel=_build(ParallelConfig, data.pop("parallel")),
            # Absent from checkpoints written before these sections existed.
            validation=_build(ValidationConfig, data.pop("validation", {})),
            metrics=_build(MetricsConfig, data.pop("metrics", {})),
            profile=_build(ProfileConfig, data.pop("profile", {})),
            precision=_build(PrecisionConfig, data.pop("precision", {})),
            **data,
        )


def check_pipeline_micro_batch_tokens(cfg: JobConfig, dp: int) -> None:
    """Raises ValueError when parallel.pp > 1 and one pipeline's micro-batch would hold
    2**24 tokens or more: DualPipeV sends token counts as fp32 (exact below that) and its
    executor refuses such a batch at the first step, after the model is built.

    The executor sees training.micro_batch_size / (dp·ep) sequences of data.seq_len / cp
    tokens. A layout those do not divide is left to the checks that refuse it.

    Args:
        cfg: the run config.
        dp: the data-parallel size, resolved (parallel.dp, or what -1 derives).
    """
    par, micro, seq_len = cfg.parallel, cfg.training.micro_batch_size, cfg.data.seq_len
    batch_ranks = dp * par.ep
    if par.pp == 1 or micro % batch_ranks or seq_len % par.cp:
        return
    sequences, seq = micro // batch_ranks, seq_len // par.cp
    if sequences * seq < MICRO_BATCH_TOKEN_LIMIT:
        return
    limit = MICRO_BATCH_TOKEN_LIMIT
    # The largest micro_batch_size (a multiple of dp·ep) and seq_len (of 2·cp under context
    # parallelism) that fit, the other kept.
    fixes = []
    if (limit - 1) // seq:
        fixes.append(f"training.micro_batch_size to at most {(limit - 1) // seq * batch_ranks}")
    step = 2 * par.cp if par.cp > 1 else 1
    fixes.append(f"data.seq_len to at most {(limit - 1) // sequences * par.cp // step * step}")
    raise ValueError(
        f"parallel.pp={par.pp}: each pipeline's micro-batch holds training.micro_batch_size "
        f"({micro}) / (parallel.dp * parallel.ep = {dp}*{par.ep}) = {sequences} sequences of "
        f"data.seq_len ({seq_len}) / parallel.cp ({par.cp}) = {seq} tokens = "
        f"{sequences * seq} tokens; the pipeline sends token counts as fp32, exact below "
        f"2**24 ({limit}); lower {' or '.join(fixes)}"
    )


def _build(cls: type, values: dict[str, Any]) -> Any:
    return cls(**values)


def _build_model_config(cls: type, values: dict[str, Any]) -> Any:
    """Builds a family config; its errors name fields as the keys are written
    (``model.num_key_value_heads (3) must divide model.num_attention_heads (4)``; mt-models
    knows no ``model.`` section), and start ``model:`` when no field leads."""
    # Before mt-models does: a rope_scaling value is then model.rope_scaling.factor, the key
    # an override writes (mt-models says 'rope_scaling factor').
    _check_finite(values, "model")
    try:
        return cls(**values)
    except ValueError as err:
        names = "|".join(f.name for f in dataclasses.fields(cls))
        # Every field the message names, not inside a word, a dotted key or a quoted value.
        text = re.sub(rf"(?<![\w.'\"])({names})\b", r"model.\1", str(err))
        raise ValueError(text if text.startswith("model.") else f"model: {text}") from None


def _check_path(key: str, value: str, fix: str) -> None:
    """Raises ValueError naming `key` when the path `value` can only be a mistake: blank
    (whitespace only; empty keeps the meaning its key documents) or holding a NUL character
    (no file system takes one; the OS error named no key). `fix` ends the message."""
    if value and not value.strip():  # Path('  ') is a directory named '  '
        raise ValueError(f"{key} ({value!r}) is blank; {fix}")
    if "\0" in value:
        raise ValueError(f"{key} ({value!r}) contains a NUL character, which no path can; {fix}")


def _check_finite(data: Any, prefix: str = "") -> None:
    """Raises ValueError naming the dotted key of the first NaN or infinite number in nested
    plain data: NaN trains on NaN, and neither is JSON (config.json)."""
    non_finite = _first_non_finite(data, prefix)
    if non_finite is not None:
        key, value = non_finite
        raise ValueError(f"{key} ({value}) must be a finite number (NaN and infinity are refused)")


def _first_non_finite(data: Any, prefix: str = "") -> tuple[str, float] | None:
    """The dotted key and value of the first NaN or infinite float in nested plain data
    (dicts, lists), or None."""
    if isinstance(data, float):
        return None if math.isfinite(data) else (prefix, data)
    if isinstance(data, dict):
        items = ((f"{prefix}.{k}" if prefix else str(k), v) for k, v in data.items())
    elif isinstance(data, (list, tuple)):
        items = ((f"{prefix}[{i}]", v) for i, v in enumerate(data))
    else:
        return None
    for key, value in items:
        found = _first_non_finite(value, key)
        if found is not None:
            return found
    return None


def family_of(model_config: Any) -> str | None:
    """Returns the registry name of a model config's family, or None."""
    for name, (config_cls, _) in MODEL_FAMILIES.items():
        if isinstance(model_config, config_cls):
            return name
    return None
