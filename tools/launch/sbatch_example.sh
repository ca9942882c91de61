#!/usr/bin/env bash
# An sbatch script for mt-train: one torchrun per node, checkpoint before the time limit.
#
#   sbatch tools/launch/sbatch_example.sh qwen3-30b-a3b run_dir=/shared/runs/q30 data.path=/shared/corpus
#
# --signal=B:USR1@120 makes SLURM send SIGUSR1 to this batch shell 120 s before the time
# limit; it is passed to every node's tools/launch/torchrun.sh, which asks the workers to
# save at the next step boundary and exit 0. Resubmitting the same command resumes from
# that checkpoint (add --dependency=afterany:$SLURM_JOB_ID to chain jobs).
#SBATCH --job-name=mt-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --output=logs/%x-%j.out
set -uo pipefail

export MASTER_PORT="${MASTER_PORT:-29500}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
# sbatch runs a copy of this script from its spool directory: find the repo by the
# submit directory (submit from the repository root).
here="${SLURM_SUBMIT_DIR:-$PWD}/tools/launch"

# srun starts the wrapper once per node; the batch shell gets the signal (B:) and passes
# it to srun, which signals the processes of the step: the workers and each node's
# torchrun.sh (which runs torchrun with SIGUSR1 ignored, as torchrun does not handle it).
srun --kill-on-bad-exit=1 bash "$here/torchrun.sh" -m mt_train pretrain "$@" &
step=$!
trap 'echo "sbatch: time limit near; asking the run to save"; kill -USR1 "$step"' USR1
trap 'kill -TERM "$step"' TERM
while kill -0 "$step" 2>/dev/null; do
  wait "$step"
done
wait "$step"  # its own status (bash keeps it), not 128+N of a wait a trap cut short
rc=$?
exit "$rc"
