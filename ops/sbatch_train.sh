#!/bin/bash
# Plain sbatch launch of train.py (for clusters used without submitit): one torchrun per node, which
# starts one process per GPU; the nodes meet at the first node of the allocation (c10d rendezvous).
#
#   sbatch --nodes=2 --partition=gpu ops/sbatch_train.sh experiment=table2 model=llama_350m optimizer=frugal
#
# Everything after the script name goes to train.py as Hydra overrides. RUN_DIR (default
# runs/<job name>-<job id>) is fixed per job and kept across requeues, so a requeued job resumes from
# its latest checkpoint (train.resume=auto). It must be on a filesystem all nodes share.
#
# Time limit / preemption: SLURM sends SIGUSR1 to the job's processes 300 s before the end. torchrun is
# started with SIGUSR1 ignored (a Python process dies on an unhandled SIGUSR1; the ignore is inherited,
# and train.py installs its own handler), so the signal reaches the training ranks, which write a
# checkpoint and stop with a "preempted" row in metrics.jsonl. This script then requeues the job.
#SBATCH --job-name=frugal
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
#SBATCH --signal=USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -uo pipefail

GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
RUN_DIR="${RUN_DIR:-runs/${SLURM_JOB_NAME:-frugal}-${SLURM_JOB_ID}}"
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 40000))}"
# The batch shell itself must survive the signal too.
trap '' USR1

srun --kill-on-bad-exit=1 bash -c 'trap "" USR1; exec "$@"' torchrun torchrun \
  --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node="$GPUS_PER_NODE" \
  --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" \
  train.py hydra.run.dir="$RUN_DIR" train.resume=auto "$@"
status=$?

if [ "$status" -ne 0 ] && tail -n 1 "$RUN_DIR/metrics.jsonl" 2>/dev/null | grep -q '"event": *"preempted"'; then
  echo "checkpoint written after SIGUSR1: requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
