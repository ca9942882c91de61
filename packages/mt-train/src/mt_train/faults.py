"""How the loop meets faults: stop signals, non-finite steps, and the launcher's exit file.

SIGTERM, SIGINT and SIGUSR1 set a flag; the ranks agree on it at each step boundary
(`agree_to_stop`), save, and return normally, so the process exits 0. SIGTERM and SIGUSR1
during setup are kept too, and the run stops before its first step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
from pathlib import Path

import torch

from mt_train.distributed import all_reduce, share_failure

log = logging.getLogger("mt_train")
# Signals that ask for a save and a clean exit: SIGUSR1 is what SLURM sends early
# (sbatch --signal=B:USR1@120, tools/launch/sbatch_example.sh).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# The scheduler's among them, which setup defers too (`pretrain`); a Ctrl-C there still
# ends the process at once, as nothing was trained yet.
SCHEDULER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# tools/launch/torchrun.sh names a file here (one per node); the node's local rank 0 writes
# it after a clean stop, so the wrapper can report success although torchrun exits
# non-zero after forwarding a signal.
EXIT_FILE_ENV = "MT_TRAIN_EXIT_FILE"


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm under ``training.on_nonfinite='stop'``."""


@contextlib.contextmanager
def stop_on_signals(state, signals=STOP_SIGNALS):
    """While active, SIGTERM, SIGINT and SIGUSR1 (`signals`) set ``state.signal_received``.

    The loop then saves and stops at the next step boundary, where `agree_to_stop` sets
    ``state.stop_requested`` on every rank at once. The handler never sets that flag
    itself: a signal that arrives on one rank after the boundary's agreement would make
    that rank leave the loop alone while the others run the next step's collectives.
    A second SIGINT (Ctrl-C twice) in a process started without torchrun gives up at
    once. Under torchrun a worker often gets a signal twice (from the terminal or
    scheduler, then forwarded by the agent), so repeats are ignored there: the agent
    SIGKILLs after its grace period anyway. The previous handlers come back on exit.
    Outside the main thread (`pretrain` called from a worker thread), where Python allows
    no handlers, signals keep their current handling.

    Args:
        state: the loop state (`mt_train.train.TrainState`), or any object with a
            ``signal_received`` attribute (`pretrain` uses one during setup).
        signals: the signals to handle.
    """
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ

    def request_stop(signum, frame):
        if state.signal_received:
            if signum == signal.SIGINT and not under_torchrun:
                raise KeyboardInterrupt
            return
        state.signal_received = True
        log.warning("received %s; saving a checkpoint after this step",
                    signal.Signals(signum).name)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, request_stop) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def write_exit_file(state) -> None:
    """Tells tools/launch/torchrun.sh, through $MT_TRAIN_EXIT_FILE, of a clean stop.

    Each node runs its own wrapper with its own file, so each node's local rank 0 writes
    it (global rank 0 alone left the other nodes' wrappers reporting a failure). It is
    called after the stop's save, which every rank completed together.

    Args:
        state: the loop state; the step and why the run stopped are written.
    """
    path = os.environ.get(EXIT_FILE_ENV)
    if path and state.env.local_rank == 0:
        reason = "signal" if state.stop_requested else "finished"
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps({"step": state.step, "reason": reason}))
        os.replace(tmp, path)


def agree_to_stop(state, failure: Exception | None = None) -> bool:
    """All ranks stop at the same step boundary if any of them received a signal.

    A `failure` of this rank's own work since the last boundary (rank 0's metrics write)
    rides on the same all-reduce: then every rank raises (`share_failure`), instead of
    the others running into the next step's collectives and waiting there until
    ``parallel.timeout_s``.

    Args:
        state: the loop state.
        failure: what this rank's step work raised, if anything.

    Returns:
        True when some rank has `signal_received` set.
    """
    flag = 2 if failure is not None else int(state.signal_received)
    agreed = int(all_reduce(torch.tensor(flag, device=state.device), op="max"))
    if agreed == 2:
        if state.env.world_size == 1:
            raise failure
        share_failure(failure, f"finishing step {state.step}")
    return bool(agreed)
