"""The errors a user can cause with data settings: one clear line each, no traceback needed."""
from __future__ import annotations

__all__ = ["DataConfigError", "DataFileNotFoundError"]


class DataConfigError(ValueError):
    """An expected data problem: a bad value, path or tokenizer, or an unreachable Hub.

    The message names the setting, what was given and what to do instead. Anything else raised from
    ``data`` is a programming error and keeps its traceback.
    """


class DataFileNotFoundError(DataConfigError, FileNotFoundError):
    """A data file or directory that does not exist or holds nothing usable."""
