"""Hydra's basic sweeper, with the command line winning over a preset's sweep of the same key.

`-m experiment=table15_update_gap optimizer.update_gap=10,20` is two jobs. train.py writes the command
line's key as a force-add (`++optimizer.update_gap=10,20`, `train_utils.schema.force_add_key_overrides`),
which BasicSweeper, keying on the override's text, took for another key than the preset's
`hydra.sweeper.params` one (their product ran). This sweeper keys on the bare key: the later override
replaces the earlier one in place, so the jobs keep the preset's numbering. Like every plugin it
imports neither torch nor the repository's packages (Hydra imports it when it scans its plugins).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import List, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException


def bare_key(override: Override) -> str:
    """The key an override sets, without the `+` / `++` of a (force-)add."""
    return override.get_key_element().lstrip("+")


class CommandLineWinsSweeper(BasicSweeper):
    @staticmethod
    def split_arguments(overrides: List[Override], max_batch_size: Optional[int]) -> List[List[List[str]]]:
        """BasicSweeper.split_arguments with one entry per bare key (the last override of a key wins,
        at the place of its first)."""
        final: "OrderedDict[str, list[str]]" = OrderedDict()
        for override in overrides:
            key = override.get_key_element()
            if override.is_sweep_override():
                if not override.is_discrete_sweep():
                    raise HydraException(f"{CommandLineWinsSweeper.__name__} does not support sweep type: "
                                         f"{override.value_type.name if override.value_type else None}")
                final[bare_key(override)] = [f"{key}={value}" for value in override.sweep_string_iterator()]
            else:
                final[bare_key(override)] = [f"{key}={override.get_value_element_as_str()}"]
        jobs = [list(job) for job in itertools.product(*final.values())]
        if max_batch_size is None:
            return [jobs]
        return list(BasicSweeper.split_overrides_to_chunks(jobs, max_batch_size))
