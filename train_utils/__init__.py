"""Helpers of train.py / eval.py, one concern per module: checkpoint (atomic save, resume, RNG),
metrics (metrics.jsonl + wandb + loss plot + peak memory), config (start-up validation)."""
