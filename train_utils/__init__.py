"""Helpers of train.py / eval.py, one concern per module: checkpoint (atomic save, resume, RNG),
metrics (metrics.jsonl + wandb + loss plot + peak memory), validation (start-up checks of the config,
the one-line ending of expected errors), schema (the keys the YAML files declare, and the check for
any other), naming (unique run directories, wandb names and groups), slurm (DDP rendezvous from a
SLURM job, requeue after preemption).

configs/ composes with plain Hydra; importing the package registers the run-directory resolvers
(`${launch_time:}`, `${launch_id:}`) that resolving `hydra.run.dir` needs."""
from . import naming

naming.register_resolvers()
