"""Helpers of train.py / eval.py, one concern per module: checkpoint (atomic save, resume, RNG),
metrics (metrics.jsonl + wandb + loss plot + peak memory), validation (start-up checks of the config,
the one-line ending of expected errors), schema (the config schema generated from configs/ and the
optimizer registry), naming (unique run directories, wandb names and groups), slurm (DDP rendezvous
from a SLURM job, requeue after preemption).

Importing the package registers the config schema in Hydra's ConfigStore and the run-directory
resolvers with OmegaConf: configs/ composes only after `import train_utils` (train.py, eval.py and
tests/conftest.py import it first)."""
from . import naming, schema

schema.register()
naming.register_resolvers()
