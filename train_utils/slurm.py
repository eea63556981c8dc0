"""SLURM glue for train.py: the DDP rendezvous from the job's environment, and requeue after preemption.

`export_distributed_env()` sets the env:// variables only torchrun sets (MASTER_ADDR, RANK, ...) from
the job (submitit's JobEnvironment, else SLURM_*), before accelerate initialises; a no-op under
torchrun, with one task or outside SLURM. SLURM warns `signal_delay_s` before the time limit or on
preemption (SIGUSR2 for submitit, SIGUSR1 in ops/sbatch_train.sh); train.py checkpoints at the next
step and stops. Its handler replaced submitit's, so `requeue(handler)` hands over to submitit's after
the checkpoint (rank 0 requeues the same Hydra job, which resumes in the same run dir); outside
submitit it does nothing (ops/sbatch_train.sh requeues by itself).
"""
from __future__ import annotations

import os
import signal
import subprocess

def in_submitit_job() -> bool:
    try:
        import submitit

        return bool(submitit.JobEnvironment().activated())
    except Exception:  # submitit missing, or not inside a submitit job
        return False


def _first_slurm_host() -> str:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                               text=True, check=True, timeout=30).stdout.split()
        return hosts[0] if hosts else nodelist
    except (OSError, subprocess.SubprocessError):
        return nodelist.split(",")[0]


def export_distributed_env() -> None:
    """Set the torch.distributed env:// variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE) from the SLURM job.

    CUDA_VISIBLE_DEVICES is left alone: accelerate picks `cuda:LOCAL_RANK`, which needs every GPU of
    the node to stay visible to every task.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    if in_submitit_job():
        from submitit.helpers import TorchDistributedEnvironment

        env = TorchDistributedEnvironment()  # port derived from the job id: the same on every task
        if env.world_size <= 1:
            return
        env.export(set_cuda_visible_devices=False)
    elif "SLURM_PROCID" in os.environ and "SLURM_STEP_ID" in os.environ \
            and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        # `srun python train.py`: one task per GPU, no torchrun.
        ntasks = int(os.environ["SLURM_NTASKS"])
        nnodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
        job_id = int(os.environ.get("SLURM_JOB_ID", "0"))
        os.environ.update({
            "MASTER_ADDR": os.environ.get("MASTER_ADDR") or _first_slurm_host(),
            "MASTER_PORT": str(os.environ.get("MASTER_PORT") or 20000 + job_id % 40000),
            "RANK": os.environ["SLURM_PROCID"],
            "WORLD_SIZE": str(ntasks),
            "LOCAL_RANK": os.environ.get("SLURM_LOCALID", "0"),
            "LOCAL_WORLD_SIZE": str(ntasks // max(nnodes, 1)),
        })


def submitit_signal() -> int:
    """The signal submitit asks SLURM to send before the time limit: SIGUSR2 by default (submitit
    avoids USR1, which NCCL may use), or $SUBMITIT_PREEMPT_SIGNAL."""
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper()
    return getattr(signal, name if name.startswith("SIG") else "SIG" + name)


def requeue(previous_handlers: dict, signal_name: str | None) -> None:
    """After the preemption checkpoint: let submitit requeue the job (rank 0 exits inside this call).
    `previous_handlers`: what `signal.signal` returned for each signal train.py handles (in a submitit
    job, submitit's `checkpoint_and_try_requeue`). Only SIGUSR1/SIGUSR2 requeue; SIGTERM (scancel)
    means stop. Outside a submitit job: no-op.
    """
    if signal_name not in ("SIGUSR1", "SIGUSR2") or not in_submitit_job():
        return
    sig = submitit_signal()
    handler = previous_handlers.get(sig)
    if callable(handler):
        handler(sig, None)
