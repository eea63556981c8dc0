"""Helpers of train.py / eval.py, one concern per module (tests/test_extending.py keeps this list whole):

- run: the run record train.py passes whole, and `session` (processes, signals, clean-up)
- startup: a run's start-up before its first step (config checks, run dir, resume plan, building the parts)
  and train.py's command line (errors as one line, exit codes)
- loop: the step's parts (forward/backward, gradient norm, the one host sync) and evaluation
- report: what the start, each step (`training_row`), a stop and the end log and say
- measure: what a training row measures besides the loss (time, throughput, MFU, peak memory)
- metrics: metrics.jsonl, wandb, train.log, the loss plot
- hooks: FRUGAL's loop hooks for any torch optimizer
- checkpoint, sharded_checkpoint: atomic, verified checkpoints (one file set; FSDP2 shards)
- resume: which checkpoint continues a run, whether the config still describes it, restoring it
- divergence: the last checkpoint from before the loss blew up
- distributed: the processes (DDP / FSDP2), collective timeouts
- signals: stop signals as a flag read at step boundaries
- slurm: the DDP rendezvous from a SLURM job, requeue after preemption
- run_lock: one run per run directory
- memory_plan, memory_check: the per-rank peak memory, planned; the start-up refusal of what cannot fit
- schema: the config keys the YAML files declare, and the one-line errors for others
- validation: start-up checks of a composed config, and how an expected error ends a run
- sweep_check: every job of a sweep checked before the first starts
- toy: debug=toy's update gaps fitted to the toy run
- naming: run directories, wandb names and groups
- results: runs as records (`load_runs`) for the tables, the plots, sweep status and your own tables
- state_free_comm: train.state_free_comm, FRUGAL's state-free part as a one-bit vote under DDP (frugal.comm)

configs/ composes with plain Hydra; importing the package registers the run-directory resolvers
(`${launch_time:}`, `${launch_id:}`) that resolving `hydra.run.dir` needs. It imports no torch (train.py
installs its stop-signal handler from `signals` before the heavy imports)."""
from . import naming

naming.register_resolvers()
