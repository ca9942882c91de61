#!/usr/bin/env bash
# Launches `mt-train` (or any module) under torchrun on this node, inside or outside SLURM.
#
#   tools/launch/torchrun.sh -m mt_train pretrain qwen3-30b-a3b training.max_steps=1000
#
# Processes per node: $NPROC_PER_NODE, else the GPUs nvidia-smi lists, else 1.
# Nodes and rendezvous: inside a SLURM allocation ($SLURM_JOB_ID), nnodes is
# $SLURM_NNODES, the node rank $SLURM_NODEID and the rendezvous host the first node of
# $SLURM_JOB_NODELIST (c10d rendezvous on $MASTER_PORT, default 29500); outside SLURM,
# $NNODES / $NODE_RANK / $MASTER_ADDR, defaulting to one node (--standalone).
#
# Signals: SIGTERM, SIGINT and SIGUSR1 (SLURM's early warning, see sbatch_example.sh) are
# forwarded to torchrun as SIGTERM; torchrun passes it to the workers, which save a
# checkpoint at the next step boundary and exit 0, then SIGKILLs them after 30 s.
# torchrun itself exits non-zero after forwarding a signal, so this wrapper asks each
# node's local rank 0 to write $MT_TRAIN_EXIT_FILE after a clean stop and exits 0 when it
# did. SLURM signals every process of a job step (--signal=USR1@120 without B:, scancel
# --signal, srun forwarding sbatch_example.sh's USR1), torchrun included: torchrun runs
# with SIGUSR1 ignored (unhandled, it would kill torchrun and orphan the workers), and
# only the first signal is forwarded (torchrun abandons its grace period, and leaves the
# workers running on their own, at its third SIGTERM).
set -uo pipefail

if [[ -n "${NPROC_PER_NODE:-}" ]]; then
  nproc="$NPROC_PER_NODE"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  nproc="$(nvidia-smi -L | grep -c '^GPU')"
else
  nproc=1
fi

port="${MASTER_PORT:-29500}"
if [[ -n "${SLURM_JOB_ID:-}" && "${SLURM_NNODES:-1}" -gt 1 ]]; then
  head="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  rdzv=(--nnodes="$SLURM_NNODES" --node-rank="$SLURM_NODEID"
        --rdzv-backend=c10d --rdzv-endpoint="$head:$port" --rdzv-id="$SLURM_JOB_ID")
elif [[ "${NNODES:-1}" -gt 1 ]]; then
  rdzv=(--nnodes="$NNODES" --node-rank="${NODE_RANK:?set NODE_RANK for NNODES>1}"
        --rdzv-backend=c10d --rdzv-endpoint="${MASTER_ADDR:?set MASTER_ADDR}:$port"
        --rdzv-id="${RDZV_ID:-mt-train}")
else
  rdzv=(--standalone)
fi

exit_file="$(mktemp "${TMPDIR:-/tmp}/mt-train-exit.XXXXXX")"
rm -f "$exit_file"
export MT_TRAIN_EXIT_FILE="$exit_file"
signalled=0
forwarded=0
forward() {
  signalled=1
  [[ "$forwarded" == 1 ]] && return  # torchrun is already stopping the workers
  echo "torchrun.sh: received $1; asking the workers to save and stop" >&2
  [[ -n "${child:-}" ]] && forwarded=1 && kill -TERM "$child" 2>/dev/null
}
trap 'forward SIGTERM' TERM
trap 'forward SIGINT' INT
trap 'forward SIGUSR1' USR1

echo "torchrun.sh: ${nproc} process(es) per node, ${rdzv[*]}" >&2
if [[ "$signalled" == 1 ]]; then  # nothing has run yet, so nothing is left to save
  echo "torchrun.sh: stopped by a signal before torchrun started" >&2
  exit 0
fi
# SIGUSR1 stays ignored across exec; the workers set their own handler (mt_train.faults).
(trap '' USR1; exec "${PYTHON:-python}" -m torch.distributed.run --nproc-per-node="$nproc" \
  "${rdzv[@]}" "$@") &
child=$!
[[ "$signalled" == 1 ]] && forward "a signal as torchrun started"
# `wait` returns early when a trapped signal arrives; wait again until torchrun is gone.
while kill -0 "$child" 2>/dev/null; do
  wait "$child"
done
wait "$child"  # its own status (bash keeps it), not 128+N of a wait a trap cut short
rc=$?
if [[ "$signalled" == 1 && -f "$exit_file" ]]; then
  echo "torchrun.sh: stopped cleanly after a signal: $(cat "$exit_file")" >&2
  rc=0
fi
rm -f "$exit_file"
exit "$rc"
