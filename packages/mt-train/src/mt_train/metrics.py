"""Per-step metrics: one console line with a progress bar, ``metrics.jsonl``, and
optionally TensorBoard (``mt-train[tensorboard]``) and Weights & Biases (``mt-train[wandb]``).

Peak FLOP/s used for MFU: the measured dense BF16 matmul rate of an H200 (794 TFLOP/s,
ARCHITECTURE.md §8) and the vendor's spec (989 TFLOP/s for the SXM parts H100 and H200);
the PCIe and NVL parts have lower specs and no measured rate here (``mfu`` is then left
out, ``mfu_spec`` kept). No MFU is reported on CPU.

``metrics.jsonl`` is strict JSON, one object per line: a number that is not finite (the
loss or gradient norm of a step skipped with ``training.on_nonfinite=skip``) is written
as ``null``, since JSON has no NaN or Infinity and jq or ``JSON.parse`` refuse them;
``skipped_steps`` counts the steps skipped so far.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from mt_train.distributed import first_line
from mt_train.files import write_text_durably

# Device-name part → (measured, spec) dense BF16 FLOP/s; the first match wins, so the
# PCIe and NVL parts come before the SXM names they contain.
PEAK_FLOPS = {
    "H100 PCIe": (None, 756e12),
    "H100 NVL": (None, 835e12),
    "H200 NVL": (None, 835e12),
    "H200": (794e12, 989e12),
    "H100": (794e12, 989e12),
}
_BAR_WIDTH = 20
log = logging.getLogger("mt_train")


def peak_flops(device_name: str) -> tuple[float | None, float | None]:
    """Returns (measured, spec) dense BF16 peak FLOP/s for a device name, or Nones."""
    for key, peaks in PEAK_FLOPS.items():
        if key in device_name:
            return peaks
    return None, None


def _format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class MetricsLogger:
    """Writes one JSON object per step to ``metrics.jsonl`` and a console line.

    Args:
        run_dir: the run directory; ``metrics.jsonl`` is created (or appended) there.
        max_steps: the run's last step, for the progress bar and ETA.
        start_step: the step the run (re)starts from; lines of later steps left by an
            interrupted earlier run are dropped, so the file has one line per step.
        log_every: print a console line every this many steps (always the last, and
            every step that carries a ``val_loss``).
        stream: where console lines go.
        sinks: more writers with ``log(metrics)`` and ``close()`` (see `build_sinks`).
    """

    def __init__(
        self,
        run_dir: str | Path,
        max_steps: int,
        start_step: int = 0,
        log_every: int = 1,
        stream: TextIO | None = None,
        sinks: list[Any] | None = None,
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.max_steps = max_steps
        self.start_step = start_step
        self.log_every = log_every
        self.stream = stream or sys.stdout
        self.sinks = list(sinks or [])
        self._start_time = time.perf_counter()
        try:
            self._truncate_after(start_step)
            self._file = open(self.path, "a")  # noqa: SIM115 (closed by close())
        except OSError as err:  # a directory of that name, no permission, a full disk
            for sink in self.sinks:  # they are this logger's to close
                sink.close()
            raise ValueError(
                f"the metrics file {self.path} cannot be written ({err.strerror or err}); "
                "move what is there away, make it writable, or choose another run_dir"
            ) from None

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a torn last line from a crash
        write_text_durably(self.path, "".join(line + "\n" for line in kept))

    def log(self, metrics: dict[str, Any]) -> None:
        """Records one step's metrics (must contain `step`)."""
        self._file.write(json.dumps(_finite_or_none(metrics), allow_nan=False) + "\n")
        self._file.flush()
        for sink in self.sinks:
            sink.log(metrics)
        step = metrics["step"]
        # A validation's line is printed whatever log_every (as Megatron prints each one).
        if step % self.log_every == 0 or step == self.max_steps or "val_loss" in metrics:
            print(self._console_line(metrics), file=self.stream, flush=True)

    def _console_line(self, m: dict[str, Any]) -> str:
        step = m["step"]
        frac = step / self.max_steps
        filled = int(round(frac * _BAR_WIDTH))
        bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
        done = step - self.start_step
        elapsed = time.perf_counter() - self._start_time
        eta = elapsed / done * (self.max_steps - step) if done > 0 else 0.0
        width = len(str(self.max_steps))
        parts = [
            f"step {step:>{width}}/{self.max_steps} [{bar}] {frac:4.0%}",
            f"loss {m['loss']:.4f}",
            f"aux {m['aux_loss']:.4f}",
            f"lr {m['lr']:.2e}",
            f"gnorm {m['grad_norm']:.3f}",
            f"{m['tokens_per_s']:,.0f} tok/s",
        ]
        if m.get("val_loss") is not None:
            parts.insert(2, f"val {m['val_loss']:.4f}")
        if m.get("mfu") is not None:
            parts.append(f"mfu {m['mfu']:.1%}")
        if m.get("peak_memory_gb") is not None:
            parts.append(f"mem {m['peak_memory_gb']:.1f}GB")
        parts.append(f"eta {_format_duration(eta)}")
        return " | ".join(parts)

    def close(self) -> None:
        """Closes the metrics file and the sinks."""
        self._file.close()
        for sink in self.sinks:
            sink.close()


def _finite_or_none(value: Any) -> Any:
    """`value` with every non-finite float (in dicts and lists too) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v) for k, v in metrics.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class TensorBoardSink:
    """Writes every numeric metric as a scalar under ``<run_dir>/tensorboard``.

    Events of steps after `start_step`, left by an interrupted earlier invocation, are
    purged (as ``metrics.jsonl`` drops their lines), so the resumed run's steps are not
    drawn twice.
    """

    def __init__(self, run_dir: str | Path, start_step: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ValueError(
                "metrics.tensorboard=true needs the tensorboard package; "
                "pip install 'mt-train[tensorboard]' or set metrics.tensorboard=false"
            ) from err
        log_dir = Path(run_dir) / "tensorboard"
        try:
            self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1)
        except OSError as err:  # a file of that name, no permission
            raise ValueError(
                f"metrics.tensorboard=true: the event file directory {log_dir} cannot be "
                f"created ({err.strerror or err}); move what is there away, or set "
                "metrics.tensorboard=false"
            ) from None

    def log(self, metrics: dict[str, Any]) -> None:
        """Adds one step's scalars."""
        for key, value in _scalars(metrics).items():
            self._writer.add_scalar(key, value, metrics["step"])

    def close(self) -> None:
        """Flushes and closes the event file."""
        self._writer.close()


class WandbSink:
    """Logs every numeric metric to a Weights & Biases run (resumed by run directory).

    The run's W&B id is kept in ``<run_dir>/wandb_run_id``, written by the first
    invocation, so a resumed run keeps logging to the same W&B run.

    W&B keeps only increasing steps and cannot purge as TensorBoard does: when the
    interrupted invocation had logged past the checkpoint the run resumes from, the redone
    steps below W&B's next step (``run.starting_step``) are not sent (W&B would drop each
    with a warning of its own); one warning says which, and that W&B keeps the earlier
    invocation's values for them while ``metrics.jsonl`` has the redone ones. An offline
    run does not know the W&B history, so it sends every step.

    Args:
        project: the W&B project.
        run_dir: the run directory.
        config: the resolved config, recorded by W&B.
        start_step: the step the run (re)starts from.
    """

    def __init__(
        self, project: str, run_dir: str | Path, config: dict[str, Any], start_step: int = 0
    ):
        try:
            import wandb
        except ImportError as err:
            raise ValueError(
                f"metrics.wandb_project={project!r} needs the wandb package; "
                "pip install 'mt-train[wandb]' or set metrics.wandb_project=''"
            ) from err
        self._wandb = wandb
        try:
            self._run = wandb.init(
                project=project, dir=str(run_dir), config=config,
                name=Path(run_dir).resolve().name,
                id=_wandb_run_id(run_dir), resume="allow",
            )  # fmt: skip
        except wandb.errors.Error as err:  # not logged in, no network, a bad project name
            detail = first_line(err)
            raise ValueError(
                f"metrics.wandb_project={project!r}: W&B could not start a run "
                f"({detail or type(err).__name__}); log in with `wandb login`, set "
                "WANDB_MODE=offline, or set metrics.wandb_project=''"
            ) from None
        self._start_step = start_step
        self._next_step = int(getattr(self._run, "starting_step", 0) or 0)
        self._warned = False

    def log(self, metrics: dict[str, Any]) -> None:
        """Logs one step's scalars (not a redone step the W&B run already holds)."""
        step = metrics["step"]
        if step < self._next_step:
            if not self._warned:
                self._warned = True
                log.warning(
                    "W&B run %s already holds steps up to %d, logged before this run resumed "
                    "from step %d; W&B keeps only increasing steps, so steps %d to %d are not "
                    "sent again (W&B shows the earlier values, metrics.jsonl this run's)",
                    getattr(self._run, "id", "?"), self._next_step - 1, self._start_step,
                    step, self._next_step - 1,
                )  # fmt: skip
            return
        self._run.log(_scalars(metrics), step=step)

    def close(self) -> None:
        """Finishes the run."""
        self._run.finish()


def _wandb_run_id(run_dir: str | Path) -> str:
    """The W&B run id of a run directory: the one saved there, else a new one (saved).

    Without it ``wandb.init(resume="allow")`` starts a new W&B run on every resume.
    """
    path = Path(run_dir) / "wandb_run_id"
    saved = path.read_text().strip() if path.is_file() else ""
    if saved:
        return saved
    run_id = secrets.token_hex(8)  # W&B ids: letters and digits, up to 64
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
    return run_id


def build_sinks(
    run_dir: str | Path,
    tensorboard: bool,
    wandb_project: str,
    config: dict[str, Any],
    start_step: int = 0,
) -> list[Any]:
    """Returns the optional metric writers a run asked for.

    Args:
        run_dir: the run directory.
        tensorboard: write TensorBoard event files.
        wandb_project: a Weights & Biases project, or "" for none.
        config: the resolved config, recorded by W&B.
        start_step: the step the run (re)starts from.

    Returns:
        The sinks, for `MetricsLogger(sinks=...)`.
    """
    sinks: list[Any] = []
    try:
        if tensorboard:
            sinks.append(TensorBoardSink(run_dir, start_step))
        if wandb_project:
            sinks.append(WandbSink(wandb_project, run_dir, config, start_step))
    except BaseException:  # the ones already open are closed, their files complete
        for sink in sinks:
            sink.close()
        raise
    return sinks
