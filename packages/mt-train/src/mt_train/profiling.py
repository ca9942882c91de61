"""Optional profiling of a run: a PyTorch profiler trace over steps a..b, a CUDA memory
snapshot, and NVTX ranges per step (for Nsight Systems).

    mt-train pretrain debug profile.trace_steps=10,12 profile.memory_snapshot=true

Files go to ``<run_dir>/profile/``: ``trace_rank<r>_steps<a>-<b>.json`` (open in
chrome://tracing or https://ui.perfetto.dev) and ``memory_rank<r>.pickle`` (drag into
https://pytorch.org/memory_viz). Each is written beside its name and renamed when
complete; one that cannot be written (a full disk) is a warning, and training goes on.
``memory_snapshot`` and ``nvtx`` need CUDA: elsewhere rank 0 warns and they do nothing.
``tools/bench/trace_summary.py`` summarizes a GPU trace's kernel time and idle gaps.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("mt_train")
# Allocation events kept by the CUDA memory recorder (PyTorch's suggested default).
_MEMORY_MAX_ENTRIES = 100_000


def parse_trace_steps(text: str) -> tuple[int, int] | None:
    """Parses ``profile.trace_steps`` ("a,b", inclusive; "" for none).

    Args:
        text: the config value.

    Returns:
        (first, last) step, or None.
    """
    if not text.strip():
        return None
    parts = text.split(",")
    try:
        first, last = (int(p) for p in parts)
    except ValueError:
        first = last = -1
    if len(parts) != 2 or not 1 <= first <= last:
        raise ValueError(
            f"profile.trace_steps ({text!r}) must be 'a,b' with 1 <= a <= b, e.g. "
            "profile.trace_steps=10,12"
        )
    return first, last


class StepProfiler:
    """Starts and stops the profilers around the steps a run asked for.

    Args:
        run_dir: where ``profile/`` goes.
        rank: this process's rank (one file per rank).
        trace_steps: (first, last) steps to trace, or None.
        memory_snapshot: record CUDA allocations from the start; dump at the end of the
            traced steps (or of the run).
        nvtx: wrap each step in an NVTX range named ``step <n>`` (CUDA only; without
            it a warning says so, as for `memory_snapshot`).
    """

    def __init__(self, run_dir: str | Path, rank: int, trace_steps: tuple[int, int] | None,
                 memory_snapshot: bool, nvtx: bool):
        self.dir = Path(run_dir) / "profile"
        self.rank = rank
        self.trace_steps = trace_steps
        self.nvtx = nvtx and torch.cuda.is_available()
        self.memory = memory_snapshot and torch.cuda.is_available()
        # Said once, by rank 0: every rank would say the same.
        if memory_snapshot and not self.memory and rank == 0:
            log.warning("profile.memory_snapshot needs CUDA; no snapshot on this device")
        if nvtx and not self.nvtx and rank == 0:
            log.warning("profile.nvtx needs CUDA (Nsight Systems); no NVTX ranges on this device")
        self._profiler = None
        self._traced: list[int] = []  # the steps the running trace holds
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=_MEMORY_MAX_ENTRIES)

    @contextlib.contextmanager
    def step(self, step: int):
        """Profiles one step (numbered from 1) as configured.

        The trace starts at the first step of its range that runs: a run resumed inside
        the range traces the rest of it.
        """
        first, last = self.trace_steps or (0, -1)
        if self._profiler is None and not self._traced and first <= step <= last:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities, record_shapes=True, acc_events=True
            )
            self._profiler.__enter__()
        if self._profiler is not None:
            self._traced.append(step)  # now: a step that raises is in the trace, in part
        nvtx = torch.cuda.nvtx.range(f"step {step}") if self.nvtx else contextlib.nullcontext()
        with nvtx:
            yield
        if self._profiler is not None and step == last:
            self._finish_trace()

    def _finish_trace(self) -> None:
        self._profiler.__exit__(None, None, None)
        # The steps traced: fewer than asked when the run resumed inside the range or ended
        # before its end (the last one perhaps in part, when it raised).
        first, last = self._traced[0], self._traced[-1]
        path = self.dir / f"trace_rank{self.rank}_steps{first}-{last}.json"
        profiler, self._profiler = self._profiler, None
        # Written beside and renamed when complete: a full disk or a kill midway (a large
        # GPU trace takes a while) leaves no torn file under a finished trace's name. A
        # trace that cannot be written is not worth the run: it warns and training goes on.
        if self._write_renamed(path, profiler.export_chrome_trace, "profiler trace"):
            log.info("wrote profiler trace %s", path)
        self._dump_memory()

    def _write_renamed(self, path: Path, write: Callable[[str], None], what: str) -> bool:
        """Runs ``write(<path>.tmp)`` and renames the file to `path` when complete; on an
        OSError (a full disk, `profile` taken by a file) removes it, warns naming `what`
        and returns False: training goes on."""
        tmp = path.with_name(path.name + ".tmp")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)  # fails on a file of that name
            write(str(tmp))
            os.replace(tmp, path)
        except OSError as err:
            with contextlib.suppress(OSError):  # (no profile/ directory, say)
                tmp.unlink(missing_ok=True)
            log.warning("could not write the %s %s (%s); training goes on", what, path, err)
            return False
        return True

    def _dump_memory(self) -> None:
        if not self.memory:
            return
        path = self.dir / f"memory_rank{self.rank}.pickle"
        self.memory = False
        try:
            if self._write_renamed(path, torch.cuda.memory._dump_snapshot, "CUDA memory snapshot"):
                log.info("wrote CUDA memory snapshot %s", path)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)  # it slows every alloc

    def close(self) -> None:
        """Ends a trace cut short by the end of the run and dumps a pending snapshot."""
        if self._profiler is not None:
            self._finish_trace()
        self._dump_memory()
