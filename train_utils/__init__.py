"""Helpers of train.py / eval.py, one concern per module: checkpoint (atomic save, resume, RNG),
metrics (metrics.jsonl + wandb + loss plot + peak memory), config (start-up validation),
slurm (DDP rendezvous from a SLURM job, requeue after preemption)."""
