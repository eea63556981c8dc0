"""Renamed to train_utils/validation.py (it validates; it holds no config). Kept only until train.py
and eval.py import from there: `from train_utils.validation import ConfigError, validate_config`."""
from .validation import PRECISIONS, WANDB_MODES, ConfigError, validate_config as validate  # noqa: F401
